"""An LR scheduler's per-group lists fitted to this run's param groups after a resume.

A ``torch.optim.lr_scheduler`` scheduler keeps one entry per param group (``base_lrs``, ``_last_lr``,
``min_lrs``, ...) and restores them from the checkpoint as saved. optimizer_states splits each of the
user's groups in two (states kept fp32 or not), so a checkpoint written without it has half the
entries a run with it needs, and one written with it twice those a run without it needs: the next
``scheduler.step()`` would fail inside torch (``zip() argument 2 is shorter than argument 1``).

Schedulers are restored in more than one place (DeepSpeed's ``load_checkpoint`` restores the engine's,
HF Trainer loads its own ``scheduler.pt`` afterwards, and ``LambdaLR`` has its own
``load_state_dict``), so the fit happens where every torch scheduler passes: `install` wraps
``LRScheduler.step`` while a session lives. The wrapper compares list lengths and changes nothing
when they fit; a scheduler whose lists do not fit its optimizer could not step anyway.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from xirang_ds.compat.torch import SCHEDULER_PER_GROUP_LISTS


def fit_scheduler_groups(scheduler: Any, groups: int) -> list[str]:
    """Make each per-group list of ``scheduler`` as long as ``groups``: a list of one value, or of equal
    values (the halves of split groups share their settings), is repeated; the names of the lists
    fitted are returned.

    Raises:
        ValueError: a list of other lengths and differing values (no rule says which entry is which
            group), naming it and the fix.
    """
    fitted = []
    for name in SCHEDULER_PER_GROUP_LISTS:  # the per-group lists torch's schedulers keep in their state
        values = getattr(scheduler, name, None)
        if not isinstance(values, list) or len(values) in (0, groups):
            continue
        if len(values) == 1 or all(v == values[0] for v in values):
            setattr(scheduler, name, [values[0]] * groups)
            fitted.append(name)
            continue
        raise ValueError(f"the LR scheduler's {name} has {len(values)} entries with different values ({values}) "
                         f"and this run's optimizer has {groups} param groups. Fix: resume with the param groups "
                         "the checkpoint was written with, or load with load_lr_scheduler_states=False")
    return fitted


_INSTALLED: list[Callable] = []  # the original LRScheduler.step, once per live session that installed it


def install() -> Callable[[], None]:
    """Wrap ``torch.optim.lr_scheduler.LRScheduler.step`` so a scheduler is fitted to its optimizer's
    groups before it steps; returns the function that undoes this session's share (the class is
    restored when the last live session undoes its share)."""
    from torch.optim.lr_scheduler import LRScheduler

    if not _INSTALLED:
        original = LRScheduler.step

        @functools.wraps(original)
        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            optimizer = getattr(self, "optimizer", None)
            if optimizer is not None and hasattr(optimizer, "param_groups"):
                fit_scheduler_groups(self, len(optimizer.param_groups))
            return original(self, *args, **kwargs)

        LRScheduler.step = step
        _INSTALLED.append(original)
    else:
        _INSTALLED.append(_INSTALLED[0])
    first = _INSTALLED[0]
    done: list[bool] = []

    def uninstall() -> None:
        if done:
            return
        done.append(True)
        _INSTALLED.pop()
        if not _INSTALLED:
            LRScheduler.step = first

    return uninstall


__all__ = ["fit_scheduler_groups", "install"]
