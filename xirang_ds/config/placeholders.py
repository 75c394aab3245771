"""HF Trainer's and Accelerate's ``"auto"`` placeholders in a ds_config, for the commands that read one
before any trainer fills it (``xirang-ds validate``, ``estimate``, ``bench``, ``tune``).

At run time HF Trainer and Accelerate replace each ``"auto"`` outside the ``"xirang"`` block with a value
of their own (``TrainingArguments.per_device_train_batch_size``, ``max_grad_norm``, ``bf16``, the model's
hidden size, ...; ``transformers/integrations/deepspeed.py`` ``trainer_config_process``). A command run
before that takes each value from ``--set KEY=VALUE``. `fill_placeholders` fills what it can say without
guessing: ``train_batch_size`` is left to DeepSpeed, which derives it from the micro-batch, the
accumulation and the ranks as HF does, and the optimizer's and scheduler's numbers, which change no byte
of memory, get TrainingArguments' defaults (each named in a note). Every other placeholder is a problem
naming the field, the flag and the TrainingArguments field it stands for, all at once.
"""
from __future__ import annotations

import copy
import json
from typing import Any, Iterator

from xirang_ds.config.loader import BLOCK_KEY, validate_block
from xirang_ds.config.validate import XirangConfigError, describe_value

PLACEHOLDER = "auto"

MEMORY_NEUTRAL: dict[str, Any] = {
    "optimizer.params.lr": 5e-5, "optimizer.params.betas": [0.9, 0.999], "optimizer.params.eps": 1e-8,
    "optimizer.params.weight_decay": 0.0, "scheduler.params.warmup_min_lr": 0,
    "scheduler.params.warmup_max_lr": 5e-5, "scheduler.params.warmup_num_steps": 1,
    "scheduler.params.total_num_steps": 1000,
}
"""Fields whose value changes no memory → TrainingArguments' default (``warmup_num_steps``: HF's
``max(1, warmup_steps)``)."""

HF_SOURCES: dict[str, tuple[str, str]] = {
    "train_micro_batch_size_per_gpu": ("TrainingArguments.per_device_train_batch_size", "8"),
    "gradient_accumulation_steps": ("TrainingArguments.gradient_accumulation_steps", "1"),
    "gradient_clipping": ("TrainingArguments.max_grad_norm", "1.0"),
    "bf16.enabled": ("TrainingArguments.bf16", "true"),
    "fp16.enabled": ("TrainingArguments.fp16", "false"),
    "zero_optimization.reduce_bucket_size": ("hidden_size * hidden_size", "16777216"),
    "zero_optimization.stage3_prefetch_bucket_size": ("0.9 * hidden_size * hidden_size", "15099494"),
    "zero_optimization.stage3_param_persistence_threshold": ("10 * hidden_size", "40960"),
}
"""Placeholder → (what HF fills it from, an example value) for the problem's message."""


def _placeholders(node: Any, prefix: str = "") -> Iterator[str]:
    """Dotted paths of the ``"auto"`` values outside the block."""
    for key, value in node.items():
        path = f"{prefix}{key}"
        if path == BLOCK_KEY:
            continue
        if isinstance(value, dict):
            yield from _placeholders(value, path + ".")
        elif value == PLACEHOLDER:
            yield path


def _put(ds_config: dict, path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    node = ds_config
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value


def parse_settings(items: list[str]) -> dict[str, Any]:
    """``["train_micro_batch_size_per_gpu=8", "bf16.enabled=true"]`` → ``{path: value}``; a value is read
    as JSON (``8``, ``true``, ``[0.9, 0.999]``), else kept as text.

    Raises:
        XirangConfigError: every item that is not ``KEY=VALUE``.
    """
    settings, problems = {}, []
    for item in items:
        key, eq, text = item.partition("=")
        if not eq or not key.strip():
            problems.append(("--set", f"must be KEY=VALUE (e.g. --set train_micro_batch_size_per_gpu=8); "
                                      f"got {describe_value(item)}"))
            continue
        try:
            settings[key.strip()] = json.loads(text)
        except ValueError:
            settings[key.strip()] = text
    if problems:
        raise XirangConfigError(problems, title="bad --set")
    return settings


def fill_placeholders(ds_config: dict, settings: dict[str, Any]) -> tuple[dict, list[str]]:
    """The ds_config with ``settings`` applied and its placeholders filled, and a note per field filled
    without a setting.

    Raises:
        XirangConfigError: every placeholder that needs a value, with the ``--set`` to pass, and the block's
            own problems beside them.
    """
    filled = copy.deepcopy(ds_config)
    for path, value in settings.items():
        _put(filled, path, value)
    notes, problems = [], []
    for path in list(_placeholders(filled)):
        if path == "train_batch_size":
            del filled["train_batch_size"]
            notes.append('train_batch_size "auto": left to DeepSpeed (micro-batch x accumulation x ranks, as '
                         "HF fills it)")
        elif path in MEMORY_NEUTRAL:
            _put(filled, path, MEMORY_NEUTRAL[path])
            notes.append(f'{path} "auto": {describe_value(MEMORY_NEUTRAL[path])} (TrainingArguments\' default; '
                         f"no effect on memory; --set {path}=VALUE to change)")
        else:
            source, example = HF_SOURCES.get(path, ("the trainer", "VALUE"))
            problems.append((path, f'"auto" is filled by HF Trainer/Accelerate at run time (from {source}); this '
                                   f"command needs the value the run will use: pass --set {path}={example}"))
    if problems:
        raise XirangConfigError(problems + _block_problems(filled), title="HF \"auto\" fields without a value")
    return filled, notes


def _block_problems(ds_config: dict) -> list[tuple[str, str]]:
    """The block's own problems (its schema only: its checks against the ds_config need the values; a
    ``"preset": "auto"`` needs the model)."""
    block = ds_config.get(BLOCK_KEY)
    if block is None:
        return []
    if isinstance(block, dict) and block.get("preset") == PLACEHOLDER:
        block = {k: v for k, v in block.items() if k not in ("preset", "sensitivity")}
    try:
        validate_block(block)
    except XirangConfigError as e:
        return e.problems
    return []


__all__ = ["HF_SOURCES", "MEMORY_NEUTRAL", "fill_placeholders", "parse_settings"]
