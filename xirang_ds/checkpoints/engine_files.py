"""The session's wrappers of the DeepSpeed engine's ``save_checkpoint`` and ``load_checkpoint``.

Saving puts the plugins' state into ``client_state`` and writes the tag's marker and (``deepspeed_files``)
DeepSpeed's own ZeRO files before DeepSpeed writes its files and then ``latest``: a save that dies midway
leaves ``latest`` on the previous checkpoint. Loading takes over an optimizer state whose owner is not this
run's (plain DeepSpeed's ZeRO files under grad_release, grad_release's shards without it, torch AdamW's
states under optimizer_states and back, another grad_release layout): DeepSpeed loads all but the optimizer
state and this run's owner takes it over from the whole per-parameter states (docs/checkpoints.md).
`xirang_ds.session.Session.attach` installs them with ``checkpoints=True`` (the DeepSpeed integration).
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Optional

from xirang_ds.checkpoints import BASIC_GROUPS
from xirang_ds.compat.deepspeed import shared_params
from xirang_ds.config.validate import XirangConfigError
from xirang_ds.hooks import wrap_method
from xirang_ds.version import __version__

if TYPE_CHECKING:  # pragma: no cover
    from xirang_ds.checkpoints.param_states import ParamStates
    from xirang_ds.checkpoints.tags import RunFacts

logger = logging.getLogger("xirang_ds")

CHECKPOINT_KEY = "xirang"
"""Key of the plugins' state inside DeepSpeed's ``client_state``."""


def load_checkpoint_options(engine: Any, *args: Any, **kwargs: Any) -> dict:
    """The arguments of a call ``engine.load_checkpoint(*args, **kwargs)`` by name, DeepSpeed's
    defaults filled in (``load_dir``, ``tag``, ``load_optimizer_states``, ``load_module_only``, ...)."""
    import inspect

    bound = inspect.signature(type(engine).load_checkpoint).bind(engine, *args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def save(session: Any, original, save_dir, tag=None, client_state=None, *args, **kwargs):
    """The plugins' state into ``client_state``, the marker, and (``deepspeed_files``) DeepSpeed's own
    ZeRO files, all before DeepSpeed writes its files and then ``latest``: a save that dies midway
    leaves ``latest`` on the previous checkpoint."""
    from xirang_ds.checkpoints import codes
    from xirang_ds.checkpoints.tags import facts_of_run, layout_record, write_deepspeed_files, write_marker

    client_state = dict(client_state or {})
    client_state[CHECKPOINT_KEY] = session.state_dict()
    tag_dir = os.path.join(save_dir, str(tag) if tag is not None else f"global_step{session.engine.global_steps}")
    marker = {"xirang_ds": __version__, "preset": session.config.preset,
              "sections": [p.section for p in session.plugins]}
    facts = facts_of_run(session)
    codes_beside = facts is not None and session.stepper is None
    if facts is not None:
        marker["deepspeed_files"] = layout_record(facts)
    if codes_beside:
        codes.mark(marker)
    if int(getattr(session.engine, "local_rank", session.engine.global_rank)) == 0:
        # by the first rank of every node: each node reads its own copy when checkpoints are node-local
        write_marker(tag_dir, marker)
    if facts is not None and facts.stage == 0:
        return _save_with_stage0_entry(session, original, tag_dir, marker, facts, save_dir, tag, client_state,
                                            *args, **kwargs)
    if codes_beside:
        with codes.saving_beside(session.engine, tag_dir, marker, facts, write_deepspeed_files):
            return original(save_dir, tag, client_state, *args, **kwargs)
    if facts is not None:
        client_state.update(_write_deepspeed_files(session, save_dir, tag_dir, marker, facts))
    return original(save_dir, tag, client_state, *args, **kwargs)

def _save_with_stage0_entry(session: Any, original, tag_dir: str, marker: dict, facts: "RunFacts", save_dir, tag,
                            client_state: dict, *args, **kwargs):
    """A stage-0 save whose model-states file holds plain DeepSpeed's optimizer entry, built by the
    writing rank from every rank's grad_release shard (written just before); the basic optimizer's
    own groups go under `BASIC_GROUPS` for this block's resume."""
    import deepspeed.comm as dist

    from xirang_ds.checkpoints.tags import stage0_optimizer_entry

    client_state[BASIC_GROUPS] = facts.optimizer_groups
    dist.barrier()  # every rank's shard is on disk
    if not session.engine.save_non_zero_checkpoint:
        return original(save_dir, tag, client_state, *args, **kwargs)
    entry, _ = stage0_optimizer_entry(tag_dir, marker, facts)
    handle = wrap_method(session.engine.optimizer, "state_dict", lambda _original: entry)
    try:  # DeepSpeed's _save_checkpoint writes optimizer.state_dict() into the model-states file
        return original(save_dir, tag, client_state, *args, **kwargs)
    finally:
        handle.remove()

def _write_deepspeed_files(session: Any, save_dir: str, tag_dir: str, marker: dict, facts: "RunFacts") -> dict:
    """This rank's ZeRO file, from every rank's grad_release shard (written just before); returns the
    model-states entries a ZeRO run records (``param_shapes``, ...), for DeepSpeed to write."""
    import deepspeed.comm as dist

    from xirang_ds.checkpoints.deepspeed_writer import copy_recovery_script, zero_model_entries
    from xirang_ds.checkpoints.tags import write_deepspeed_files

    dist.barrier()  # every rank's shard is on disk
    _, groups = write_deepspeed_files(tag_dir, marker, facts, ranks=[session.stepper.comm.rank])
    if session.engine.global_rank == 0:
        copy_recovery_script(save_dir)
    frozen = [(n, p) for n, p in session.engine.module.named_parameters() if not p.requires_grad]
    return zero_model_entries(groups, facts.params, frozen, shared_params(session.engine))

def load(session: Any, original, *args, **kwargs):
    """DeepSpeed's load; when the checkpoint's optimizer state belongs to another owner (plain
    DeepSpeed's ZeRO files under grad_release, grad_release's shards without it, torch AdamW's
    states under optimizer_states and back, another grad_release layout), DeepSpeed loads all but
    the optimizer state and this run's owner takes it over from the whole per-parameter states
    (docs/checkpoints.md)."""
    import contextlib

    from xirang_ds.checkpoints import codes

    options = load_checkpoint_options(session.engine, *args, **kwargs)
    own_codes = _own_codes(session, options)
    foreign = None if own_codes else _foreign_optimizer_state(session, options)
    if foreign is None:
        with codes.loading(session.engine, own_codes) if own_codes else contextlib.nullcontext():
            load_path, client_state = original(*args, **kwargs)
    else:
        states = _read_states(session, *foreign)  # before anything is modified: a refusal leaves the run as it was
        call = {k: v for k, v in options.items() if k != "self"}
        load_path, client_state = original(**{**call, "load_optimizer_states": False})
        if load_path is not None:
            _take_over(session, states)
            session.record_event("optimizer_state_taken_over", source=states.source, params=len(states.params))
            if int(getattr(session.engine, "global_rank", 0)) == 0:
                logger.info("xirang: optimizer state taken over from %s (%d parameters)", states.source,
                            len(states.params))
    if client_state and CHECKPOINT_KEY in client_state:
        session.load_state_dict(client_state.pop(CHECKPOINT_KEY))
    return load_path, client_state

def _foreign_optimizer_state(session: Any, options: dict) -> Optional[tuple[str, dict]]:
    """``(tag folder, its marker)`` when the optimizer state of the checkpoint DeepSpeed is about to
    load is not this run's owner's own, else ``None``."""
    from xirang_ds.checkpoints.tags import owner_sections, read_marker, resolve_tag, state_owners

    if not options["load_optimizer_states"] or options["load_module_only"]:
        return None
    tag_dir = resolve_tag(options["load_dir"], options["tag"])
    if tag_dir is None:
        return None  # DeepSpeed's own message for a folder without a checkpoint
    marker = read_marker(tag_dir)
    current = {p.section for p in session.plugins} & set(owner_sections())
    if state_owners(marker) != current:
        return tag_dir, marker
    stepper = session.stepper
    if stepper is not None and stepper.layout_differs(tag_dir):
        return tag_dir, marker
    return None

def _own_codes(session: Any, options: dict) -> Optional[str]:
    """The tag folder whose optimizer_states codes this run resumes as its own, through DeepSpeed's own
    load (`codes.resumes_own`); ``None`` otherwise."""
    from xirang_ds.checkpoints import codes
    from xirang_ds.checkpoints.tags import read_marker, resolve_tag

    if not options["load_optimizer_states"] or options["load_module_only"]:
        return None
    tag_dir = resolve_tag(options["load_dir"], options["tag"])
    if tag_dir is None or not codes.resumes_own(session.engine, {p.section for p in session.plugins},
                                                 read_marker(tag_dir)):
        return None
    return tag_dir

def _read_states(session: Any, tag_dir: str, marker: dict) -> "ParamStates":
    """The checkpoint's optimizer state per parameter.

    Raises:
        XirangConfigError: it cannot be read, or lacks parameters this run trains; the message names
            the checkpoint's block, this run's and the fix.
    """
    from xirang_ds.checkpoints.deepspeed_files import CheckpointReadError
    from xirang_ds.checkpoints.param_states import check_kind
    from xirang_ds.checkpoints.tags import read_states

    trainable = [(n, p) for n, p in session.engine.module.named_parameters() if p.requires_grad]
    saved = marker.get("sections", [])
    written = ("xirang sections " + ", ".join(saved)) if saved else "plain DeepSpeed"
    running = ", ".join(p.section for p in session.plugins)
    fix = ("Fix: engine.load_checkpoint(..., load_optimizer_states=False) loads the weights, the LR schedule and "
           "the step counters and restarts the optimizer's moments from the loaded weights; or resume with the "
           "block the checkpoint was written with")
    if session.stepper is None:
        from xirang_ds.checkpoints.deepspeed_slots import UnknownOptimizerError, engine_slots

        try:
            engine_slots(session.engine)  # the target is known before DeepSpeed loads anything
        except UnknownOptimizerError as e:
            raise XirangConfigError([("checkpoint", f"{tag_dir} (written by {written}): {e}. {fix}")],
                                    title="cannot resume from this checkpoint") from None
    try:
        states = read_states(tag_dir, marker, [n for n, _ in trainable], {n: p.shape for n, p in trainable})
        check_kind(_stepped(session), states, [n for n, _ in trainable if n in states.params])
    except (CheckpointReadError, FileNotFoundError, ValueError, KeyError) as e:
        raise XirangConfigError([("checkpoint", f"{tag_dir} (written by {written}) cannot be taken over by this "
                                  f"run's sections ({running}): {e}. {fix}")],
                                title="cannot resume from this checkpoint") from None
    absent = [n for n, _ in trainable if n not in states.params]
    if absent:
        raise XirangConfigError([("checkpoint", f"{tag_dir} (written by {written}) has no optimizer state for "
                                  f"{len(absent)} parameter(s) this run trains ({', '.join(absent[:3])}"
                                  f"{', ...' if len(absent) > 3 else ''}). {fix}")],
                                title="cannot resume from this checkpoint")
    return states


def _stepped(session: Any) -> Any:
    """The optimizer whose kind the taken-over state must be: grad_release's buckets step copies of the
    engine's basic optimizer; elsewhere DeepSpeed's basic optimizer (`deepspeed_slots.engine_slots`)."""
    from xirang_ds.checkpoints.deepspeed_slots import engine_slots

    if session.stepper is not None:
        return session.engine.optimizer
    return engine_slots(session.engine)[0]


def _take_over(session: Any, states: "ParamStates") -> None:
    """Put the whole per-parameter states into whichever optimizer steps this run."""
    from xirang_ds.checkpoints.deepspeed_slots import load_engine_states

    stepper = session.stepper
    if stepper is not None:
        stepper.take_over(states)
    else:
        load_engine_states(session.engine, states)


__all__ = ["CHECKPOINT_KEY", "load", "load_checkpoint_options", "save"]
