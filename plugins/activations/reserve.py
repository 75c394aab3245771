"""Lossy options' reserves at run time: where real data break a lossy bound, the module goes lossless.

The plan gives every module it stores lossily (``quantize``, ``sparsify``) a reserve, the cheapest lossless
option that keeps no more bytes at any point of the step (`planner.reserve_for`). A trace cannot know the
values, and a tensor with inf or NaN has no 8-bit scale or sparse cutoff: the encoder raises
`codecs.BoundExceeded` from the one host read it already makes per tensor. Then, on that rank:

* that storage, and every later one of the same module, is stored losslessly by `Reserve`: in host
  memory through the offloader (no device bytes while held; its bytes come back at its unpack, as a
  decoded payload's would), or kept where the reserve is ``keep`` (which then fits the plan's bytes);
  none stays unencoded above the plan;
* at the next forward the ranks agree (`switch_reserves`: one all-reduce of one flag per lossy module,
  on runs of several ranks and only while a lossy module runs) and every rank switches the module to its
  reserve for the rest of the run, so ranks keep one plan (a recompute re-issues its collectives), and
  the log says so once, with the module, the reason and the new option.

The plan's predicted peaks hold either way (the reserve holds no more bytes); the added time is the
reserve's from the switch on (the plan table prints the time with every reserve taken).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import torch

from xirang_ds.plugins.activations.codecs import REASONS, BoundExceeded
from xirang_ds.plugins.activations.config import LOSSY_ACTIVATION_OPTIONS
from xirang_ds.plugins.activations.planner import Choice, option_costs


class Reserve:
    """Where one lossy module's storages go on this rank once one broke its bound.

    Args:
        name: the module's full name.
        choice: its reserve (`planner.Choice`).
        offload: the runtime's `handlers.OffloadHandler` (per-storage lossless storage off the device).

    Attributes:
        taken: a storage of this module broke its bound on this rank (every later one comes here, until
            the ranks switch the module at the next forward).
        reason: the index in `codecs.REASONS` of what broke it (-1: nothing yet).
        stored_bytes: bytes stored here so far.
    """

    def __init__(self, name: str, choice: Choice, offload: Any):
        self.name, self.choice, self.offload = name, choice, offload
        self.taken = False
        self.reason = -1
        self.stored_bytes = 0
        self._call: Any = None

    def begin_call(self) -> None:
        """A new call of the module: its storages here form one offload group, made at the first."""
        self._call = None

    def store(self, flat: torch.Tensor, error: Optional[BoundExceeded]) -> tuple[Any, Any]:
        """``(holder, handler)`` for ``flat``: kept (``None``) where the reserve is ``keep``, else in host memory."""
        if error is not None and not self.taken:
            self.taken, self.reason = True, REASONS.index(error.reason)
        if self.choice.option == "keep":
            return None, self.offload
        if self._call is None:
            self._call = self.offload.begin_call()
        self.stored_bytes += flat.numel() * flat.element_size()
        return self.offload.store(flat, self._call), self.offload


def reserve_of(wrapper: Any, option: Optional[str], choice: Optional[Choice], offload: Any) -> Optional[Reserve]:
    """The wrapper's `Reserve` under ``option`` (the one it holds, while the choice is the same), or ``None``."""
    if choice is None or choice.reserve is None or option != choice.option:
        return None
    held = getattr(wrapper, "reserve", None)
    if held is not None and held.choice == choice.reserve and held.name == wrapper.name:
        return held
    return Reserve(wrapper.name, choice.reserve, offload)


def switch_reserves(plugin: Any) -> list[str]:
    """At a forward's start: switch to its reserve every lossy module whose bound broke on some rank
    (agreed over the plugin's groups), log each once and record the event; the modules switched."""
    held = [(name, w.reserve) for name, w in plugin.wrappers.items() if getattr(w, "reserve", None) is not None]
    if not held:
        return []
    reasons = [r.reason for _, r in held]
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        flags = torch.tensor(reasons, dtype=torch.float64, device=plugin.runtime.device)
        for group in plugin._groups:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        reasons = [int(x) for x in flags.tolist()]  # one read per forward, not per tensor
    switched = [(name, r, why) for (name, r), why in zip(held, reasons) if why >= 0]
    if not switched:
        return []
    plan = dict(plugin.plan)
    for name, r, why in switched:
        lossy = plugin.plan.get(name)
        plan[name] = r.choice.option
        plugin.choices[name] = r.choice
        plugin.reserves_taken[name] = REASONS[why]
        plugin.session.record_event("activations_reserve", module=name, option=r.choice.option, lossy=lossy,
                                    reason=REASONS[why])
        plugin._log(f"{name}: {lossy} cannot meet its bound on this run's data ({REASONS[why]}); it runs "
                    f"{r.choice.option}, its lossless reserve, from now on (the plan's bytes hold)")
    plugin._apply(plan)
    return [name for name, _, _ in switched]




def restore_reserves(plugin: Any) -> None:
    """Reserves for lossy choices a checkpoint from before reserves carried without them: priced again from
    the checkpoint's profiles by the same rule (`planner.option_costs`); where none fits, none."""
    streams = plugin.runtime.offloader.stream is not None
    for name, choice in list(plugin.choices.items()):
        p = plugin.profiles.get(name)
        if choice.option not in LOSSY_ACTIVATION_OPTIONS or choice.reserve is not None or p is None:
            continue
        priced = option_costs(p, (choice.option,), True, plugin._bandwidth or 1e10, streams,
                              plugin.config.offload_prefetch, name in plugin.token_wise_names, plugin.options)
        if priced and priced[0].reserve is not None:
            plugin.choices[name] = replace(choice, reserve=priced[0].reserve)


__all__ = ["Reserve", "reserve_of", "restore_reserves", "switch_reserves"]
