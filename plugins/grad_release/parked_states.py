"""A bucket's host tier: its optimizer states between its updates (``grad_release.states: host``), and exact
clipping's stashed gradient shard (``exact_method: host``) from its reduction to its update.

The bucket's optimizer keeps its per-parameter state in ``optimizer.state[view]`` as torch optimizers
do (optimizer_states' quantized codes too, `formats.py`). Between updates every state tensor that has
elements (not the 0-dim ``step``) is a (pinned, on accelerators) host buffer; `fetch_states` puts a
device copy in its place just before the bucket's step and `park_states` copies the result back and
drops the device copy right after it. The optimizer steps the same values either way, so training
is bit-identical to ``states: device``.

Just in time, both copies are queued on the current stream without a host sync, as the stash's are then: the
device copy is freed once dropped, which the caching allocator orders after the copy on that stream,
and the next fetch reads the host buffer after the copy that filled it. Host code that reads the
buffers (a checkpoint) first waits for the device (`settle_states`). A host buffer is made once per
state tensor and reused every step, in the tracker's host tier (`host_scope`).
`bucket.Bucket` holds the state these methods read (``optimizer``, ``views``, ``params``, ``scope``).

Ahead of the update (``prefetch_states``, `CopyStream`): where the device has streams, both copies go on
a side stream instead, so they run on the copy engine beside the compute stream's work. The pipeline starts
the next bucket's fetch (`prefetch_states`) once a bucket has updated, behind that bucket's park on the side
stream; the next update waits only for its own states' copy (an event), so by then the park before it is done,
and each park waits for the update that wrote them. A pass's first bucket is fetched just in time, after the
side stream's parks into its host buffers. The allocator is told which stream uses each device copy
(``record_stream``), so its memory is not handed out again before the copies and the update that read it have
run. The device so holds at most two buckets' states at once (one parking, the next arriving), and between two
updates in backward the next bucket's (the estimate counts both). On the CPU a side stream does not exist:
``prefetch_states: true`` makes the fetch early and synchronous there (one bucket's states at a time, the next
one's from the update before it), which tests the order, not the overlap.

The stash (`stash`, `unstash`) follows the same rule (`stash_copies`, made where ``prefetch_states`` makes the
states' copies run ahead, with the states on the device too): each reduced shard goes to its host buffer on the
side stream as its norm is taken, and comes back on it while the bucket before it updates (`prefetch_grad`, from
`pipeline.ReleasePipeline.apply_all`), the update waiting only for that copy's event; an op on the compute stream
that reads the host buffer waits for the side stream first (`host_shard_ready`). Else both copies are queued on
the current stream, just in time.
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterator, Optional

import torch

from xirang_ds.memory.categories import GRADIENTS, OPTIMIZER_STATES
from xirang_ds.memory.host_ledger import ledger


class CopyStream:
    """Where grad_release's host copies of the states run ahead of the updates (module docstring): a side stream
    of the accelerator, or none (``stream`` None: the CPU, where they are made early and synchronously).

    Args:
        device: the buckets' device.
    """

    def __init__(self, device: torch.device) -> None:
        from deepspeed.accelerator import get_accelerator

        self.accelerator = get_accelerator()
        self.stream: Any = (self.accelerator.Stream(device=device) if device.type != "cpu"
                            and not self.accelerator.is_synchronized_device() else None)

    def side(self) -> ContextManager:
        """Ops queued inside go on the side stream, after what the current stream has queued so far."""
        if self.stream is None:
            return contextlib.nullcontext()
        self.stream.wait_stream(self.accelerator.current_stream())
        return self.accelerator.stream(self.stream)

    def mark(self) -> Any:
        """An event after the side stream's work so far (None without a side stream)."""
        return None if self.stream is None else self.stream.record_event()

    def wait(self, event: Any) -> None:
        """The current stream waits for ``event`` (`mark`) before its next op."""
        if event is not None:
            self.accelerator.current_stream().wait_event(event)

    def used_here(self, tensor: torch.Tensor) -> None:
        """``tensor`` (made on the side stream) is used on the current stream too: its memory waits for both."""
        if self.stream is not None:
            tensor.record_stream(self.accelerator.current_stream())

    def used_aside(self, tensor: torch.Tensor) -> None:
        """``tensor`` (made on the current stream) is read on the side stream too: its memory waits for both."""
        if self.stream is not None:
            tensor.record_stream(self.stream)


class ParkedStates:
    """The host half of `bucket.Bucket`: its optimizer states, and exact clipping's stashed gradient shard (a mixin:
    the bucket holds the state)."""

    states_on = "device"
    copies: Optional[CopyStream] = None
    """Where the copies run ahead of the updates (``prefetch_states``); None: on the current stream, just in time."""
    _parked: dict  # (view index, state key) -> the host buffer, reused every step
    _ahead: Optional[tuple[dict, Any]] = None  # states fetched ahead: (view index, state key) -> device copy; event
    fetched_ahead = 0
    """Updates whose states were fetched ahead (`prefetch_states`), so far."""
    stash_copies: Optional[CopyStream] = None
    """Where the stash's copies run (`stash`, `prefetch_grad`): a side stream; None: the current stream, just in
    time."""
    _grad_ahead: Optional[tuple[torch.Tensor, Any]] = None  # the stashed shard fetched ahead: device copy; event
    grad_fetched_ahead = 0
    """Updates whose stashed gradient shard was fetched ahead (`prefetch_grad`), so far."""

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
        """Copy the states into their host buffers and drop the device tensors (``states: host``); on the side
        stream after the update where the copies run ahead (`copies`)."""
        if self.states_on != "host":
            return
        copies, self._ahead = self.copies, None
        parked = {}
        with copies.side() if copies is not None else contextlib.nullcontext():
            for i, state, key, value in self._state_items():
                host = self._parked.get((i, key))
                if value is not host:
                    if host is None or host.shape != value.shape or host.dtype != value.dtype:
                        host = self.host_tensor(value.shape, value.dtype)
                    host.copy_(value, non_blocking=True)
                    if copies is not None:
                        copies.used_aside(value)
                    state[key] = host
                parked[(i, key)] = host
        self._parked = parked  # a state the optimizer dropped (a format change) frees its buffer

    def prefetch_states(self) -> None:
        """Start the device copies of the parked states on the side stream, for the update to come
        (`fetch_states` takes them); nothing where the copies do not run ahead or are under way."""
        copies = self.copies
        if self.states_on != "host" or copies is None or self._ahead is not None:
            return
        with copies.side():
            ahead = {(i, key): self._device_copy(value) for i, state, key, value in self._state_items()
                     if value is self._parked.get((i, key))}
        self._ahead = (ahead, copies.mark())

    def drop_prefetch(self) -> None:
        """Forget states and a gradient shard fetched ahead for an update that will not come (a skipped step, a
        failed backward)."""
        self._ahead = self._grad_ahead = None

    def fetch_states(self) -> None:
        """Put a device copy of every parked state in its place, for the bucket's update (or for good,
        when grad_release is removed and hands the states back to the engine): the one fetched ahead
        (`prefetch_states`) once its copy is done, else one copied now."""
        if self.states_on != "host":
            return
        ahead, done = self._ahead or ({}, None)
        self._ahead = None
        self.fetched_ahead += bool(ahead)
        if self.copies is not None:  # its copies, or (none ahead) the side stream's park into the host buffers
            self.copies.wait(done if ahead else self.copies.mark())
        for i, state, key, value in self._state_items():
            if value is self._parked.get((i, key)):
                on_device = ahead.get((i, key))
                if on_device is None:
                    on_device = self._device_copy(value)
                elif self.copies is not None:
                    self.copies.used_here(on_device)
                state[key] = on_device

    def _device_copy(self, host: torch.Tensor) -> torch.Tensor:
        with self.scope(OPTIMIZER_STATES):
            on_device = torch.empty(host.shape, dtype=host.dtype, device=self.params[0].device)
        on_device.copy_(host, non_blocking=True)
        return on_device

    # the stashed gradient shard (exact clipping's ``host`` method) ------------------------------------
    def stash(self) -> None:
        """Hold the step's gradient shard in (pinned) host memory until the update needs it: the device keeps only
        the buckets in flight while backward goes on. The copy is queued without a host sync (`to_host`); the
        device shard is freed once the tensor is dropped, which the caching allocator orders after the copy."""
        grad = self.grad
        if grad is self._host:  # its rounds went there as they were reduced (`rows.RowSink`)
            return
        host = self.host_shard(grad.shape, grad.dtype)
        self.to_host(host, grad)
        self.grad = host

    def to_host(self, host: torch.Tensor, value: torch.Tensor) -> None:
        """Copy ``value`` (on the device) into ``host`` (part of the stash's buffer): on the side stream where the
        stash's copies run there (`stash_copies`: the compute stream goes on meanwhile), else on the current one."""
        copies = self.stash_copies
        with copies.side() if copies is not None else contextlib.nullcontext():
            host.copy_(value, non_blocking=True)
        if copies is not None:
            copies.used_aside(value)

    def host_shard(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The host buffer `stash` keeps the gradient shard in (pinned on accelerators), reused every step."""
        host = self._host
        if host is None or host.shape != shape or host.dtype != dtype:
            self._host = host = self.host_tensor(shape, dtype)
        return host

    def host_shard_ready(self) -> torch.Tensor:
        """The stash's host buffer, for an op on the current stream to read: after the side stream's copies into
        it."""
        if self.stash_copies is not None:
            self.stash_copies.wait(self.stash_copies.mark())
        return self._host

    def prefetch_grad(self) -> None:
        """Start the stashed shard's copy back to the device on the side stream, for the update to come
        (`unstash` takes it); nothing where the stash's copies do not run ahead, or nothing is stashed."""
        copies = self.stash_copies
        if copies is None or self.grad is None or self.grad is not self._host or self._grad_ahead is not None:
            return
        with copies.side():  # after the copy that filled the host buffer, on this stream too
            grad = self._device_grad(self._host)
        self._grad_ahead = (grad, copies.mark())

    def unstash(self) -> None:
        """Bring a stashed gradient shard back to the device, just before its update: the copy started ahead
        (`prefetch_grad`) once it is done, else one made now."""
        if self.grad is None or self.grad is not self._host:
            return
        ahead, self._grad_ahead = self._grad_ahead, None
        if ahead is None:
            self.grad = self._device_grad(self.host_shard_ready())
            return
        grad, done = ahead
        self.stash_copies.wait(done)
        self.stash_copies.used_here(grad)
        self.grad_fetched_ahead += 1
        self.grad = grad

    def _device_grad(self, host: torch.Tensor) -> torch.Tensor:
        with self.scope(GRADIENTS):
            grad = torch.empty(host.shape, dtype=host.dtype, device=self.params[0].device)
        grad.copy_(host, non_blocking=True)
        return grad

    def unpark_states(self) -> None:
        """Keep the states on the device from now on (``states: auto`` settled there); the host buffers go."""
        self.fetch_states()
        self.states_on, self._parked = "device", {}

    def settle_states(self) -> None:
        """Wait for the copies into the host buffers before host code reads them (a checkpoint)."""
        if self.states_on == "host" and self._parked and self.params[0].device.type != "cpu":
            from deepspeed.accelerator import get_accelerator

            get_accelerator().synchronize()


__all__ = ["CopyStream", "ParkedStates"]
