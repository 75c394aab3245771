"""The neutral form of an Adam-family optimizer state: per parameter name, the whole fp32 master,
both moments and the step count; and the slots an optimizer of this run steps, each made of
fragments of named parameters.

Reading a checkpoint produces `ParamStates`; `load_slots` puts them into one optimizer (``torch.optim``
Adam/AdamW, DeepSpeed's basic optimizer inside a ZeRO wrapper, or `DynamicAdamW`, which loads a
torch-layout state as fp32 states and converts each tensor at its next update). Because every
parameter is whole, the layout that wrote a checkpoint (ZeRO stage, world size, buckets, param
groups) need not match the one that reads it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Mapping, Optional, Sequence

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")
"""The state tensors of Adam and AdamW, as ``torch.optim`` names them."""

HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")
"""Param-group keys carried across owners (an LR scheduler's current value lives in ``lr``)."""


@dataclass
class ParamState:
    """One parameter's optimizer state, whole and fp32.

    Attributes:
        master: the fp32 master weight (``None``: the weights the module was saved with are the
            masters, an fp32 run).
        exp_avg, exp_avg_sq: the moments. All three are shaped like the parameter, or flat where the
            reader does not know its shape (grad_release's shards); consumers index them flattened.
        step: optimizer steps taken.
        group: index of its param group in ``ParamStates.groups``.
    """

    master: Optional[torch.Tensor]
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int
    group: int = 0


class LazyParams(Mapping):
    """name → `ParamState`, each built when asked for (the last one kept): a reader that holds only
    an index and memory-mapped files, so a rank that needs a share of the parameters reads that share
    and holds one whole parameter at a time."""

    def __init__(self, names: Iterable[str], build: Callable[[str], ParamState], groups: Callable[[str], int]):
        self._names = list(dict.fromkeys(names))
        self.group_of = groups
        """name → its saved group, from the reader's index (without assembling the parameter)."""
        self._known = set(self._names)
        self._build = build
        self._last: tuple[Optional[str], Optional[ParamState]] = (None, None)

    def __getitem__(self, name: str) -> ParamState:
        if name not in self._known:
            raise KeyError(name)
        if self._last[0] != name:
            self._last = (name, self._build(name))
        return self._last[1]

    def __contains__(self, name: object) -> bool:
        return name in self._known

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


@dataclass
class ParamStates:
    """A checkpoint's optimizer state by parameter name.

    Attributes:
        source: what wrote it, for messages (``"DeepSpeed ZeRO-2 (bf16)"``).
        params: name → `ParamState` (a dict, or a `LazyParams`).
        groups: per saved param group, its `HYPERPARAMETERS` (empty dicts when the file has none).
        loss_scale: the fp16 loss scaler's state (``cur_scale``, ``cur_iter``, ...), else ``None``.
    """

    source: str
    params: Mapping[str, ParamState]
    groups: list[dict] = field(default_factory=list)
    loss_scale: Optional[dict] = None


def group_of(states: ParamStates, name: str) -> int:
    """The saved param group of ``name`` (from a lazy reader's index, without assembling it)."""
    params = states.params
    return params.group_of(name) if isinstance(params, LazyParams) else params[name].group


@dataclass(frozen=True)
class Fragment:
    """Elements ``[start, start + numel)`` of the flattened parameter ``name`` sit at
    ``[offset, offset + numel)`` of a slot's flattened tensor."""

    name: str
    start: int
    numel: int
    offset: int


@dataclass
class Slot:
    """A tensor an optimizer steps (an fp32 master, a flat ZeRO partition, an fp32 parameter) and
    the fragments of named parameters it holds."""

    tensor: torch.Tensor
    fragments: list[Fragment]


def load_slots(optimizer: torch.optim.Optimizer, slots: Sequence[Slot], states: ParamStates,
               set_masters: bool = True) -> int:
    """Give ``optimizer`` the states of its slots: masters copied in place, moments and step count
    loaded through its own ``load_state_dict`` in ``torch.optim.AdamW`` layout, and each param group's
    hyperparameters taken from the saved group of its first fragment's parameter.

    Args:
        slots: one per tensor of ``optimizer.param_groups`` that holds elements of saved parameters
            (tensors without a slot keep no state).
        set_masters: copy the saved fp32 masters into the slots' tensors.

    Returns:
        the number of elements given state.

    Raises:
        KeyError: a fragment names a parameter the checkpoint lacks (the caller checks names first).
    """
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    saved_group_of: dict[int, int] = {}
    state: dict[int, dict] = {}
    filled = 0
    with torch.no_grad():
        for slot in slots:
            if not slot.fragments:
                continue
            flat = slot.tensor.view(-1)
            moments = {m: torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device) for m in MOMENTS}
            steps = set()
            for f in slot.fragments:
                saved = states.params[f.name]
                steps.add(saved.step)
                if set_masters and saved.master is not None:
                    flat[f.offset:f.offset + f.numel].copy_(_piece(saved.master, f))
                for m in MOMENTS:
                    moments[m][f.offset:f.offset + f.numel].copy_(_piece(getattr(saved, m), f))
                filled += f.numel
            i = index[id(slot.tensor)]
            state[i] = {"step": torch.tensor(float(max(steps)), dtype=torch.float32),
                        **{m: v.view_as(slot.tensor) for m, v in moments.items()}}
            saved_group_of.setdefault(i, group_of(states, slot.fragments[0].name))
    sd = optimizer.state_dict()
    sd["state"] = state
    for group in sd["param_groups"]:
        sources = [saved_group_of[i] for i in group["params"] if i in saved_group_of]
        if sources and sources[0] < len(states.groups):
            group.update({k: v for k, v in states.groups[sources[0]].items() if k in group})
    optimizer.load_state_dict(sd)
    return filled


def set_hyperparameters(optimizer: torch.optim.Optimizer, names: dict, states: ParamStates) -> None:
    """Each param group of ``optimizer`` takes the saved `HYPERPARAMETERS` of the group its first named
    parameter was saved in (``names``: parameter → name); groups without saved parameters keep theirs."""
    for group in optimizer.param_groups:
        name = next((names[p] for p in group["params"] if names.get(p) in states.params), None)
        saved = group_of(states, name) if name is not None else None
        if saved is not None and saved < len(states.groups):
            group.update({k: v for k, v in states.groups[saved].items() if k in group})


def _piece(tensor: torch.Tensor, f: Fragment) -> torch.Tensor:
    return tensor.reshape(-1)[f.start:f.start + f.numel]


def hyperparameters(group: dict) -> dict:
    """The `HYPERPARAMETERS` of a saved param group (those it has)."""
    return {k: group[k] for k in HYPERPARAMETERS if k in group}


__all__ = ["Fragment", "HYPERPARAMETERS", "LazyParams", "MOMENTS", "ParamState", "ParamStates", "Slot",
           "group_of", "hyperparameters", "load_slots", "set_hyperparameters"]
