"""Which modules the plugin acts on: candidates for the planner, fixed plans written by hand, and
ds_config's ``activation_checkpointing`` section mapped onto the same options.

Selectors are globs matched against full module names with ``fnmatchcase`` (``"blocks.2"`` does not
match ``"blocks.20"``); a glob that matches no module is an error, as is one module fixed to two
options, a lossy option on a module not marked tolerant, or a fixed option inside a module that is
recomputed (the checkpoint already decides everything inside it). In a fixed plan a glob selects
subtrees: ``"recompute": ["blocks.*"]`` fixes each block, and what is inside a block follows it.
"""
from __future__ import annotations

import logging
from typing import Callable, Iterable, Optional, Union

import torch.nn as nn

from xirang_ds.config.schema import glob_matches
from xirang_ds.plugins.activations.config import ACTIVATION_OPTIONS, LOSSY_ACTIVATION_OPTIONS, ActivationsConfig

logger = logging.getLogger("xirang_ds")

Problems = list[tuple[str, str]]
RECOMPUTE_OPTIONS = ("recompute", "selective_recompute", "recompute_offload", "recompute_tiled",
                     "recompute_tiled_offload")
DS_SECTION = "activation_checkpointing"
PATH = "xirang.activations"


def module_names(model: nn.Module) -> list[str]:
    """Full names of every submodule (the root, named ``""``, excluded)."""
    return [name for name, _ in model.named_modules() if name]


def repeated_blocks(model: nn.Module) -> list[str]:
    """The model's blocks, found by structure, in this order of preference:

    1. the children of every ``nn.ModuleList`` not inside another such child (a decoder's layers,
       ``nn.TransformerEncoder.layers``, wherever they sit);
    2. else the children of every ``nn.Sequential`` likewise (a Sequential CNN, the stages and
       residual blocks of a ResNet-like model, a model that is itself a Sequential);
    3. else the children of the outermost module with more than one child, passing through
       wrappers with one (``torch.compile``'s ``_orig_mod``, a model that holds its network in one
       attribute).
    """
    for container in (nn.ModuleList, nn.Sequential):
        blocks = _container_children(model, container)
        if blocks:
            return blocks
    name, module = "", model
    children = list(module.named_children())
    while len(children) == 1:
        child, module = children[0]
        name = f"{name}.{child}" if name else child
        children = list(module.named_children())
    return [f"{name}.{child}" if name else child for child, _ in children]


def _container_children(model: nn.Module, container: type) -> list[str]:
    blocks: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, container):
            if not any(name == b or _inside(name, b) for b in blocks):
                blocks.extend(f"{name}.{child}" if name else child for child, _ in module.named_children())
    return blocks


def _inside(name: str, ancestor: str) -> bool:
    return name.startswith(ancestor + ".")


def _examples(names: list[str]) -> str:
    shown = names[:6]
    return ", ".join(shown) + (", ..." if len(names) > len(shown) else "")


NO_MATCH = "matches no module of the model"
"""What `match` says of a glob that matches nothing."""


def match(globs: Iterable[str], names: list[str], key: str, problems: Problems) -> list[str]:
    """Names matched by ``globs`` (in model order); a glob matching nothing is a problem at ``key[i]``."""
    found: list[str] = []
    for i, glob in enumerate(globs):
        hits = [n for n in names if glob_matches(glob, n)]
        if not hits:
            problems.append((f"{key}[{i}]", f"{glob!r} {NO_MATCH}; module names look like "
                                            f"{_examples(names)} (globs match whole names with fnmatchcase)"))
        found.extend(h for h in hits if h not in found)
    return found


def glob_keys(config: ActivationsConfig) -> list[str]:
    """The key of every glob of the section that `match` checks, as its problems name them."""
    lists = [("candidates", () if config.candidates == "auto" else config.candidates)]
    lists += [(option, getattr(config, option)) for option in ACTIVATION_OPTIONS]
    lists.append(("tolerant", [g for g in config.tolerant if g != FEED_FORWARD]))
    return [f"{PATH}.{name}[{i}]" for name, globs in lists for i in range(len(globs))]


def outermost(names: list[str]) -> list[str]:
    """Names not inside another of them (``"blocks.*"`` fixes each block, which covers its insides)."""
    return [n for n in names if not any(_inside(n, other) for other in names)]


def find_candidates(model: nn.Module, config: ActivationsConfig, problems: Problems,
                    blocks: Optional[list[str]] = None,
                    heads: Optional[Callable[[list[str]], list[str]]] = None) -> list[str]:
    """Modules the planner chooses for: ``auto`` = the repeated blocks (``blocks``, default
    `repeated_blocks`) and their children, and the output heads ``heads(blocks)`` names
    (`head_loss.head_modules`, Megatron's output layers)."""
    names = module_names(model)
    if config.candidates != "auto":
        return match(config.candidates, names, f"{PATH}.candidates", problems)
    blocks = repeated_blocks(model) if blocks is None else blocks
    out = []
    for block in blocks:
        out.append(block)
        out.extend(n for n in names if _inside(n, block) and "." not in n[len(block) + 1:])
    if heads is not None and blocks:
        out.extend(h for h in heads(blocks) if h not in out)
    if not blocks and config.planner:
        problems.append((f"{PATH}.candidates", "\"auto\" plans for the model's blocks (children of its "
                                               "nn.ModuleList or nn.Sequential containers, else of its outermost "
                                               "module with several children) and this model has no submodule; "
                                               "set planner to false to apply only the fixed lists"))
    return out


def fixed_plan(model: nn.Module, config: ActivationsConfig, ds_config: dict, problems: Problems
               ) -> tuple[dict[str, str], dict]:
    """Options fixed by hand: the block's lists, then ds_config's ``activation_checkpointing``.

    Returns:
        ``({module name: option}, deepspeed settings)``; the settings hold the section's
        ``synchronize_checkpoint_boundary`` and ``profile`` (empty when the section is not applied).
    """
    names = module_names(model)
    plan: dict[str, str] = {}
    source: dict[str, str] = {}
    for option in ACTIVATION_OPTIONS:
        key = f"{PATH}.{option}"
        for name in outermost(match(getattr(config, option), names, key, problems)):
            if name in plan and plan[name] != option:
                problems.append((key, f"{name!r} is also fixed by {source[name]}; a module takes one option, "
                                      "remove it from one of the lists"))
                continue
            plan[name], source[name] = option, key
    globs = [g for g in config.tolerant if g != FEED_FORWARD]
    matched = match(globs, names, f"{PATH}.tolerant", problems) + feed_forward_modules(model, config.tolerant)
    tolerant = {n for n in names if any(n == t or _inside(n, t) for t in matched)}
    match([g for g in config.token_wise if g != FEED_FORWARD], names, f"{PATH}.token_wise", problems)
    token_wise = token_wise_names(model, config)
    for name, option in plan.items():
        if option in LOSSY_ACTIVATION_OPTIONS and name not in tolerant:
            problems.append((source[name], f"{option} is lossy and {name!r} is not marked tolerant; add a glob "
                                           f"matching it to {PATH}.tolerant, or use compress (lossless)"))
        if option.startswith("recompute_tiled") and name not in token_wise:
            problems.append((source[name], f"{name!r} is not marked token-wise, and {option} runs it a slice "
                                           f"of tokens at a time; add a glob matching it to {PATH}.token_wise if "
                                           "each token's output depends on that token alone, or use recompute"))
    settings: dict = {}
    if config.honour_deepspeed_checkpointing and isinstance(ds_config.get(DS_SECTION), dict):
        settings = _apply_deepspeed_section(model, ds_config[DS_SECTION], plan, source, problems)
    for name, option in plan.items():
        for other, other_option in plan.items():
            if other_option in RECOMPUTE_OPTIONS and _inside(name, other):
                problems.append((source[name], f"{name!r} ({option}) is inside {other!r}, which {source[other]} "
                                               "recomputes; the checkpoint decides everything inside it, so "
                                               "remove one of the two"))
    return plan, settings


def _apply_deepspeed_section(model: nn.Module, section: dict, plan: dict[str, str], source: dict[str, str],
                             problems: Problems) -> dict:
    """Map DeepSpeed's keys (deepspeed/runtime/activation_checkpointing/config.py) onto options.

    * the section's presence: full recompute of the model's blocks (`repeated_blocks`);
    * ``cpu_checkpointing``: their kept inputs go to host memory (``recompute_offload``);
    * ``number_checkpoints``: only the first N blocks are recomputed;
    * ``synchronize_checkpoint_boundary``: synchronize the accelerator around each recomputation;
    * ``profile``: time each recomputation (logged per step on rank 0);
    * ``partition_activations`` and ``contiguous_memory_optimization`` split checkpointed inputs
      across tensor-parallel ranks and pack them into one buffer; neither changes bytes on one
      rank without model parallelism: they are reported, not applied.

    Modules the block's own lists fix keep their option.
    """
    key = DS_SECTION
    known = {"partition_activations", "contiguous_memory_optimization", "cpu_checkpointing", "number_checkpoints",
             "synchronize_checkpoint_boundary", "profile"}
    for k in section:
        if k not in known:
            problems.append((key, f"unknown key {k!r} in ds_config's {key} (DeepSpeed knows "
                                  f"{', '.join(sorted(known))}); remove it"))
    blocks = repeated_blocks(model)
    if not blocks:
        problems.append((key, "ds_config has an activation_checkpointing section, but the model has no "
                              "submodule to recompute; list modules in xirang.activations.recompute "
                              "or set xirang.activations.honour_deepspeed_checkpointing to false"))
        return {}
    count: Union[int, None] = section.get("number_checkpoints")
    if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 0):
        problems.append((f"{key}.number_checkpoints", f"must be a non-negative integer or null; got {count!r}"))
        return {}
    option = "recompute_offload" if section.get("cpu_checkpointing") else "recompute"
    for name in blocks[:count] if count is not None else blocks:
        if name not in plan and not any(_inside(name, other) or _inside(other, name) for other in plan):
            plan[name], source[name] = option, f"ds_config {key}"
    for flag in ("partition_activations", "contiguous_memory_optimization"):
        if section.get(flag):
            logger.warning("xirang activations: ds_config %s.%s=true is not applied: it splits checkpointed "
                           "inputs across tensor-parallel ranks / packs them into one buffer, which changes no "
                           "byte count on one rank without model parallelism", key, flag)
    return {"synchronize": bool(section.get("synchronize_checkpoint_boundary")),
            "profile": bool(section.get("profile"))}


def tolerant_names(model: nn.Module, config: ActivationsConfig) -> frozenset:
    """Modules whose saved tensors may be stored lossily: those matched by ``tolerant`` and every
    module inside them (the globs were checked by `fixed_plan`)."""
    names = module_names(model)
    matched = [n for n in names if any(glob_matches(g, n) for g in config.tolerant if g != FEED_FORWARD)]
    matched += feed_forward_modules(model, config.tolerant)
    return frozenset(n for n in names if any(n == t or _inside(n, t) for t in matched))


def token_wise_names(model: nn.Module, config: ActivationsConfig) -> frozenset:
    """Modules ``recompute_tiled`` may slice: those matched by ``token_wise`` (not what is inside them)."""
    names = module_names(model)
    globs = [g for g in config.token_wise if g != FEED_FORWARD]
    return frozenset([n for n in names if any(glob_matches(g, n) for g in globs)]
                     + feed_forward_modules(model, config.token_wise))


FEED_FORWARD = "feed_forward"
"""The ``tolerant`` entry that stands for every repeated block's feed-forward child (a child whose
name contains ``mlp``, ``ffn`` or ``feed_forward``): the GELU/SiLU outputs and the matmul inputs
inside it are what 8-bit activation storage is known to tolerate (ActNN, GACT). It matches nothing
without error on a model that has no such child."""


def feed_forward_modules(model: nn.Module, globs: tuple[str, ...]) -> list[str]:
    """The repeated blocks' feed-forward children, where ``globs`` holds `FEED_FORWARD`."""
    if FEED_FORWARD not in globs:
        return []
    blocks = repeated_blocks(model)
    out = []
    for name, module in model.named_modules():
        parent, _, child = name.rpartition(".")
        if parent in blocks and any(k in child.lower() for k in ("mlp", "ffn", "feed_forward")):
            out.append(name)
    return out
