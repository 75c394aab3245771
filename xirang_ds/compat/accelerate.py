"""Accelerate's DeepSpeed plugin, kept off the ``"xirang"`` block.

setup.py's test extra allows ``accelerate>=0.30``; the lines below were read in 1.15.0 (the tested version).
Accelerate (``accelerate launch`` and HF Trainer, which prepares its engine through Accelerate) fills the
ds_config's ``"auto"`` strings from its own arguments just before it calls ``deepspeed.initialize``:
``Accelerator._prepare_deepspeed`` (``accelerate/accelerator.py`` l. 2355) calls
``DeepSpeedPlugin.deepspeed_config_process`` (``accelerate/utils/dataclasses.py`` l. 1392), which walks every
key of every section, and ``fill_match`` (l. 1357) stops at any ``"auto"`` it has no value for:
``ValueError: `xirang.preset` not found in kwargs``. The block's ``"auto"`` values (``preset``,
``memory_budget``, ``activations.budget``, ...) are xirang's to resolve at ``initialize``, so `protect_block`
makes that walk skip the block: it reaches ``deepspeed.initialize`` as the user wrote it.
``tests/structure/test_compat.py`` fails when these lines move.
"""
from __future__ import annotations

import functools
import importlib.util
from typing import Any, Callable, Optional

UPSTREAM_NAMES: dict[str, tuple[str, ...]] = {
    "accelerate/utils/dataclasses.py": (
        'def deepspeed_config_process(self, prefix="", mismatches=None, config=None, must_match=True, **kwargs):',
        "config = self.deepspeed_config", 'if config.get(ds_key) == "auto":'),
    "accelerate/accelerator.py": ("deepspeed_plugin.deepspeed_config_process(must_match=False, **config_kwargs)",),
}
"""File of the installed Accelerate → lines that must be in it (lines of 1.15.0 in the docstring above)."""

_ORIGINAL_PROCESS: Optional[Callable[..., Any]] = None


def protect_block(key: str) -> None:
    """Make Accelerate's ``"auto"`` filling skip the top-level section ``key`` of every ds_config; a no-op
    without Accelerate and when already done. `unprotect_block` undoes it."""
    global _ORIGINAL_PROCESS
    if importlib.util.find_spec("accelerate") is None:
        return
    from accelerate.utils import DeepSpeedPlugin

    original = DeepSpeedPlugin.deepspeed_config_process
    if getattr(original, "__xirang__", False):
        return

    @functools.wraps(original)
    def process(self: Any, prefix: str = "", mismatches: Any = None, config: Any = None, must_match: bool = True,
                **kwargs: Any) -> Any:
        if config is None and prefix == "" and key in self.deepspeed_config:
            # the walk over a shallow copy without the block; fill_match still writes into the real config
            config = {k: v for k, v in self.deepspeed_config.items() if k != key}
        return original(self, prefix, mismatches, config, must_match, **kwargs)

    process.__xirang__ = True  # type: ignore[attr-defined]
    _ORIGINAL_PROCESS = original
    DeepSpeedPlugin.deepspeed_config_process = process


def unprotect_block() -> None:
    """Give Accelerate its own ``deepspeed_config_process`` back."""
    global _ORIGINAL_PROCESS
    if _ORIGINAL_PROCESS is None:
        return
    from accelerate.utils import DeepSpeedPlugin

    DeepSpeedPlugin.deepspeed_config_process = _ORIGINAL_PROCESS
    _ORIGINAL_PROCESS = None
