"""Optimizer state that moves between owners at resume: plain DeepSpeed's ZeRO files, grad_release's
shards and DynamicAdamW's codes are each read into one neutral form, per parameter and whole
(`param_states.ParamStates`), and written from it into whatever optimizer this run steps
(docs/checkpoints.md)."""
from __future__ import annotations

import os

BASIC_GROUPS = "xirang_basic_optimizer_groups"
"""The model-states key that keeps the basic optimizer's own param groups when a stage-0 save puts
plain DeepSpeed's optimizer entry (another layout, the user's groups) where DeepSpeed keeps them."""


def save_atomically(obj: object, path: str) -> None:
    """``torch.save`` to a temporary name, then rename: a file with the final name is always whole."""
    import torch

    temporary = f"{path}.xirang-tmp"
    torch.save(obj, temporary)
    os.replace(temporary, path)


def update_saved(path: str, **entries: object) -> dict:
    """Set ``entries`` in the saved dict at ``path`` (a model-states file), keeping its other keys;
    written atomically. Returns the dict as written."""
    import torch

    checkpoint = dict(torch.load(path, map_location="cpu", weights_only=False))
    checkpoint.update(entries)
    save_atomically(checkpoint, path)
    return checkpoint


__all__ = ["BASIC_GROUPS", "save_atomically", "update_saved"]
