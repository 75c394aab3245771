"""Generic, annotation-driven validation of the ``"xirang"`` block.

`convert(value, annotation, path, problems)` turns a JSON value into the typed value the schema
declares. It never raises on bad input: it appends ``(path, message)`` to ``problems`` and returns
a placeholder, so one pass reports every problem in the block at once, the way torchtune's
``ConfigError`` lists them. `XirangConfigError` then carries them all.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, Literal, Optional, Union, get_args, get_origin

from xirang_ds.config.types import AUTO, ByteSize, parse_byte_size

Problems = list[tuple[str, str]]
_INVALID = object()


class XirangConfigError(ValueError):
    """Every problem found in a ``"xirang"`` block, each with its dotted path.

    Attributes:
        problems: ``[(path, message), ...]`` in the order they were found.

    Example:
        >>> try:
        ...     load_config({"xirang": {"monitor": {"warn_at": 1.5}}})
        ... except XirangConfigError as e:
        ...     print(e)
        invalid "xirang" block (1 problem):
          xirang.monitor.warn_at: must be between 0 and 1; got 1.5
    """

    def __init__(self, problems: Problems, title: Optional[str] = None):
        self.problems = list(problems)
        count = len(self.problems)
        if title is not None:
            lines = [f"{title} ({count} problem{'s' if count != 1 else ''}):"]
        elif all(not path for path, _ in self.problems):
            lines = ["cannot use this ds_config:"]
        else:
            lines = [f'invalid "xirang" block ({count} problem{"s" if count != 1 else ""}):']
        lines += [f"  {path}: {message}" if path else f"  {message}" for path, message in self.problems]
        super().__init__("\n".join(lines))


def describe_value(value: Any) -> str:
    """The value as the user wrote it, for "got ..." in messages."""
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1e6:
        return f"{value:g}"
    if isinstance(value, (dict, list)):
        text = repr(value)
        return text if len(text) < 60 else text[:57] + "..."
    return repr(value)


def type_name(annotation: Any) -> str:
    """How a type is named to users: JSON words, not Python ones."""
    origin = get_origin(annotation)
    if origin is typing.Annotated:
        base, *rules = get_args(annotation)
        notes = [r.describe() for r in rules if hasattr(r, "describe")]
        notes += [f"a multiple of {r.base}" for r in rules if hasattr(r, "base")]
        words = ", ".join(n.replace("must be ", "") for n in notes)
        return type_name(base) + (f" ({words})" if words else "")
    if origin is Literal:
        return " | ".join(describe_value(a) for a in get_args(annotation))
    if origin is Union:
        return " or ".join(type_name(a) for a in get_args(annotation) if a is not type(None))
    if origin in (list, tuple):
        item = get_args(annotation)[0]
        if get_origin(item) is Literal:
            return f"a list of {type_name(item)}"
        if dataclasses.is_dataclass(item):
            return "a list of objects"
        return "a list of " + {str: "strings", int: "integers", float: "numbers"}.get(item, type_name(item))
    if origin is dict:
        return f"an object of {type_name(get_args(annotation)[1])}"
    if annotation is ByteSize:
        return 'a byte count (integer or a string like "40GB")'
    if dataclasses.is_dataclass(annotation):
        return "an object"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        annotation, getattr(annotation, "__name__", str(annotation)))


def suggest(word: str, choices: typing.Iterable[str]) -> str:
    """A ``"; did you mean 'x'?"`` suffix, or an empty string when nothing is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def convert(value: Any, annotation: Any, path: str, problems: Problems) -> Any:
    """Convert ``value`` to ``annotation``; record problems instead of raising."""
    origin = get_origin(annotation)
    if origin is typing.Annotated:
        base, *rules = get_args(annotation)
        result = convert(value, base, path, problems)
        if result is _INVALID:
            return result
        for rule in rules:
            message = rule.check(result)
            if message:
                problems.append((path, f"{message}; got {describe_value(value)}"))
                return _INVALID
        return result
    if origin is Union:
        return _convert_union(value, annotation, path, problems)
    if origin is Literal:
        choices = get_args(annotation)
        if value in choices and type(value) in {type(c) for c in choices}:
            return value
        hint = suggest(value, [str(c) for c in choices]) if isinstance(value, str) else ""
        problems.append((path, f"must be one of {', '.join(describe_value(c) for c in choices)}; "
                               f"got {describe_value(value)}{hint}"))
        return _INVALID
    if origin in (list, tuple):
        if not isinstance(value, list):
            problems.append((path, f"must be {type_name(annotation)}; got {describe_value(value)}"))
            return _INVALID
        (item_type, *_) = get_args(annotation)
        items = [convert(v, item_type, f"{path}[{i}]", problems) for i, v in enumerate(value)]
        return tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            problems.append((path, f"must be {type_name(annotation)}; got {describe_value(value)}"))
            return _INVALID
        key_type, item_type = get_args(annotation)
        return {k: convert(v, item_type, f"{path}.{k}", problems) for k, v in value.items()}
    if dataclasses.is_dataclass(annotation):
        return convert_section(value, annotation, path, problems)
    return _convert_scalar(value, annotation, path, problems)


def _convert_union(value: Any, annotation: Any, path: str, problems: Problems) -> Any:
    options = get_args(annotation)
    if value is None and type(None) in options:
        return None
    # Try each option quietly; the first that converts wins.
    for option in options:
        if option is type(None):
            continue
        trial: Problems = []
        result = convert(value, option, path, trial)
        if not trial:
            return result
    # No option fits: report the most specific message. A value of the right kind that is out
    # of range says so; otherwise list the kinds that are allowed.
    for option in options:
        trial = []
        convert(value, option, path, trial)
        if trial and not trial[0][1].startswith("must be one of") and not trial[0][1].startswith("must be a"):
            problems.extend(trial)
            return _INVALID
    allowed = " or ".join(type_name(o) for o in options if o is not type(None))
    problems.append((path, f"must be {allowed}; got {describe_value(value)}"))
    return _INVALID


def _convert_scalar(value: Any, annotation: Any, path: str, problems: Problems) -> Any:
    if annotation is bool:
        if isinstance(value, bool):
            return value
    elif annotation is ByteSize:
        if isinstance(value, str):
            parsed = parse_byte_size(value)
            if parsed is not None and value.strip().lower() != AUTO:
                return ByteSize(parsed)
            problems.append((path, f'must be a byte count such as 1073741824, 5e8 or "40GB"; '
                                   f"got {describe_value(value)}"))
            return _INVALID
        as_int = _as_int(value)
        if as_int is not None and as_int >= 0:
            return ByteSize(as_int)
        if as_int is not None:
            problems.append((path, f"must be >= 0; got {describe_value(value)}"))
            return _INVALID
    elif annotation is int:
        as_int = _as_int(value)
        if as_int is not None:
            return as_int
    elif annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif annotation is str:
        if isinstance(value, str):
            return value
    elif annotation is Any:
        return value
    problems.append((path, f"must be {type_name(annotation)}; got {describe_value(value)}"))
    return _INVALID


def _as_int(value: Any) -> int | None:
    """Integers, and floats with no fractional part as DeepSpeed users write them (``5e8``)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def convert_section(value: Any, cls: type, path: str, problems: Problems) -> Any:
    """Build the dataclass ``cls`` from a JSON object, checking keys and fields."""
    if not isinstance(value, dict):
        problems.append((path, f"must be an object; got {describe_value(value)}"))
        return _INVALID
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in value:
        if key not in fields:
            where = f"{path}.{key}" if path else str(key)
            problems.append((where, f"unknown key{suggest(str(key), fields)} "
                                    f"(allowed: {', '.join(sorted(fields))})"))
    before = len(problems)
    kwargs = {}
    hints = typing.get_type_hints(cls, include_extras=True)
    for name, field in fields.items():
        if name in value:
            converted = convert(value[name], hints[name], f"{path}.{name}" if path else name, problems)
            if converted is not _INVALID:
                kwargs[name] = converted
    if len(problems) > before:
        return _INVALID
    section = cls(**kwargs)
    check = getattr(section, "check", None)
    if check is not None:
        for where, message in check():
            problems.append((f"{path}.{where}" if where else path, message))
    return section
