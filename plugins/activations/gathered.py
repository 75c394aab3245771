"""ZeRO-3's gathered weights saved by reference to their parameter, not by their gathered storage.

At ZeRO-3 DeepSpeed gathers a module's parameters before its forward (its all-gather's ``torch.cat``
output becomes each parameter's data) and, on models larger than its prefetch and reuse windows,
releases them when the forward returns by swapping that data for an empty tensor. A saved tensor
that still refers to the gathered storage keeps it alive until backward: a view of a weight an op
saved (``weight.t()`` outside DeepSpeed's patched ``F.linear``, a slice of a fused projection), and
a detached Parameter, which is what a plan's pack hooks (`saved.PackContext`) returned for every
Parameter an op saved. A plan that offloaded or compressed activations thereby held every gathered
weight of its modules from forward to backward (docs/activations.md "ZeRO-3's gathered weights").

`GatheredRefs` is a saved-tensor hook pair entered around the model's forward (the plan's own
hooks inside it compose with it, `saved.PackContext`). A saved tensor whose storage is the one a
gathered parameter holds at that moment becomes a `ParamRef`: the parameter and the view's size,
stride and offset within the parameter's data. DeepSpeed gathers a module's parameters again before
the module's backward (its pre-backward hook), and unpack rebuilds the view over that data, as
DeepSpeed's own ``LinearFunctionForZeroStage3`` does: the same values (parameters change only at the
step), so the gradients are bit-identical. A parameter that is not gathered when its view is
unpacked is gathered, copied and released there (DeepSpeed's ``all_gather`` / ``partition``,
collective, so every rank does it at the same point): still exact, counted in ``regathered``.

A Parameter saved itself (a norm's weight, the weight DeepSpeed's linear function saves) becomes a
reference too, so the plan's hooks inside never see it. Anything else goes on as it came (detached,
as a pack hook must return it).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from xirang_ds.compat.deepspeed import pass_pre_backward
from xirang_ds.compat.torch import pop_saved_tensors_hooks, push_saved_tensors_hooks
from xirang_ds.plugins.activations.head_loss import DeferredLogits
from xirang_ds.plugins.activations.head_zero3 import gathered
from xirang_ds.plugins.activations.saved import span_elements


class ParamRef:
    """What autograd holds instead of a view of a gathered parameter."""

    __slots__ = ("param", "size", "stride", "offset")

    def __init__(self, param: torch.nn.Parameter, size: torch.Size, stride: tuple, offset: int):
        self.param, self.size, self.stride, self.offset = param, size, stride, offset


class GatheredRefs:
    """Saved views of gathered ZeRO-3 parameters kept as `ParamRef`s during one forward.

    Each module that owns parameters gets a forward pre-hook, registered after DeepSpeed's (so its
    parameters are gathered when it runs), that records which storage each one holds; a saved tensor
    is matched against those records and checked against the parameter's data at that moment.

    Args:
        model: the module whose forward is wrapped (DeepSpeed's hooks already registered on it).

    Attributes:
        saved: views packed as references in the last forward.
        regathered: references unpacked with their parameter released (gathered again for them).
    """

    def __init__(self, model: torch.nn.Module):
        self._by_storage: dict[int, list[torch.nn.Parameter]] = {}
        self._handles = [m.register_forward_pre_hook(self._record) for m in model.modules()
                         if any(True for _ in m.parameters(recurse=False))]
        # a chunked head's deferred logits have no graph of their own to mark, and DeepSpeed's marker
        # (``outputs.detach()``) would compute them whole; the chunked loss gathers the head's weight
        # itself (head_zero3.gathered)
        self._undo_marker = pass_pre_backward(model, lambda t: isinstance(t, DeferredLogits))
        self.saved = 0
        self.regathered = 0
        self._pushed = False

    def _record(self, module: torch.nn.Module, args: Any) -> None:
        external = getattr(module, "ds_external_parameters", None)  # DeepSpeed's register_external_parameter
        params = list(module.parameters(recurse=False)) + ([p for _, p in external()] if external else [])
        for p in params:
            if p.data.numel():
                ptr = p.data.untyped_storage().data_ptr()
                known = self._by_storage.setdefault(ptr, [])
                if all(q is not p for q in known):  # identity: `in` would compare elementwise
                    known.append(p)

    def __enter__(self) -> "GatheredRefs":
        self._by_storage.clear()
        self.saved = 0
        push_saved_tensors_hooks(self._pack, self._unpack)
        self._pushed = True
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._pushed:
            pop_saved_tensors_hooks()
            self._pushed = False
        self._by_storage.clear()  # the references hold their parameters, not these records

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._undo_marker()

    def _owner(self, t: torch.Tensor) -> Optional[torch.nn.Parameter]:
        """The gathered parameter whose data ``t`` is a view of, or ``None``."""
        if not t.numel():
            return None
        ptr = t.untyped_storage().data_ptr()
        for p in self._by_storage.get(ptr, ()):
            data = p.data
            if (data.numel() and data.dtype == t.dtype and data.untyped_storage().data_ptr() == ptr
                    and data.storage_offset() <= t.storage_offset()
                    and t.storage_offset() + span_elements(t) <= data.storage_offset() + span_elements(data)):
                return p
        return None

    def _pack(self, t: torch.Tensor) -> Any:
        p = self._owner(t) if self._by_storage else None
        if p is None:
            return t.detach()  # returning an output itself would make a reference cycle
        self.saved += 1
        return ParamRef(p, t.shape, t.stride(), t.storage_offset() - p.data.storage_offset())

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, ParamRef):
            return packed
        p = packed.param
        data = p.data
        if not data.numel():
            self.regathered += 1
            with gathered(p):
                data = p.data.clone()
        return data.as_strided(packed.size, packed.stride, data.storage_offset() + packed.offset)


__all__ = ["GatheredRefs", "ParamRef"]
