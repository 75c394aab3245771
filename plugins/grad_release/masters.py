"""A bucket's fp32 master slices of its 16-bit parameters and the optimizer that steps them.

Parameters in fp32 are their own masters (the optimizer steps views of them); 16-bit parameters get
an fp32 master copy of this rank's slices, except under ``none`` with an optimizer that writes back
through ``xirang_write_back`` (``in_place``): it steps the bf16 slices themselves, each updated chunk
rounded stochastically into the weight. With ``remainders`` (bf16 only) the master exists only
during the bucket's update: between updates it is the bf16 weight plus ``remainders.py``'s 16-bit
remainder and tie bit, and the views the optimizer steps (its states are keyed by them) point at an
empty tensor until the next update rebuilds it. With ``remainders_8bit`` (bf16 only, not exact) the
remainder is one byte and each update rounds the master to 16 significant bits first (`remainders.round8_`).
With ``none`` (bf16 only) there is no master at all.
`bucket.Bucket` holds the state these methods read (``params``, ``pieces``, ``master``, ``views``, ...).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from xirang_ds.compat.torch import allow_any_grad_dtype, foreach
from xirang_ds.memory.categories import PARAMETERS
from xirang_ds.plugins.grad_release.layout import Piece
from xirang_ds.plugins.grad_release.optimizers import clone_optimizer, hyperparameters
from xirang_ds.plugins.grad_release.remainders import join, join8, round_into, split, split8, tie_bytes
from xirang_ds.plugins.grad_release.stochastic import noise_seed


@dataclass(frozen=True)
class SliceOf:
    """Which parameter a tensor stepped by a bucket's optimizer is a slice of.

    Attributes:
        name: the parameter's name in the model.
        shape: the parameter's shape.
        start: first element of the slice in the flattened parameter.
        numel: elements in the slice (the whole parameter when not sharded).
    """

    name: str
    shape: tuple
    start: int
    numel: int


class MasterSlices:
    """The master and optimizer half of `bucket.Bucket` (a mixin: the bucket holds the state)."""

    def build_masters(self) -> None:
        """(Re)build the fp32 master slices from the parameters and a fresh optimizer over them.

        Each tensor the optimizer steps carries ``xirang_slice_of``: the `SliceOf` saying which
        parameter it is a slice of (optimizers that decide per parameter, by name or size, read it).
        """
        with torch.no_grad():
            if self.dtype == torch.float32 or self.in_place:
                self.master = None
                self.views = [self._param_slice(piece) for piece in self.pieces]
                if self.in_place:
                    for piece, view in zip(self.pieces, self.views):
                        allow_any_grad_dtype(view)  # the bucket's fp32 gradient on the bf16 weight
                        view.xirang_weight_noise = self._weight_noise(piece)  # what the fused update rounds with
                        view.xirang_write_back = self._stochastic_write_back(view, lambda: self.optimizer)
            else:
                self.master = torch.zeros(self.layout.shard_numel, dtype=torch.float32,
                                          device=self.params[0].device)
                self.views = []
                for piece in self.pieces:
                    view = self.master[piece.offset:piece.offset + piece.numel]
                    view.copy_(self._param_slice(piece).reshape(-1))
                    self.views.append(view if self.sharded else view.view(self.params[piece.index].shape))
                if self.remainders:  # a master equal to its bf16 weight has no remainder and no tie

                    device, eight = self.master.device, self.masters == "remainders_8bit"
                    self.remainder = torch.zeros(self.master.numel(), dtype=torch.int8 if eight else torch.int16,
                                                 device=device)
                    self.ties = None if eight else torch.zeros(tie_bytes(self.master.numel()), dtype=torch.uint8,
                                                               device=device)
        for piece, view in zip(self.pieces, self.views):
            param = self.params[piece.index]
            view.xirang_slice_of = SliceOf(self.names[piece.index], tuple(param.shape), piece.start, piece.numel)
        self.optimizer = self._make_optimizer()  # it may look at the views' shapes
        self.steps_applied = 0
        if self.transient:
            self._point_views(None)

    def materialize(self) -> None:
        """Rebuild the fp32 master between updates: remainders join the bf16 weights, ``none``
        widens them (no-op with fp32 masters)."""
        if not self.transient or self.master is not None:
            return
        with torch.no_grad(), self.scope(PARAMETERS):
            if self.remainders:
                master = torch.empty(self.remainder.numel(), dtype=torch.float32, device=self.remainder.device)
                self._join(master)
            else:
                master = self._weight_shard(torch.float32)
        self._point_views(master)

    def _point_views(self, master: Optional[torch.Tensor]) -> None:
        """The optimizer's views onto ``master``'s slices, or (None) onto nothing; ``self.master`` too."""
        empty = torch.empty(0, dtype=torch.float32, device=self.params[0].device)
        for piece, view in zip(self.pieces, self.views):
            if master is None:
                view.data = empty
            else:
                part = master[piece.offset:piece.offset + piece.numel]
                view.data = part if self.sharded else part.view(self.params[piece.index].shape)
        self.master = master

    def _weight_shard(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """This rank's slices of the bf16 parameters, laid out as the master (padding zero)."""
        weight = torch.zeros(self.layout.shard_numel, dtype=dtype or self.dtype, device=self.params[0].device)
        if self.pieces:  # one multi-tensor copy, not one a piece
            foreach.copy_([weight[p.offset:p.offset + p.numel] for p in self.pieces],
                          [self._param_slice(p).reshape(-1) for p in self.pieces])
        return weight

    def _release(self, weight: torch.Tensor) -> None:
        """Free a transient master; remainders keep it as ``weight`` (its bf16 rounding) plus remainder."""
        if not self.transient:
            return
        if self.remainders:
            if self.ties is None:
                split8(self.master, self.remainder)
            else:
                split(self.master, weight, self.remainder, self.ties)
        self._point_views(None)

    def _join(self, master: torch.Tensor) -> None:
        """The master (out, laid out as the shard) from the bf16 weights and the remainders."""
        if self.ties is None:
            join8(self._weight_shard(), self.remainder, master)
        else:
            join(self._weight_shard(), self.remainder, self.ties, master)

    def _round(self, out: torch.Tensor) -> None:
        """The updated master into ``out`` (the parameter dtype, laid out as the master): to nearest,
        with ``none`` stochastically (the master is consumed), with ``remainders_8bit`` to nearest after
        the master is rounded stochastically to 16 significant bits (`remainders.round8_`). Where the
        bucket's optimizer is optimizer_states' with its compiled kernels on, the rounding is one compiled
        call of the bucket's shard, bit for bit the eager pass (`FusedStep.round_`), not a few dozen ops
        per chunk of `stochastic.CHUNK_NUMEL`."""
        if self.masters not in ("none", "remainders_8bit"):
            out.copy_(self.master)
            return

        seed = noise_seed(self.index, self.steps_applied, self.comm.rank if self.sharded else 0)
        round_into(self.master, out, seed, low_bits=8 if self.masters == "remainders_8bit" else 16,
                   compiled=compiled_rounding(self.optimizer))

    @contextlib.contextmanager
    def fp32_masters(self, write_params: bool = False):
        """The masters as fp32 tensors while the block runs (transient ones: rebuilt first, freed after).

        Args:
            write_params: the block changes the masters (a load): the parameters' slices this rank
                holds get their bf16 rounding, which the remainders stand beside.
        """
        self.materialize()
        try:
            yield self.master
        finally:
            if self.has_master and (write_params or self.transient):
                with torch.no_grad():
                    if self.masters == "remainders_8bit":  # a master rebuilt by the remainders rounds to itself
                        weight = torch.empty(self.master.numel(), dtype=self.dtype, device=self.master.device)
                        self._round(weight)
                    else:
                        weight = self.master.to(self.dtype)
                    if write_params:
                        self._write_params(weight)
                self._release(weight)

    def _write_params(self, weight: torch.Tensor) -> None:
        """This rank's slices of the parameters from ``weight`` (laid out as the master)."""
        if self.pieces:  # one multi-tensor copy, not one a piece
            foreach.copy_([self._param_slice(p).reshape(-1) for p in self.pieces],
                          [weight[p.offset:p.offset + p.numel] for p in self.pieces])

    def _weight_noise(self, piece: Piece):
        """``xirang_weight_noise`` of ``piece``'s view (in-place ``none``): ``() -> (seed, offset)``, the
        noise of its stochastic rounding now, a function of the bucket, the step and the rank
        (`stochastic.noise_seed`: stage 0's ranks draw alike; a resumed run draws the same), and the
        piece's place in the shard, the index of its element 0 (`stochastic.random_bits`)."""
        rank = self.comm.rank if self.sharded else 0
        return lambda: (noise_seed(self.index, self.steps_applied, rank), piece.offset)

    @staticmethod
    def _stochastic_write_back(view: torch.Tensor, optimizer: Callable[[], Any] = lambda: None):
        """``view``'s ``xirang_write_back`` (in-place ``none``, eager update): an updated fp32 chunk at
        ``start`` rounded stochastically into the weight with the noise of its ``xirang_weight_noise``, in
        one compiled call where ``optimizer()``'s kernels are on (`FusedStep.round_`, the same bits)."""
        flat = view.view(-1)

        def write_back(values: torch.Tensor, start: int) -> None:
            seed, offset = view.xirang_weight_noise()
            round_into(values, flat[start:start + values.numel()], seed, offset + start,
                       compiled=compiled_rounding(optimizer()))

        return write_back

    def _param_slice(self, piece: Piece) -> torch.Tensor:
        param = self.params[piece.index].detach()
        if not self.sharded:
            return param
        return param.view(-1)[piece.start:piece.start + piece.numel]

    def _make_optimizer(self) -> Optional[torch.optim.Optimizer]:
        by_group: dict[int, list[torch.Tensor]] = {}
        for piece, view in zip(self.pieces, self.views):
            by_group.setdefault(self.sources[piece.index], []).append(view)
        self.group_sources = sorted(by_group)
        if not by_group:
            return None  # this rank holds no element of this bucket (tiny parameters, many ranks)
        groups = [{"params": by_group[i], **hyperparameters(self.basic.param_groups[i])} for i in self.group_sources]
        overrides = {}
        keeps = getattr(self.basic, "keeps_fp32", None)  # optimizer_states' DynamicAdamW under Megatron
        if keeps is not None:
            overrides["keep_fp32_params"] = [view for piece, view in zip(self.pieces, self.views)
                                             if keeps(self.params[piece.index])]
            measures = self.basic.measures_fp32
            overrides["measured_params"] = [view for piece, view in zip(self.pieces, self.views)
                                            if measures(self.params[piece.index])]
        return clone_optimizer(self.basic, groups, **overrides)

    # gradients in ----------------------------------------------------------------------------


def compiled_rounding(optimizer: Any) -> Optional[Callable[..., bool]]:
    """``optimizer``'s one-call stochastic rounding, where it has one (optimizer_states' `FusedStep.round_`)."""
    return getattr(getattr(optimizer, "fused", None), "round_", None)


__all__ = ["MasterSlices", "SliceOf", "compiled_rounding"]
