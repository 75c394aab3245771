"""A bucket's optimizer states in host memory between its updates (``grad_release.states: host``).

The bucket's optimizer keeps its per-parameter state in ``optimizer.state[view]`` as torch optimizers
do (optimizer_states' quantized codes too, `formats.py`). Between updates every state tensor that has
elements (not the 0-dim ``step``) is a (pinned, on accelerators) host buffer; `fetch_states` puts a
device copy in its place just before the bucket's step and `park_states` copies the result back and
drops the device copy right after it. The optimizer steps the same values either way, so training
is bit-identical to ``states: device``.

Both copies are queued on the current stream without a host sync, as `bucket.Bucket.stash` does: the
device copy is freed once dropped, which the caching allocator orders after the copy on that stream,
and the next fetch reads the host buffer after the copy that filled it. Host code that reads the
buffers (a checkpoint) first waits for the device (`settle_states`). A host buffer is made once per
state tensor and reused every step, in the tracker's host tier (`host_scope`).
`bucket.Bucket` holds the state these methods read (``optimizer``, ``views``, ``params``, ``scope``).
"""
from __future__ import annotations

from typing import Iterator

import torch

from xirang_ds.memory.categories import OPTIMIZER_STATES
from xirang_ds.memory.host_ledger import ledger


class ParkedStates:
    """The host half of `bucket.Bucket`'s optimizer states (a mixin: the bucket holds the state)."""

    states_on = "device"
    _parked: dict  # (view index, state key) -> the host buffer, reused every step

    def _state_items(self) -> Iterator[tuple[int, dict, str, torch.Tensor]]:
        if self.optimizer is None:
            return
        for i, view in enumerate(self.views):
            state = self.optimizer.state.get(view)
            for key, value in list((state or {}).items()):
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    yield i, state, key, value

    def host_tensor(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A new host buffer in the tracker's host tier, pinned on accelerators (the states', `stash`'s), counted in
        the process's host ledger (`xirang_ds.memory.host_ledger`: what the pinned allocator really holds)."""
        return ledger().buffer(shape, dtype, self.params[0].device.type != "cpu", "grad_release", self.host_scope)

    def state_bytes(self) -> int:
        """Bytes of the optimizer's state tensors (not the 0-dim step counts), wherever they are."""
        return sum(value.numel() * value.element_size() for *_, value in self._state_items())

    def park_states(self) -> None:
        """Copy the states into their host buffers and drop the device tensors (``states: host``)."""
        if self.states_on != "host":
            return
        parked = {}
        for i, state, key, value in self._state_items():
            host = self._parked.get((i, key))
            if value is not host:
                if host is None or host.shape != value.shape or host.dtype != value.dtype:
                    host = self.host_tensor(value.shape, value.dtype)
                host.copy_(value, non_blocking=True)
                state[key] = host
            parked[(i, key)] = host
        self._parked = parked  # a state the optimizer dropped (a format change) frees its buffer

    def fetch_states(self) -> None:
        """Put a device copy of every parked state in its place, for the bucket's update (or for good,
        when grad_release is removed and hands the states back to the engine)."""
        if self.states_on != "host":
            return
        device = self.params[0].device
        for i, state, key, value in self._state_items():
            if value is self._parked.get((i, key)):
                with self.scope(OPTIMIZER_STATES):
                    on_device = torch.empty(value.shape, dtype=value.dtype, device=device)
                on_device.copy_(value, non_blocking=True)
                state[key] = on_device

    def unpark_states(self) -> None:
        """Keep the states on the device from now on (``states: auto`` settled there); the host buffers go."""
        self.fetch_states()
        self.states_on, self._parked = "device", {}

    def settle_states(self) -> None:
        """Wait for the copies into the host buffers before host code reads them (a checkpoint)."""
        if self.states_on == "host" and self._parked and self.params[0].device.type != "cpu":
            from deepspeed.accelerator import get_accelerator

            get_accelerator().synchronize()


__all__ = ["ParkedStates"]
