"""The neutral form of an optimizer state: per parameter name, the whole fp32 master, the
optimizer's per-element state tensors (Adam's two moments, SGD's momentum buffer, ...) and the step
count; and the slots an optimizer of this run steps, each made of fragments of named parameters.

Reading a checkpoint produces `ParamStates`; `load_slots` puts them into one optimizer (``torch.optim``
Adam/AdamW or another ``torch.optim`` optimizer, DeepSpeed's basic optimizer inside a ZeRO wrapper, or
`DynamicAdamW`, which loads a torch-layout Adam state as fp32 states and converts each tensor at its
next update). Because every parameter is whole, the layout that wrote a checkpoint (ZeRO stage, world
size, buckets, param groups) need not match the one that reads it; the optimizer must keep the same
state (a state of another kind is refused, `check_kind`).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
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
        moments: the optimizer's per-element state tensors by its own names (``exp_avg`` and
            ``exp_avg_sq`` for Adam, ``momentum_buffer`` for SGD). Each is shaped like the parameter,
            or flat where the reader does not know its shape (grad_release's shards); consumers index
            them flattened.
        step: optimizer steps taken (``None``: the optimizer keeps no step count, as torch's SGD).
        group: index of its param group in ``ParamStates.groups``.
    """

    master: Optional[torch.Tensor]
    moments: dict[str, torch.Tensor]
    step: Optional[int]
    group: int = 0


class StateKindError(ValueError):
    """A saved optimizer state that cannot be split by element, or that another kind of optimizer
    keeps (the message names both)."""


def elementwise_keys(state: dict, numel: int) -> tuple[str, ...]:
    """The per-element state tensors of a ``torch.optim`` state over ``numel`` elements (a flat
    partition, a shard or a parameter); `DynamicAdamW`'s codes (its ``format`` key) hold Adam's moments.

    Raises:
        StateKindError: an entry that is neither the step count nor one value per element.
    """
    if "format" in state:
        return MOMENTS
    keys = tuple(k for k, v in state.items() if k != "step" and torch.is_tensor(v) and v.numel() == numel)
    other = sorted(k for k, v in state.items() if k != "step" and k not in keys and v is not None)
    if other:
        raise StateKindError(f"the optimizer state holds {other}, which are not one value per element of the "
                             f"{numel} it covers, so they cannot be split by parameter")
    return keys


def flat_state_keys(state: dict) -> tuple[str, ...]:
    """`elementwise_keys` of a state over one flat tensor (a ZeRO partition or sub-group), whose size
    is its state tensors'."""
    numel = next((v.numel() for k, v in state.items() if k != "step" and torch.is_tensor(v)), 0)
    return elementwise_keys(state, numel)


def state_step(state: dict) -> Optional[int]:
    """A ``torch.optim`` state's step count (``None``: it keeps none)."""
    return int(state["step"]) if "step" in state else None


def check_kind(optimizer: torch.optim.Optimizer, states: "ParamStates", names: Iterable[str]) -> None:
    """Refuse ``states`` that ``optimizer`` does not keep: its state keys (`expected_keys`) against the
    saved ones of ``names``.

    Raises:
        StateKindError: they differ; the message names both and the fix.
    """
    expected = expected_keys(optimizer)
    if expected is None:
        return
    for name in names:  # the first parameter the saved optimizer stepped
        saved = states.params[name]
        if saved.moments or saved.step is not None:
            break
    else:
        return
    have = _with_step(saved.moments, saved.step is not None)
    if have != expected:
        raise StateKindError(f"the checkpoint's optimizer keeps {sorted(have)} per parameter ({states.source}) and "
                             f"this run's {type(optimizer).__name__} keeps {sorted(expected)}: another kind of "
                             "optimizer")


def expected_keys(optimizer: torch.optim.Optimizer) -> Optional[set]:
    """The state keys ``optimizer`` keeps per parameter: its ``torch_state_keys`` (`DynamicAdamW`: Adam's),
    those of a state it already holds, else those a copy of it makes in one step on two elements;
    ``None`` when that copy cannot be made (the check is skipped)."""
    declared = getattr(optimizer, "torch_state_keys", None)
    if declared is not None:
        return set(declared)
    for state in optimizer.state.values():
        if state:
            return _with_step(flat_state_keys(state), "step" in state)
    try:
        probe = torch.zeros(2, requires_grad=True)
        accepted = inspect.signature(type(optimizer).__init__).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
        copy = type(optimizer)([probe], **{k: v for k, v in optimizer.defaults.items() if takes_any or k in accepted})
        probe.grad = torch.zeros(2)
        copy.step()
        state = copy.state[probe]
        return _with_step(elementwise_keys(state, 2), "step" in state)
    except Exception:  # an optimizer that cannot be rebuilt from its defaults: nothing to compare
        return None


def _with_step(keys: Iterable[str], counts_steps: bool) -> set:
    """The state keys an optimizer keeps per parameter: its per-element ``keys`` and ``step`` if it counts."""
    return set(keys) | ({"step"} if counts_steps else set())


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


def with_masters(states: ParamStates, weights: Mapping[str, torch.Tensor]) -> ParamStates:
    """``states`` whose parameters without a master take their weight as it (fp32 training, where the
    weights are the masters), read one parameter at a time."""
    params = states.params

    def build(name: str) -> ParamState:
        saved = params[name]
        if saved.master is not None or name not in weights:
            return saved
        return replace(saved, master=weights[name].detach().float().reshape(-1).clone())

    return replace(states, params=LazyParams(list(params), build, lambda name: group_of(states, name)))


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
    """Give ``optimizer`` the states of its slots: masters copied in place, per-element states and step
    count loaded through its own ``load_state_dict`` in ``torch.optim`` layout, and each param group's
    hyperparameters taken from the saved group of its first fragment's parameter.

    Args:
        slots: one per tensor of ``optimizer.param_groups`` that holds elements of saved parameters
            (tensors without a slot keep no state).
        set_masters: copy the saved fp32 masters into the slots' tensors.

    Returns:
        the number of elements given state.

    Raises:
        KeyError: a fragment names a parameter the checkpoint lacks (the caller checks names first, and
            the kind of state, `check_kind`, before anything is loaded).
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
            keys = tuple(states.params[slot.fragments[0].name].moments)
            moments = {m: torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device) for m in keys}
            steps = set()
            for f in slot.fragments:
                saved = states.params[f.name]
                steps.add(saved.step)
                if set_masters and saved.master is not None:
                    flat[f.offset:f.offset + f.numel].copy_(_piece(saved.master, f))
                for m in keys:
                    moments[m][f.offset:f.offset + f.numel].copy_(_piece(saved.moments[m], f))
                filled += f.numel
            i = index[id(slot.tensor)]
            step = max((s for s in steps if s is not None), default=None)
            state[i] = {**({} if step is None else {"step": torch.tensor(float(step), dtype=torch.float32)}),
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
           "StateKindError", "check_kind", "elementwise_keys", "expected_keys", "flat_state_keys", "group_of",
           "hyperparameters", "load_slots", "set_hyperparameters", "state_step", "with_masters"]
