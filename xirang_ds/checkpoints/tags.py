"""One checkpoint tag folder: which block wrote it, its optimizer state per parameter whoever owns
it, and DeepSpeed's own ZeRO files written beside xirang's (`export_deepspeed_files`), so plain
DeepSpeed, ``zero_to_fp32.py`` and ``ds_to_universal`` read every xirang checkpoint."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch

from xirang_ds.checkpoints import BASIC_GROUPS, codes, update_saved
from xirang_ds.checkpoints.deepspeed_files import (
    MODEL_STATES,
    ds_config_dtype,
    load_states_file,
    optim_files,
    read_deepspeed_states,
)
from xirang_ds.checkpoints.deepspeed_writer import (
    add_param_shapes,
    copy_recovery_script,
    stage0_entry,
    write_zero3_files,
    write_zero_files,
)
from xirang_ds.checkpoints.param_states import ParamStates, group_of, with_masters
from xirang_ds.contributions import StateFiles, state_codes, state_files

MARKER = "xirang_block.json"
"""Written into each checkpoint's tag folder: the xirang_ds version, the preset and the sections that
ran, and (``deepspeed_files``) the layout of the plain ZeRO files written beside them."""



def owner_sections() -> tuple[str, ...]:
    """Sections that change who holds the optimizer state, or its layout: the one that keeps it in files of
    its own (`xirang_ds.contributions.StateFiles`: grad_release's shards, holding fp32 masters and states)
    and the one whose codes DeepSpeed's files hold (`StateCodes`: optimizer_states' DynamicAdamW over its own
    param groups). A resume whose checkpoint differs from the run in these is a take-over
    (`xirang_ds.checkpoints.engine_files.load`)."""
    return tuple(entry.section for entry in (state_files(), state_codes()) if entry is not None)


def own_files(owners: set[str]) -> Optional[StateFiles]:
    """The `StateFiles` owner among ``owners`` (`state_owners`), or ``None``."""
    own = state_files()
    return own if own is not None and own.section in owners else None


def resolve_tag(load_dir: str, tag: Optional[str]) -> Optional[str]:
    """The tag folder ``engine.load_checkpoint(load_dir, tag)`` reads (``latest`` when no tag), or
    ``None`` when there is none (DeepSpeed then says so itself)."""
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            return None
        with open(latest, encoding="utf-8") as f:
            tag = f.read().strip()
    tag_dir = os.path.join(load_dir, str(tag))
    return tag_dir if os.path.isdir(tag_dir) else None


def read_marker(tag_dir: str) -> dict:
    """The tag's `MARKER` (``{}`` for a plain DeepSpeed checkpoint; grad_release's folder alone means a
    checkpoint written before the marker existed)."""
    path = os.path.join(tag_dir, MARKER)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    own = state_files()
    if own is not None and os.path.isdir(os.path.join(tag_dir, own.folder)):
        return {"sections": [own.section]}
    return {}


def write_marker(tag_dir: str, marker: dict) -> None:
    """`MARKER` written to a temporary name and renamed (atomic where the folder is shared)."""
    os.makedirs(tag_dir, exist_ok=True)
    path = os.path.join(tag_dir, MARKER)
    temporary = f"{path}.{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump(marker, f, indent=2)
    os.replace(temporary, path)


def state_owners(marker: dict) -> set[str]:
    """The sections that own the tag's optimizer state (`owner_sections`): the one with files of its own, and
    the one whose codes DeepSpeed's files hold unless plain ZeRO files replaced those."""
    sections = set(marker.get("sections", []))
    owners = sections & set(owner_sections())
    coded = state_codes()
    if own_files(owners) is None and marker.get("deepspeed_files") and coded is not None:
        owners.discard(coded.section)  # DeepSpeed's files were rewritten in plain layout
    return owners


def read_states(tag_dir: str, marker: dict, names: Sequence[str], shapes: dict[str, torch.Size],
                optimizer_groups: Optional[list[dict]] = None) -> ParamStates:
    """The tag's optimizer state per parameter, from whichever owner wrote it.

    Args:
        names, shapes: the trainable parameters in ``model.parameters()`` order (a stage-0 DeepSpeed
            state is indexed by position).
        optimizer_groups: the basic optimizer's param groups, when the model-states file is not written
            yet (at save).
    """
    own = own_files(state_owners(marker))
    if own is not None:
        return own.read_states(tag_dir, optimizer_groups)
    if codes.in_marker(marker):
        return codes.read_codes(tag_dir, names, shapes)
    return read_deepspeed_states(tag_dir, names, shapes)


@dataclass
class RunFacts:
    """What DeepSpeed's plain layout needs to know about the run that wrote a checkpoint: from its files
    (`facts_from_files`) or, at save, from the engine.

    Attributes:
        params: the trainable parameters' shapes by name, in ``model.parameters()`` order.
        optimizer_groups: the basic optimizer's param groups as its ``state_dict()`` writes them (the
            LR scheduler's current values; optimizer_states' halves marked with ``xirang_group``).
        dtype, stage, world: the run's training dtype, ZeRO stage and data-parallel ranks.
        ds_config: the ds_config as the user wrote it, when known.
        fused: the plain run's basic optimizer is FusedAdam (DeepSpeed's default for an Adam block on
            an accelerator): it keeps each step as an int, and at stage 0 in bf16/fp16 DeepSpeed wraps it
            in ``FP16_Optimizer`` (flat masters) instead of ``FP16_UnfusedOptimizer``.
    """

    params: dict[str, torch.Size]
    optimizer_groups: Optional[list[dict]]
    dtype: str
    stage: int
    world: int
    ds_config: Optional[dict] = None
    fused: bool = False
    sub_groups: Optional[list[int]] = None
    """ZeRO-3: the elements of each of this run's sub-groups per rank (DeepSpeed's own load of the codes
    needs the same cut, `codes.resumes_own`)."""
    weights: Optional[Mapping[str, torch.Tensor]] = None
    """fp32 training: the trainable weights by name, which are their own masters (grad_release keeps no
    other copy; DeepSpeed's ZeRO 1/2 files hold them as the fp32 partitions): the live module's at save,
    the model-states file's ``module`` at an export."""


def facts_of_run(session: Any) -> Optional[RunFacts]:
    """What a running session's plain DeepSpeed files need (``None``: none are written: ``deepspeed_files``
    is off, or DeepSpeed's own files already are plain: neither grad_release at ZeRO 0-2 nor
    optimizer_states inside DeepSpeed's ZeRO 1-3 optimizer holds the optimizer state)."""
    if not session.config.deepspeed_files:
        return None
    stepper, engine = session.stepper, session.engine
    if stepper is not None and stepper.setup.zero_stage in (0, 1, 2):
        dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(stepper.setup.param_dtype, "fp32")
        groups, stage, world = (engine.optimizer.state_dict()["param_groups"], stepper.setup.zero_stage,
                                stepper.comm.world)
    elif (stepper is None and session.state_quantizer is not None
          and engine.zero_optimization_stage() in (1, 2, 3)):
        import deepspeed.comm as dist

        dtype = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
        # the groups' hyperparameters (a ZeRO optimizer's state_dict() is its own layout, not torch's)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in engine.basic_optimizer.param_groups]
        stage = engine.zero_optimization_stage()
        world = dist.get_world_size(group=engine.optimizer.dp_process_group)
    else:
        return None
    # a ZeRO-3 parameter is partitioned: its shape is ds_shape
    params = {n: getattr(p, "ds_shape", p.shape) for n, p in engine.module.named_parameters() if p.requires_grad}
    weights = ({n: p for n, p in engine.module.named_parameters() if p.requires_grad} if dtype == "fp32" else None)
    return RunFacts(params=params, optimizer_groups=groups, dtype=dtype, stage=stage, world=world,
                    ds_config=session.requested_ds_config, fused=_plain_optimizer_fused(session),
                    sub_groups=codes.zero3_sub_groups(engine), weights=weights)


def _plain_optimizer_fused(session: Any) -> bool:
    """Whether the run without the block would step a FusedAdam (`RunFacts.fused`): the basic
    optimizer, or the one optimizer_states replaced; for a ds_config Adam block that it replaced,
    DeepSpeed's rule (``_configure_basic_optimizer``: FusedAdam unless ``torch_adam``)."""
    import deepspeed.runtime.engine as ds_engine

    fused = (ds_engine.FusedAdam,) + ((ds_engine.apex.optimizers.FusedAdam,) if ds_engine.APEX_INSTALLED else ())
    quantizer = session.state_quantizer
    basic = session.engine.basic_optimizer if quantizer is None else quantizer.original
    if basic is None:
        spec = session.requested_ds_config.get("optimizer") or {}
        return (str(spec.get("type", "")).lower() in ("adam", "adamw")
                and not (spec.get("params") or {}).get("torch_adam", False))
    return isinstance(basic, fused)


def write_deepspeed_files(tag_dir: str, marker: dict, facts: RunFacts,
                          ranks: Optional[Iterable[int]] = None) -> tuple[list[str], list[list[str]]]:
    """Plain DeepSpeed's ZeRO files of the tag's optimizer state, for ``ranks`` (default all).

    Returns:
        the paths written and the param groups' names (the ``param_shapes`` the model-states file needs).

    Raises:
        ValueError: a stage these files cannot express, with what to do instead.
    """
    zero3_files = os.path.isfile(os.path.join(tag_dir, "zero_pp_rank_0_mp_rank_00_model_states.pt"))
    if facts.stage == 0:
        raise ValueError(f"{tag_dir}: stage 0 keeps its plain optimizer state inside the model-states file "
                         "(`stage0_entry`), not in ZeRO files")
    if facts.stage not in (1, 2, 3) or (facts.stage == 3) != zero3_files:
        written_for = "ZeRO-3" if zero3_files else "stage 0, 1 or 2"
        raise ValueError(f"{tag_dir} was written by a {written_for} run and cannot hold plain files for stage "
                         f"{facts.stage}: stage 0 keeps its optimizer state inside the model-states file (which "
                         "xirang's own resume reads), and ZeRO-3 and the other stages keep their model states in "
                         "differently named files. Fix: export for the stage the run used, then DeepSpeed's "
                         "ds_to_universal converts it for another")
    states, groups, torch_groups = _plain_groups(tag_dir, marker, facts)
    numels = {n: shape.numel() for n, shape in facts.params.items()}
    if facts.stage == 3:
        zero = (facts.ds_config or {}).get("zero_optimization") or {}
        subs = write_zero3_files(tag_dir, states, groups, numels, facts.params, torch_groups, facts.dtype, facts.world,
                                 sub_group_size=int(zero.get("sub_group_size", 1e9)), ds_config=facts.ds_config,
                                 fused=facts.fused, ranks=ranks)
        return [os.path.join(tag_dir, n) for n in sorted(os.listdir(tag_dir)) if "optim_states" in n], subs
    written = write_zero_files(tag_dir, states, groups, numels, torch_groups, facts.stage, facts.dtype, facts.world,
                               ranks=ranks, ds_config=facts.ds_config, fused=facts.fused)
    return written, groups


def stage0_optimizer_entry(tag_dir: str, marker: dict, facts: RunFacts) -> tuple[dict, list[list[str]]]:
    """The ``optimizer`` entry of the tag's model-states file in the layout plain DeepSpeed at stage 0
    loads for ``facts`` (`deepspeed_writer.stage0_entry`), and the param groups' names."""
    states, groups, torch_groups = _plain_groups(tag_dir, marker, facts)
    return stage0_entry(states, groups, facts.params, torch_groups, facts.dtype, facts.fused, facts.ds_config), groups


def _plain_groups(tag_dir: str, marker: dict, facts: RunFacts) -> tuple[ParamStates, list[list[str]], list[dict]]:
    """The tag's states, the names of each param group of the plain layout (the user's groups, in
    ``model.parameters()`` order) and each group's torch param-group dict."""
    names = list(facts.params)
    states = read_states(tag_dir, marker, names, facts.params, facts.optimizer_groups)
    if facts.weights is not None:
        states = with_masters(states, facts.weights)
    by_group: dict[int, list[str]] = {}
    for n in names:
        if n in states.params:
            by_group.setdefault(group_of(states, n), []).append(n)
    groups = [by_group[g] for g in sorted(by_group)]
    return states, groups, _torch_groups(facts.optimizer_groups, states, len(groups))


def export_deepspeed_files(save_dir: str, tag: Optional[str] = None, stage: Optional[int] = None,
                           world: Optional[int] = None, fused: Optional[bool] = None) -> list[str]:
    """`write_deepspeed_files` for a checkpoint already on disk, every rank (``xirang-ds checkpoint
    export``): ``param_shapes`` go into its model-states file, ``zero_to_fp32.py`` into ``save_dir``,
    the layout into the marker. At stage 0 the model-states file's ``optimizer`` entry is rewritten in
    plain DeepSpeed's layout instead (`stage0_optimizer_entry`). xirang's own files stay; after an
    export of an optimizer_states checkpoint (whose DeepSpeed files held int8/int4 codes) a run with the
    block takes the state over from the plain files.

    Args:
        stage, world: the ZeRO stage and data-parallel size to write for (default: the run's).
        fused: the loading run's optimizer is FusedAdam (`RunFacts.fused`; default: as recorded at save,
            else no).

    Returns:
        the paths written ([] when the optimizer state already is in DeepSpeed's own layout).
    """
    tag_dir = resolve_tag(save_dir, tag)
    if tag_dir is None:
        raise ValueError(f"{save_dir} has no checkpoint tag {tag!r} (no 'latest' file or no such folder)")
    marker = read_marker(tag_dir)
    if not state_owners(marker):
        return []
    facts = facts_from_files(tag_dir, marker)
    facts.stage = facts.stage if stage is None else stage
    facts.world = facts.world if world is None else world
    facts.fused = facts.fused if fused is None else fused
    if facts.stage == 0:
        return [_export_stage0(tag_dir, marker, facts)]
    written, groups = write_deepspeed_files(tag_dir, marker, facts)
    if facts.stage in (1, 2):  # ZeRO-3's per-rank model-states files got theirs from the writer
        add_param_shapes(tag_dir, groups, facts.params)
    copy_recovery_script(save_dir)
    write_marker(tag_dir, {**marker, "deepspeed_files": layout_record(facts)})
    return written


def _export_stage0(tag_dir: str, marker: dict, facts: RunFacts) -> str:
    """The model-states file with plain DeepSpeed's stage-0 ``optimizer`` entry, the basic optimizer's
    own groups kept under `BASIC_GROUPS`; returns its path."""
    path = os.path.join(tag_dir, MODEL_STATES)
    if not os.path.isfile(path):
        raise ValueError(f"{tag_dir} was written by a ZeRO-3 run (no {MODEL_STATES}) and cannot hold a stage-0 "
                         "optimizer entry. Fix: export for stage 3, then DeepSpeed's ds_to_universal converts it")
    entry, _ = stage0_optimizer_entry(tag_dir, marker, facts)
    own = own_files(state_owners(marker))
    kept = {BASIC_GROUPS: own.basic_groups(load_states_file(path))} if own is not None else {}
    update_saved(path, optimizer=entry, **kept)
    write_marker(tag_dir, {**marker, "deepspeed_files": layout_record(facts)})
    return path


def layout_record(facts: RunFacts) -> dict:
    """The marker's ``deepspeed_files`` entry."""
    out = {"stage": facts.stage, "world": facts.world, "dtype": facts.dtype, "fused": facts.fused}
    return out if facts.sub_groups is None else {**out, "sub_groups": list(facts.sub_groups)}


def facts_from_files(tag_dir: str, marker: dict) -> RunFacts:
    """`RunFacts` of the run that wrote the tag, read from its files."""
    zero3 = os.path.join(tag_dir, "zero_pp_rank_0_mp_rank_00_model_states.pt")
    model = load_states_file(zero3 if os.path.isfile(zero3) else os.path.join(tag_dir, MODEL_STATES))
    module, buffers = model["module"], set(model.get("buffer_names") or [])
    params = {n: t.shape for n, t in module.items() if n not in buffers}
    if os.path.isfile(zero3):  # partitioned: the saved module tensors are empty, param_shapes has the shapes
        known = {n: shape for sub in model["param_shapes"] for n, shape in sub.items()}
        params = {n: known[n] for n in module if n in known}
    saved_optimizer = model.get("optimizer") or {}
    own = own_files(state_owners(marker))
    if own is not None:
        stage, world = own.layout(tag_dir)
        dtypes = {t.dtype for t in module.values() if torch.is_tensor(t) and t.is_floating_point()}
        dtype = "bf16" if torch.bfloat16 in dtypes else "fp16" if torch.float16 in dtypes else "fp32"
        return RunFacts(params, own.basic_groups(model), dtype, stage, world, None,
                        bool((marker.get("deepspeed_files") or {}).get("fused", False)),
                        weights={n: module[n] for n in params} if dtype == "fp32" else None)
    files = optim_files(tag_dir)
    if not files:
        return RunFacts(params, saved_optimizer.get("param_groups"), "fp32", 0, 1)
    first = load_states_file(files[0])
    base = first["optimizer_state_dict"].get("base_optimizer_state", first["optimizer_state_dict"].get(
        "optimizer_state_dict"))
    return RunFacts(params, base.get("param_groups") if isinstance(base, dict) else None,
                    ds_config_dtype(first.get("ds_config")), int(first["optimizer_state_dict"]["zero_stage"]), len(files),
                    first.get("ds_config"))


def describe(tag_dir: str) -> list[str]:
    """What wrote the tag and what can load it, one line each (``xirang-ds checkpoint show``)."""
    marker = read_marker(tag_dir)
    sections = marker.get("sections", [])
    owners = state_owners(marker)
    own, coded = own_files(owners), state_codes()
    lines = [f"{tag_dir}: written by " + (f"xirang_ds {marker.get('xirang_ds', '?')} (preset "
                                          f"{marker.get('preset') or 'none'}; sections {', '.join(sections) or 'none'})"
                                          if marker else "plain DeepSpeed")]
    holder = (own.holder if own is not None else
              f"DeepSpeed's files, as {coded.codes} over its own param groups"
              if coded is not None and coded.section in owners else
              f"{coded.codes} ({coded.folder}/, what a run with {coded.section} resumes "
              "from), decoded into DeepSpeed's files in plain layout" if coded is not None and codes.in_marker(marker)
              else "DeepSpeed's own files")
    lines.append(f"  optimizer state: {holder}")
    files = optim_files(tag_dir)
    layout = marker.get("deepspeed_files") or {}
    if layout.get("stage") == 0:
        wrapper = ("its torch optimizer" if layout.get("dtype") == "fp32" else
                   "FP16_Optimizer over FusedAdam" if layout.get("fused") else "FP16_UnfusedOptimizer")
        tools = (f"plain DeepSpeed at stage 0 resumes it (the model-states file's optimizer entry, written for "
                 f"{wrapper}); zero_to_fp32.py and ds_to_universal read ZeRO files only")
    elif (not owners or layout) and files:
        tools = f"read it ({len(files)} ZeRO file(s){', written for ZeRO-' + str(layout['stage']) if layout else ''})"
    elif not owners:
        tools = "read it (stage 0: DeepSpeed's model-states file)"
    elif own is not None:
        tools = own.tools
    else:
        tools = "zero_to_fp32.py reads it; plain DeepSpeed's optimizer after `xirang-ds checkpoint export`"
    lines.append(f"  plain DeepSpeed, zero_to_fp32.py, ds_to_universal: {tools}")
    lines.append("  a run with any xirang block: resumes from it (another owner's state is taken over, "
                 "docs/checkpoints.md)")
    return lines


def _torch_groups(optimizer_groups: Optional[list[dict]], states: ParamStates, count: int) -> list[dict]:
    """Each group's ``torch.optim`` param-group dict for the plain files: the basic optimizer's own when
    it is a torch optimizer over the user's groups (torch's Adam/AdamW, SGD, any optimizer not of the Adam
    family), else (`DynamicAdamW`'s groups, marked by ``keep_fp32``; FusedAdam's, ``bias_correction`` without
    ``amsgrad``) AdamW's defaults under the saved hyperparameters."""
    groups = list(optimizer_groups or [])
    own = all("amsgrad" in g or ("bias_correction" not in g and "keep_fp32" not in g) for g in groups)
    if len(groups) == count and own:
        return [{k: v for k, v in g.items() if k != "params"} for g in groups]
    template = {k: v for k, v in torch.optim.AdamW([torch.zeros(1)]).param_groups[0].items() if k != "params"}
    template["bias_correction"] = True  # DeepSpeed's FusedAdam reads it
    return [dict(template, **(states.groups[g] if g < len(states.groups) else {})) for g in range(count)]


__all__ = ["MARKER", "RunFacts", "describe", "export_deepspeed_files", "facts_from_files",
           "facts_of_run",
           "layout_record", "own_files", "owner_sections", "read_marker", "read_states", "resolve_tag", "stage0_optimizer_entry", "state_owners",
           "write_deepspeed_files",
           "write_marker"]
