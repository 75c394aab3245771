"""Read a ds_config (path or dict, JSON or YAML) and return its validated ``"xirang"`` block.

Resolution order: the preset's settings, then the user's keys over them key by key, then type and
range validation of the merged block, then the check that every enabled section has a plugin.
"""
from __future__ import annotations

import copy
import json
import os
from typing import Any, Mapping, Optional, Union

from xirang_ds.config.presets import PRESETS, expand_preset
from xirang_ds.config.schema import XirangConfig
from xirang_ds.config.sections import block_type, check_available, extension_sections
from xirang_ds.config.validate import XirangConfigError, convert_section, describe_value, suggest

BLOCK_KEY = "xirang"
DsConfig = Union[str, os.PathLike, Mapping[str, Any]]


def _decode_base64(text: str) -> Optional[dict]:
    """A ds_config passed as urlsafe base64 of its JSON, or None if ``text`` is not one."""
    import base64
    import binascii

    if not text or any(c in text for c in "/\\. "):
        return None
    try:
        data = json.loads(base64.urlsafe_b64decode(text).decode("utf-8"))
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_ds_config(ds_config: DsConfig) -> dict:
    """Load a ds_config from a JSON or YAML file or urlsafe base64 of its JSON (as DeepSpeed accepts
    it), or copy a dict.

    Raises:
        XirangConfigError: the file is missing, unreadable, not JSON/YAML, or not an object.
    """
    if isinstance(ds_config, Mapping):
        return copy.deepcopy(dict(ds_config))
    if not isinstance(ds_config, (str, os.PathLike)):
        raise XirangConfigError([("", f"ds_config must be a path or a dict; got {type(ds_config).__name__}")])
    path = os.fspath(ds_config)
    if not os.path.isfile(path):
        decoded = _decode_base64(path)
        if decoded is not None:  # as DeepSpeed accepts it (runtime/config.py; its autotuner passes one)
            return decoded
        raise XirangConfigError([("", f"config file not found: {path!r}; check the path "
                                      "(it is resolved against the current directory "
                                      f"{os.getcwd()!r})")])
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith((".yaml", ".yml")):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise XirangConfigError([("", f"{path}: YAML syntax error{where}: "
                                          f"{getattr(e, 'problem', e)}; fix the file")]) from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise XirangConfigError([("", f"{path}: JSON syntax error at line {e.lineno}, column {e.colno}: "
                                          f"{e.msg}; fix the file (YAML files need a .yaml or .yml suffix)")]) from None
    if not isinstance(data, dict):
        raise XirangConfigError([("", f"{path}: a ds_config must be an object at the top level; "
                                      f"got {type(data).__name__}")])
    return data


def resolve_block(block: Any, problems: Optional[list[tuple[str, str]]] = None) -> dict:
    """The block with its preset expanded and the user's keys laid over it (not yet validated).

    Args:
        problems: where an unknown preset is reported; the block is then returned without a preset
            so the rest of it is still checked (every problem at once). Without it, an unknown preset
            raises.

    Raises:
        XirangConfigError: the block is not an object, or (without ``problems``) names no preset.
    """
    if not isinstance(block, dict):
        raise XirangConfigError([(BLOCK_KEY, f'must be an object such as {{"preset": "balanced"}}; '
                                             f"got {describe_value(block)}")])
    preset = block.get("preset")
    local: list[tuple[str, str]] = []
    if preset == "auto":  # resolved where the model is known (`xirang_ds.planning.auto`)
        local.append((f"{BLOCK_KEY}.preset", "\"auto\" is chosen from the model's parameters against memory_budget, "
                                             "and this path has no model. Fix: use xirang_ds.initialize (or "
                                             "patch_deepspeed), pass --model to xirang-ds validate / estimate, or "
                                             "name a preset (conservative, balanced, aggressive)"))
        block = {k: v for k, v in block.items() if k not in ("preset", "sensitivity")}
        preset = None
    elif "sensitivity" in block:
        local.append((f"{BLOCK_KEY}.sensitivity", f"applies only with \"preset\": \"auto\" (it bounds the presets auto "
                                                  f"may take); got preset {describe_value(preset)}. Fix: remove it, or "
                                                  "set preset to \"auto\""))
        block = {k: v for k, v in block.items() if k != "sensitivity"}
    if local:
        if problems is None:
            raise XirangConfigError(local)
        problems.extend(local)
    if preset is None:
        return copy.deepcopy(block)
    if not isinstance(preset, str) or preset not in PRESETS:
        names = (*PRESETS, "auto")
        problem = (f"{BLOCK_KEY}.preset", f"must be one of {', '.join(map(repr, names))}; "
                                          f"got {describe_value(preset)}{suggest(str(preset), names)}")
        if problems is None:
            raise XirangConfigError([problem])
        problems.append(problem)
        return {k: copy.deepcopy(v) for k, v in block.items() if k != "preset"}
    return deep_merge(expand_preset(preset), block)


def deep_merge(base: dict, over: dict) -> dict:
    """A copy of ``base`` with ``over`` laid on it: nested dicts merged key by key, anything else
    replaced (how a user's keys override a preset's)."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def validate_block(block: Any) -> XirangConfig:
    """Validate a ``"xirang"`` block (the value of the key, not the whole ds_config).

    Raises:
        XirangConfigError: every problem in the block, each with its dotted path.
    """
    problems: list[tuple[str, str]] = []
    resolved = resolve_block(block, problems)
    extensions = extension_sections()
    builtin = {k: v for k, v in resolved.items() if k not in extensions}
    config = convert_section(builtin, block_type(), BLOCK_KEY, problems)
    # third-party sections come from entry points; validate them with their own type
    ext_values = {}
    for name, cls in extensions.items():
        if name in resolved:
            ext_values[name] = convert_section(resolved[name], cls, f"{BLOCK_KEY}.{name}", problems)
    if problems:
        raise XirangConfigError(problems)
    object.__setattr__(config, "extensions", ext_values)
    problems = check_available(config)
    if problems:
        raise XirangConfigError(problems)
    return config


def load_config(ds_config: DsConfig) -> Optional[XirangConfig]:
    """Read a ds_config and return its validated ``"xirang"`` block.

    Args:
        ds_config: a path to a JSON or YAML ds_config, or the ds_config dict.

    Returns:
        The frozen `XirangConfig`, or ``None`` when the ds_config has no ``"xirang"`` block (the
        run is then plain DeepSpeed).

    Raises:
        XirangConfigError: the file cannot be read, or the block has problems (all listed).

    Example:
        >>> cfg = load_config({"train_batch_size": 8, "xirang": {"monitor": {"enabled": True}}})
        >>> cfg.monitor.warn_at
        0.85
    """
    data = read_ds_config(ds_config)
    if BLOCK_KEY not in data:
        return None
    return validate_block(data[BLOCK_KEY])


def to_dict(config: XirangConfig) -> dict:
    """The resolved block as plain JSON data (what ``validate --show-resolved`` prints)."""
    import dataclasses

    def plain(value):
        if dataclasses.is_dataclass(value):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                    if f.init and not (f.name == "until_step" and getattr(value, f.name) is None)}
        if isinstance(value, tuple):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, int) and not isinstance(value, bool):
            return int(value)
        return value

    out = plain(config)
    for name, section in config.extensions.items():
        out[name] = plain(section)
    return out


__all__ = ["BLOCK_KEY", "load_config", "read_ds_config", "validate_block", "to_dict"]
