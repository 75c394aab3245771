"""The removal and resume checks every plugin section makes, written once.

Resume: a run saved after ``at`` of ``steps`` steps and resumed by a fresh engine continues exactly
where the uninterrupted run goes (`resume_runs` in one rank process, `resume_in_fresh_processes` across
process starts, `assert_resumed` for the comparison; `megatron_state_dict_round_trip` through
Megatron's optimizer ``state_dict``).

Removal: after ``session.remove()`` the objects are as they were (`megatron_built_and_removed`,
`replaced_methods`) and training continues as plain Megatron does (`megatron_removal_against_plain`).

Rank-side functions return plain data (lists, dicts, tensors) for ``xirang_ds.launch.run_ranks`` to
pickle; the ``assert_*`` functions run in the test process.
"""
from __future__ import annotations

import copy
import functools
import os
from typing import Any, Callable, Optional

import torch

from xirang_ds.launch import run_ranks


# resume ------------------------------------------------------------------------------------------------
def resume_runs(train: Callable[..., dict], tmp: str, *args: Any, steps: int = 4, at: int = 2,
                skip: Optional[int] = None, **kwargs: Any) -> tuple[dict, dict, dict]:
    """In one rank process: ``train(*args, steps=steps)`` uninterrupted, ``train(*args, steps=at,
    save_dir=tmp)``, then ``train(*args, steps=steps - at, load_dir=tmp, skip=skip)`` in a fresh engine.

    Args:
        train: a rank-side run taking ``steps``, ``save_dir``, ``load_dir`` and ``skip`` (the data it
            skips after loading, in its own unit: micro-batches or steps) as keywords.
        skip: left out of the resumed call when None (``train`` skips what the checkpoint holds).

    Returns:
        ``(full, first, resumed)``, each what ``train`` returned.
    """
    resumed_kwargs = {} if skip is None else {"skip": skip}
    full = train(*args, steps=steps, **kwargs)
    first = train(*args, steps=at, save_dir=tmp, **kwargs)
    resumed = train(*args, steps=steps - at, load_dir=tmp, **resumed_kwargs, **kwargs)
    return full, first, resumed


def resume_in_fresh_processes(train: Callable[..., dict], world: int, tmp: str, *args: Any, steps: int = 4,
                              at: int = 2, skip: Optional[int] = None, **run_kwargs: Any) -> list[tuple[dict, dict]]:
    """`resume_runs` with each of the three runs in its own ``run_ranks`` start (nothing carried over in
    the process); ``[(full, resumed)]`` per rank."""
    resumed_kwargs = {} if skip is None else {"skip": skip}
    full = run_ranks(functools.partial(train, steps=steps), world, *args, **run_kwargs)
    run_ranks(functools.partial(train, steps=at, save_dir=tmp), world, *args, **run_kwargs)
    resumed = run_ranks(functools.partial(train, steps=steps - at, load_dir=tmp, **resumed_kwargs), world, *args,
                        **run_kwargs)
    return list(zip(full, resumed))


def same_tensors(a: Any, b: Any) -> bool:
    """Bit-identical: one tensor each, or pairwise over two sequences of tensors."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return all(torch.equal(x, y) for x, y in zip(a, b))


def assert_resumed(full: dict, resumed: dict, at: int, first: Optional[dict] = None, params: bool = False) -> None:
    """The resumed run's losses are the uninterrupted run's from step ``at`` on, bit for bit; with
    ``first``, the saved run's are its first ``at``; with ``params``, the final parameters are equal."""
    # where the runs record their gradient norms (resumed, uninterrupted, saved), a failure names them too
    said = ("norms", *(r.get("norms") for r in (resumed, full, first or {}))) if "norms" in full else ()
    assert resumed["losses"] == full["losses"][at:], (resumed["losses"], full["losses"], *said)
    if first is not None:
        assert first["losses"] == full["losses"][:at], (first["losses"], full["losses"], *said)
    if params:
        assert same_tensors(resumed["params"], full["params"])


def megatron_state_dict_round_trip(ex: Any, argv: list[str], before: int, after: int,
                                   load_into: Optional[dict[str, list[str]]] = None,
                                   inspect: Optional[Callable[[Any], Any]] = None,
                                   parameter_state: Optional[str] = None) -> dict:
    """Megatron (``ex`` is ``examples/megatron_gpt.py``): ``before`` steps, the model's and optimizer's
    ``state_dict`` saved (copies: torch returns the live tensors), ``after`` more steps; then, for each
    ``{name: argv}`` of ``load_into`` (default ``{"resumed": argv}``), a fresh build that skips the
    batches already seen, loads both and trains the same ``after`` steps. With ``parameter_state`` (a
    file path the ranks share), the distributed optimizer's states go through
    ``save_parameter_state``/``load_parameter_state`` too, as Megatron-LM's ``--ckpt-format torch`` does.

    Returns:
        ``{"continued": losses, <name>: losses, ..., "saved_optimizer": the saved dict, "inspected":
        inspect(session) before the first session is removed}``.
    """
    opts = ex.parse_args(argv)
    model, optimizer, session, make_data = ex.build_loop(opts)
    run_step = ex.step_function(opts, model, optimizer, make_data())
    for _ in range(before):
        run_step()
    saved_model = copy.deepcopy(model.module.state_dict())
    saved_optimizer = copy.deepcopy(optimizer.state_dict())
    if parameter_state is not None:
        optimizer.save_parameter_state(parameter_state)
        torch.distributed.barrier()
    out: dict = {"continued": [run_step() for _ in range(after)]}
    out["inspected"] = inspect(session) if inspect is not None else None
    if session is not None:
        session.remove()
    for name, resume_argv in (load_into or {"resumed": argv}).items():
        opts = ex.parse_args(resume_argv)
        model, optimizer, session, make_data = ex.build_loop(opts)
        data = make_data()
        for _ in range(before * opts.num_microbatches):
            next(data)
        model.module.load_state_dict(saved_model)
        optimizer.load_state_dict(copy.deepcopy(saved_optimizer))  # loading may keep references too
        if parameter_state is not None:
            with torch.no_grad():  # an fp32 model's ranges are views of its parameters, which Megatron copies into
                optimizer.load_parameter_state(parameter_state)
        run_step = ex.step_function(opts, model, optimizer, data)
        out[name] = [run_step() for _ in range(after)]
        if session is not None:
            session.remove()
    out["saved_optimizer"] = saved_optimizer
    return out


def megatron_dist_checkpoint_round_trip(ex: Any, argv: list[str], before: int, after: int, directory: str,
                                        load_into: dict[str, list[str]], metadata: Optional[dict] = None) -> dict:
    """As `megatron_state_dict_round_trip`, through Megatron's distributed checkpoint (``sharded_state_dict``
    and ``dist_checkpointing.save``/``load``, Megatron-LM's ``--ckpt-format torch_dist``) in ``directory``
    (shared by the ranks); ``metadata`` goes to the optimizer's ``sharded_state_dict`` (the distributed
    optimizer's ``distrib_optim_sharding_type``).

    Returns:
        ``{"continued": losses, <name>: losses, ...}``.
    """
    import torch
    from megatron.core import dist_checkpointing

    opts = ex.parse_args(argv)
    model, optimizer, session, make_data = ex.build_loop(opts)
    run_step = ex.step_function(opts, model, optimizer, make_data())
    for _ in range(before):
        run_step()
    os.makedirs(directory, exist_ok=True)
    torch.distributed.barrier()
    model_state = model.module.sharded_state_dict()
    dist_checkpointing.save({"model": model_state, "optimizer": optimizer.sharded_state_dict(model_state,
                                                                                          metadata=metadata)},
                            directory)
    out: dict = {"continued": [run_step() for _ in range(after)]}
    if session is not None:
        session.remove()
    for name, resume_argv in load_into.items():
        opts = ex.parse_args(resume_argv)
        model, optimizer, session, make_data = ex.build_loop(opts)
        data = make_data()
        for _ in range(before * opts.num_microbatches):
            next(data)
        model_state = model.module.sharded_state_dict()
        with torch.no_grad():  # an fp32 model's distributed-optimizer ranges are views of its parameters
            for member in getattr(optimizer, "chained_optimizers", [optimizer]):
                # megatron-core without Apex or TE (torch's Adam) asserts on a distributed optimizer whose torch
                # optimizer holds no state yet (distrib_optimizer.py L650, still so upstream): its own dummy-value
                # step makes them; the load then overwrites parameters, states and step
                if hasattr(member, "_init_optimizer_states_with_dummy_values") and not member.optimizer.state:
                    member._init_optimizer_states_with_dummy_values()
            loaded = dist_checkpointing.load({"model": model_state, "optimizer": optimizer.sharded_state_dict(
                model_state, is_loading=True, metadata=metadata)}, directory)
            model.module.load_state_dict(loaded["model"])
            optimizer.load_state_dict(loaded["optimizer"])
        run_step = ex.step_function(opts, model, optimizer, data)
        out[name] = [run_step() for _ in range(after)]
        if session is not None:
            session.remove()
    return out


# removal -----------------------------------------------------------------------------------------------
def replaced_methods(model: Any, names: tuple[str, ...] = ("forward",)) -> list[str]:
    """The modules of ``model`` with any of ``names`` replaced on the instance (a plugin's wrapper)."""
    return sorted(n for n, m in model.named_modules() if vars(m).keys() & set(names))


def megatron_built_and_removed(ex: Any, argv: list[str], snapshot: Callable[[Any, Any, Any], Any],
                               prepare: Optional[Callable[[Any], Any]] = None) -> dict:
    """Megatron: build with the session attached (2 micro-batches), ``prepare(session)``, then
    ``{"before": snapshot(model, optimizer, session), "after": the same once session.remove() ran}``."""
    model, optimizer, session = ex.build(ex.parse_args(argv), 2)
    if prepare is not None:
        prepare(session)
    before = snapshot(model, optimizer, session)
    session.remove()
    return {"before": before, "after": snapshot(model, optimizer, session)}


def megatron_removal_against_plain(ex: Any, argv: list[str], plain_argv: list[str], steps: int,
                                   during: Optional[Callable[[Any, Any], Any]] = None,
                                   after: Optional[Callable[[Any, Any], Any]] = None) -> dict:
    """Megatron: ``steps`` steps with the plugin, ``session.remove()``, ``steps`` more on the same objects;
    and plain Megatron (``plain_argv``) for ``2 * steps``.

    Returns:
        ``{"losses": the 2 * steps losses across removal, "plain": plain Megatron's, "during":
        during(model, optimizer) before removal, "after": after(model, optimizer) right after it}``.
    """
    opts = ex.parse_args(argv)
    model, optimizer, session, make_data = ex.build_loop(opts)
    run_step = ex.step_function(opts, model, optimizer, make_data())
    losses = [run_step() for _ in range(steps)]
    seen = during(model, optimizer) if during is not None else None
    session.remove()
    left = after(model, optimizer) if after is not None else None
    losses += [run_step() for _ in range(steps)]
    plain_opts = ex.parse_args(plain_argv)
    model, optimizer, _, make_data = ex.build_loop(plain_opts)
    run_step = ex.step_function(plain_opts, model, optimizer, make_data())
    return {"losses": losses, "plain": [run_step() for _ in range(2 * steps)], "during": seen, "after": left}
