"""The private PyTorch APIs this plugin touches, in one version-guarded place.

* ``torch._C._autograd._top_saved_tensors_default_hooks``: the saved-tensor hooks active right
  now, so ours can compose with an outer pair instead of silently shadowing it (PyTorch applies
  only the innermost pair; ``torch/autograd/graph.py`` ``saved_tensors_hooks``).
* The pack hooks of non-reentrant checkpointing are closures defined in
  ``torch/utils/checkpoint.py`` ``_checkpoint_hook`` and ``_recomputation_hook`` (torch 2.13.0,
  lines 1088 and 1153): inside them our hooks must stay out of the way.
* ``torch.utils.checkpoint.SAC_IGNORED_OPS`` (line 1328): ops selective checkpointing does not
  count; our op profile skips the same ones so its per-op indices match SAC's.

``tests/test_activations_units.py::test_private_torch_apis_still_behave`` fails when upstream
moves any of them.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

HookPair = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]

_CHECKPOINT_PACK_OWNERS = ("_checkpoint_hook.", "_recomputation_hook.")


def current_saved_tensors_hooks() -> Optional[HookPair]:
    """The innermost active (pack, unpack) pair, or ``None``."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:  # pragma: no cover - torch < 2.1
        return None
    return top(False)


def is_checkpoint_hook(hooks: Optional[HookPair]) -> bool:
    """True when ``hooks`` belong to ``torch.utils.checkpoint`` (a recompute region is running)."""
    if hooks is None:
        return False
    qualname = getattr(hooks[0], "__qualname__", "")
    return qualname.startswith(_CHECKPOINT_PACK_OWNERS)


def sac_ignored_ops() -> frozenset:
    """Ops that selective activation checkpointing neither caches nor counts."""
    from torch.utils import checkpoint

    return frozenset(getattr(checkpoint, "SAC_IGNORED_OPS", {torch.ops.aten.detach.default}))
