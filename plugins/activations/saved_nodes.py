"""Which autograd node saved each storage, for what an on-demand restore holds at once in backward.

A profiling pass sees every op below autograd (its dispatch mode) and every saved tensor (its pack hook),
but not the node a saved tensor belongs to. Autograd saves an op's inputs before running it and its outputs
after, so a saved storage is the output of the op just run, else an input of the next op that takes it;
an op that makes no tensor (a fake tensor's ``prim.device``) is no node. Backward runs the nodes in reverse,
and a storage restored on demand (`saved.PackedStorage`) comes back at the last node that saved it and stays
until the first has run: `restore_peak` sweeps those spans.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from xirang_ds.compat.torch import is_traceable_wrapper_subclass, pytree, storage_key
from xirang_ds.memory.dispatch import returns_alias
from xirang_ds.plugins.activations.saved import storage_flat
from xirang_ds.plugins.activations.storage import pool_buffer_bytes


def restore_peak(spans: Iterable) -> int:
    """The most bytes restored at once in backward over ``[first, last, bytes]`` spans of node positions."""
    events = sorted(e for first, last, nbytes in spans for e in ((first, nbytes), (last + 1, -nbytes)))
    live = peak = 0
    for _, delta in events:  # at one position, frees (negative) sort before arrivals
        live += delta
        peak = max(peak, live)
    return peak


def host_buffers(t: torch.Tensor) -> tuple[int, int]:
    """The host buffer offloading ``t``'s storage takes (its packed part), plain and pinned (`storage.HostPool`)."""
    flat, _ = storage_flat(t)
    nbytes = flat.numel() * flat.element_size()
    return pool_buffer_bytes(nbytes, False), pool_buffer_bytes(nbytes, True)


def storage_keys(tree: Any) -> set:
    """Storage keys of the strided tensors in ``tree`` (a wrapper subclass without storage is left out)."""
    return {storage_key(t.untyped_storage()) for t in pytree.tree_leaves(tree)
            if isinstance(t, torch.Tensor) and t.layout == torch.strided and not is_traceable_wrapper_subclass(t)}


class NodeSpans:
    """The node positions of a pass: each frame's ``spans`` (``{storage id: [first, last, bytes]}``) filled as
    ops run (`op_ran`) and storages are saved (`saved`)."""

    def __init__(self) -> None:
        self.position = 0
        """Ops that made a tensor so far in the pass."""
        self.last_outputs: Any = ()
        """Storage keys of the last such op's outputs."""
        self.pending: list = []
        """Saved inputs whose op has not run yet: ``(storage key, id, bytes, frames)``."""

    def op_ran(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        made = storage_keys(out)
        if made:
            self.position += 1
            self.last_outputs = () if returns_alias(func) else made
            if self.pending:
                self.flush(storage_keys((args, kwargs)))

    def saved(self, st: torch.UntypedStorage, ident: int, nbytes: int, frames: list) -> None:
        """Storage ``st`` (``ident``, ``nbytes``) saved for backward while ``frames`` run."""
        if storage_key(st) in self.last_outputs:
            self._place(ident, nbytes, frames, self.position)
        else:
            self.pending.append((storage_key(st), ident, nbytes, list(frames)))

    def flush(self, arguments: set = frozenset()) -> None:
        """The saved inputs waiting for their op that are among ``arguments``, at this op's position; with no
        ``arguments``, all of them at the next (a frame ends, or the pass)."""
        waiting = []
        for entry in self.pending:
            if not arguments or entry[0] in arguments:
                self._place(*entry[1:], self.position + (not arguments))
            else:
                waiting.append(entry)
        self.pending = waiting

    @staticmethod
    def _place(ident: int, nbytes: int, frames: list, node: int) -> None:
        for frame in frames:
            span = frame.spans.setdefault(ident, [node, node, nbytes])
            span[0], span[1] = min(span[0], node), max(span[1], node)
