"""grad_release's part of the estimate (`xirang_ds.roles.Estimates`): the phases as its buckets hold memory.

The table under "One step of a bucket" in docs/grad_release.md, term by term: 16-bit parameters whole,
masters and optimizer states over this rank's shard, the buckets of backward (one reducing, its reduced
shard, the next filling: the buckets `layout.plan_buckets` makes, in launch order), the update of one
bucket shard at a time and the all-gather of its weights at the end of backward (`BACKWARD_END`, a phase
of its own: the activation planner adjusts the rest of backward and leaves that point alone).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import torch

from xirang_ds.compat.torch import GRAD_DTYPE_SETTABLE
from xirang_ds.config.types import format_bytes
from xirang_ds.memory.categories import ACTIVATIONS, GRADIENTS, OPTIMIZER_STATES, PARAMETERS, TEMPORARIES
from xirang_ds.memory.host_ledger import block_bytes, pins
from xirang_ds.memory.model_states import BACKWARD_END, BACKWARD_START, STEP_PREPARE, adam_temporaries
from xirang_ds.plugins.grad_release.embedding_rows import plain
from xirang_ds.plugins.grad_release.layout import plan_buckets
from xirang_ds.plugins.grad_release.optimizers import leaves_foreach_in_config
from xirang_ds.plugins.grad_release.rows import owners as rows_owners
from xirang_ds.plugins.grad_release.states_tier import HOST_NOTE, STASH_NOTE
from xirang_ds.plugins.grad_release.stochastic import CHUNK_NUMEL, NOISE_BYTES


def adjust_estimate(plugin: Any, phases: dict, shape: Any, numels: list) -> Optional[dict]:
    """Model states as the buckets hold them and gradients a bucket at a time (the table under
    "One step of a bucket" in docs/grad_release.md): 16-bit parameters whole, fp32 masters and
    Adam states over this rank's shard (masters as remainders: 2 bytes and a tie bit per element, or 1,
    rebuilt for a bucket's update; ``none``: no master, the weights widened for the update and
    rounded back a chunk at a time; ``states: host``: only the updating bucket's states, at the end of
    backward, and with ``prefetch_states`` on an accelerator the next bucket's beside them, and in a pass that
    updates in backward the largest bucket's through it), one bucket filling and one reducing, this rank's shard
    held until backward ends when exact clipping uses ``hold``, and the update's temporaries in
    backward, one bucket shard at a time. There is no separate optimizer-step phase."""
    if not numels:
        return phases
    total = sum(numels)
    lp = shape.lp_bytes
    # a parameter larger than the size gets a bucket of its own; a model smaller than it is one bucket
    world, comm_bytes, bucket_numel = _sharding(plugin, shape, total)
    part = sum(math.ceil(n / world) for n in numels)
    planned = plan_buckets(list(reversed(numels)), bucket_numel)
    # the gradients handed over by rows (`rows.py`) are never whole: their shard and one round instead
    by_rows = plugin._rows_numels(world, bucket_numel) if world > 1 else []
    whole_numels = list(numels)
    for n in by_rows:
        whole_numels.remove(n)
    largest = max(whole_numels, default=0)
    buffers, each_gather, bucket = _buckets(list(reversed(numels)), planned, world, by_rows)
    gathers = max(each_gather, default=0)
    kind = plugin._masters if shape.dtype == torch.bfloat16 else "fp32"
    masters = {"fp32": 4 * part, "remainders": 2 * part + math.ceil(part / 8), "remainders_8bit": part,
               "none": 0}[kind] if lp != 4 else 0
    states = 8 * part
    if plugin.session.state_quantizer is not None:
        states = phases["forward"].get(OPTIMIZER_STATES, states)  # that plugin's own model (it runs first)
    clipping = plugin.setup.gradient_clipping if plugin.setup is not None else 0.0
    fp16 = plugin.setup is not None and plugin.setup.fp16 is not None
    global_pass = clipping > 0 and plugin.config.clipping == "exact" or fp16 or plugin.retries_oom()
    # by where the optimizer states are (``parked``: host), as ``exact_method: auto`` follows them
    holds_shard = global_pass and plugin.config.exact_method != "two_pass"  # unless stashed on the host
    accum = 4 * part if shape.grad_accum > 1 else 0
    # one bucket reducing (its buffer and its reduced shard) while the next fills (`pipeline.ReleasePipeline`)
    overlap = plugin.config.overlap_comm and len(buffers) > 1
    in_flight = comm_bytes * max(b + b // world + (buffers[i + 1] if overlap and i + 1 < len(buffers) else 0)
                                 for i, b in enumerate(buffers))
    # the largest gradient, made whole before its hook, is copied into its bucket's buffer, unless it is
    # alone there, unpadded and in the communication dtype: then it is the buffer (`Bucket._adopts`)
    largest_whole = 0 if largest >= bucket_numel and largest % world == 0 and comm_bytes == lp else lp * largest

    def rows_held(stash: bool, taken: list[int]) -> int:
        # the rows' shard stays on the device unless each round goes on as it comes (`rows.RowSink`): into
        # the accumulator, or to the host under the stash; then one round more (its reduced part)
        streams = shape.grad_accum > 1 or stash and global_pass
        return max((lp * (world * math.ceil(n / world / 8)
                          + (math.ceil(n / world / 8) if streams else math.ceil(n / world)))
                    for n in taken), default=0)

    # a head the activation plan may chunk (it plans after this) gives its gradient by rows where the plan does:
    # the buckets' holding mid-backward with it so, for the planner to take where its plan chunks the head
    chunkable = planned_heads(plugin, world, bucket_numel) if world > 1 else []  # none fixed to chunk: not in by_rows
    by_rows_chunked = by_rows + chunkable
    buffers_chunked = _buckets(list(reversed(numels)), planned, world, by_rows_chunked)[0] if chunkable else None

    shard = math.ceil(bucket / world)
    # a stashed shard back on the device for its update, and where the stash's copies run ahead
    # (`states_tier.stash_prefetches`) the next bucket's beside it (`pipeline.ReleasePipeline.apply_all`)
    order = list(reversed(numels))
    shards = [sum(math.ceil(order[i] / world) for i in b) for b in planned]
    stash_ahead = plugin.stash_prefetches(shape.device)
    stash_back = max((a + b for a, b in zip(shards, shards[1:])), default=shard) if stash_ahead else shard
    stash_overlapped = stash_ahead and shape.device != "cpu"  # on a side stream: beside the compute stream
    # the update (bucket.py ``apply``): the bucket shard's fp32 gradient, then with remainders its
    # master rebuilt from a 16-bit copy of its weights (freed once joined; ``none``: widened in
    # place), then the optimizer over the parameters' pieces, one at a time for torch's
    # single-tensor Adam; ``none`` then rounds the master into the 16-bit shard, the noise a
    # chunk at a time (`stochastic.NOISE_BYTES` an element), the gradient freed by then

    piece = min(shard, math.ceil(max(numels) / world))
    # torch's Adam left to choose runs each bucket's clone on the multi-tensor path, whatever the device
    # (`optimizers.leaves_foreach_in_config`): one sqrt over the bucket shard's pieces at once
    impl = shape.adam_impl
    if impl == "single_tensor" and plugin.session.state_quantizer is None and \
            leaves_foreach_in_config(plugin.session.ds_config):
        impl = "foreach"
    adam = adam_temporaries(dataclasses.replace(shape, adam_impl=impl), [piece] if impl == "single_tensor" else [shard])
    # the stochastic rounding: the master, the 16-bit shard and a chunk's noise (`stochastic.round_`,
    # `remainders.round8_`)
    # (after the bucket's gradient is freed: `rounding` stands apart from the update's gradient below)
    rounding = 6 * shard + NOISE_BYTES * min(shard, CHUNK_NUMEL) if kind in ("remainders_8bit", "none") else 0
    update = {"fp32": 4 * shard + adam, "remainders": max(10 * shard, 8 * shard + adam),
              "remainders_8bit": max(10 * shard, 8 * shard + adam), "none": 8 * shard + adam}[kind]
    quantizer = plugin.session.state_quantizer
    # a measured embedding's first update (optimizer_states' `first_step.CHUNK_BYTES`): a chunk's moments, their
    # copies and the update direction's error, and the candidate formats' buffers, beside the bucket's gradient
    # and master as an update holds them (``bound``: the states the estimate counts for it meanwhile)
    first, bound, index = quantizer.first_update(world) if quantizer is not None else (0, 0, -1)
    # over the shard of the bucket that holds it (the buckets take the parameters in reverse)
    first_bucket = next((k for k, b in enumerate(planned) if len(numels) - 1 - index in b), None)
    first_shard = shards[first_bucket] if first_bucket is not None else shard
    first_update = (4 if kind == "fp32" else 8) * first_shard + first
    # beside it, the all-gather of the bucket updated before it, still in flight with ``overlap_comm``
    # (`pipeline.ReleasePipeline`: one gather kept in flight), and a stashed shard back for it (and the next one's
    # where the stash's copies run ahead) in place of the largest pair's
    first_gather = each_gather[first_bucket - 1] if first_bucket and plugin.config.overlap_comm else 0
    first_back = (shards[first_bucket] + (shards[first_bucket + 1] if stash_ahead and first_bucket + 1 < len(shards)
                                          else 0)) if first_bucket is not None else stash_back
    if kind == "none" and quantizer is not None and GRAD_DTYPE_SETTABLE:
        # in place (masters.py): DynamicAdamW's chunk in fp32 (parameter, gradient, two moments:
        # 16 bytes an element) and the rounding's noise (`stochastic.NOISE_BYTES`), chunk by chunk with the
        # gradient alive, nothing per shard
        chunk = min(shard, quantizer.config.chunk_numel)
        update, rounding = 16 * chunk + NOISE_BYTES * min(chunk, CHUNK_NUMEL), 0
        first_update = first
    # each bucket's states, of the buckets `plan_buckets` makes
    sizes = [math.ceil(states * n / part) for n in shards]
    fetched = max(sizes)
    # fetched ahead (``prefetch_states``): in a pass that updates in backward the next bucket's states wait on the
    # device from the update before it; on a side stream (an accelerator) a bucket's copy back and the next one's
    # copy in are under way together after its update (`pipeline.ReleasePipeline._fetch_ahead`)
    ahead = plugin.prefetches(shape.device) and len(sizes) > 1
    overlapped = ahead and shape.device != "cpu"
    fetched = max(a + b for a, b in zip(sizes, sizes[1:])) if overlapped else fetched
    # gradients the traced run makes in this backward, above those it carries from earlier micro-steps
    # (DeepSpeed keeps them from forward on under accumulation): a bucket fills only from the former
    carried = phases.get("forward", {}).get(GRADIENTS, 0)

    def made(name: str) -> int:
        return max(0, phases[name].get(GRADIENTS, 0) - carried)

    trace = getattr(plugin.session, "trace", None)
    traced = trace.backward_by_category if trace is not None and trace.backward_sweeps else None
    batch = getattr(trace, "inputs", 0) if trace is not None else 0

    def update_bytes(parked: bool) -> dict:
        """What a bucket's update adds while it runs (as at the end of backward's): its temporaries (the larger of
        the update's and the rounding's), the all-gather it starts, and its states where they come from the host
        (fetched ahead they are the backward phase's already, and on a side stream the next bucket's beside them)."""
        return {TEMPORARIES: max(update, rounding), "comm_buffers": lp * gathers,
                OPTIMIZER_STATES: max(sizes) if parked and (overlapped or not ahead) else 0}

    def _update_at(arrived: list[int], bytes_: dict) -> dict:
        """``bytes_`` where taking the last of ``arrived`` sets off a bucket's update (`pipeline.ReleasePipeline`: a
        bucket launched completes the one before it, which updates, or itself without ``overlap``), else none."""
        def applied(got: list[int]) -> int:
            launched = _launched(got, numels, planned)
            return max(0, launched - 1) if overlap else launched

        return bytes_ if arrived and applied(arrived) > applied(arrived[:-1]) else {}

    def held(parked: bool, stash: bool) -> dict:
        out = {}
        rows = rows_held(stash, by_rows)
        whole = max(largest_whole, rows)
        # what the buckets hold once these gradients have been taken (the trace holds the one being made)
        plugin.estimate_gradients_held = lambda arrived: accum + _held_after(
            arrived, numels, planned, buffers, world, comm_bytes, overlap, rows, holds_shard and not stash)
        rows_chunked = rows_held(stash, by_rows_chunked)
        plugin.estimate_gradients_held_chunked = None if buffers_chunked is None else (
            lambda arrived: accum + _held_after(arrived, numels, planned, buffers_chunked, world, comm_bytes, overlap,
                                                rows_chunked, holds_shard and not stash))
        # backward's worst point with the buckets' holding: where the trace's own bytes and it are the most together,
        # and in a pass that updates in backward, an update as the gradient that sets it off is taken
        spike = update_bytes(parked)
        in_backward = None if holds_shard else (lambda arrived: _update_at(arrived, spike))
        point = trace.most_beside(plugin.estimate_gradients_held, in_backward) if traced is not None else None
        for name, cats in phases.items():
            cats = dict(cats)
            cats[PARAMETERS] = lp * total + masters
            cats[OPTIMIZER_STATES] = (max(sizes) if ahead and not holds_shard and name == "backward" else 0) \
                if parked else states
            cats[GRADIENTS] = accum
            cats["comm_buffers"] = 0
            if name == "backward":
                # mid-backward (the activations still alive): the point of the traced backward where its
                # activations and temporaries and what the buckets hold once the gradients taken by then are
                # taken are the most together (the gradient autograd is making, whole before its hook, is among
                # the trace's temporaries). Without a trace (`estimate_states`): the largest pair of buckets in
                # flight and the largest gradient made whole, no more than the gradients made there
                cats[GRADIENTS] = accum + min(in_flight + whole, made(name))
                if point is not None:
                    _, own, cats[GRADIENTS] = point
                    for c in (ACTIVATIONS, TEMPORARIES):  # the trace's peak's own bytes for that point's
                        cats[c] = cats.get(c, 0) - traced.get(c, 0) + own.get(c, 0)
                    for c in (OPTIMIZER_STATES, "comm_buffers"):  # an update's there (`_update_at`)
                        cats[c] = cats.get(c, 0) + own.get(c, 0)
                # early in backward, before the first bucket is full, the activations are all there
                # with the loss's gradient temporaries; at its end the activations are gone, buckets
                # are in flight and updating, and the held shard (if any) is whole: a phase of its own,
                # as the activation planner, adjusting after, lowers the first and not the second
                # (a held pass updates after backward, `pipeline.ReleasePipeline.apply_all`: no gradient is whole
                # then, the updating bucket's shard is on the device, brought back from the host if stashed)
                # (the batch, which the training loop holds until the step is over, beside each)
                end_grads = (lp * stash_back if stash else lp * part) if holds_shard else whole
                at_update = {**cats, "activations": 0, "comm_buffers": lp * gathers, "temporaries": update + batch,
                             OPTIMIZER_STATES: fetched if parked else states, GRADIENTS: accum + end_grads}
                # then the master rounded into the 16-bit shard, the bucket's gradient freed (a held pass still
                # holds the other buckets' shards, the first bucket's rounding the most of them)
                left = (lp * (part - shard) if holds_shard and not stash else 0) if holds_shard else whole
                at_round = {**at_update, "temporaries": rounding + batch, GRADIENTS: accum + left}
                points = [at_update, at_round]
                if first:  # step 1: a measured tensor's first update, its candidates in place of its states
                    points.append({**at_update, "temporaries": max(update, first_update) + batch,
                                   "comm_buffers": lp * first_gather,
                                   OPTIMIZER_STATES: 0 if parked else max(0, states - bound),
                                   GRADIENTS: accum + (lp * first_back if holds_shard and stash else end_grads)})
                out[BACKWARD_END] = max(points, key=lambda c: sum(v for k, v in c.items() if k != "host"))
            elif name == BACKWARD_START:
                # the first gradient autograd makes (the output head's, where the model has one: the
                # largest parameter) exists whole before its hook copies it into a bucket, unless by
                # rows; no more than the traced run's own gradients made there (none yet: none here)
                cats[GRADIENTS] = accum + min(max(lp * largest, rows), made(name))
            elif name in ("optimizer_step", STEP_PREPARE):
                cats["temporaries"] = 0
                cats["activations"] = 0
            out[name] = cats
        return out

    parked = plugin.config.states == "host"
    # exact_method auto stashes the held shard where the planner decides under a byte budget, as the run does
    # (`states_tier.StatesTier.choose_states_tier`)
    stash = plugin.stashes_held(parked) or plugin.config.exact_method == "auto" and plugin.planner_decides()
    out, plugin.estimate_note = held(parked, stash), None
    budget = plugin.session.config.memory_budget
    planner = plugin.session.plugin("activations")  # what it can take off saved activations is room
    spare = planner.reducible_bytes() if planner is not None and hasattr(planner, "reducible_bytes") else 0

    def need(phases: dict) -> int:
        device = [sum(v for k, v in c.items() if k != "host") for c in phases.values()]
        if not spare:
            return max(device)
        # as the planner reads the phases (`trace_plan.plan_phases`): what the rank needs besides saved
        # activations at its highest (the end of backward's buckets and update included), plus the least
        # saved activations a plan keeps
        saved = [c.get("activations", 0) for c in phases.values()]
        return max(d - a for d, a in zip(device, saved)) + max(0, max(saved) - spare)

    chosen = (getattr(plugin.session, "estimate_replay", None) or {}).get(plugin.section)
    over = budget != "auto" and need(out) > int(budget) and chosen is None
    if over and plugin.config.exact_method == "auto" and holds_shard and not parked:
        out, stash = held(False, True), True  # the held shard goes to the host before the states do (4 bytes, not 16)
        plugin.estimate_note = STASH_NOTE + (f"with this rank's gradient shard held on the device the estimate "
                                           f"exceeds memory_budget {format_bytes(int(budget))}")
        over = need(out) > int(budget)
    why = None
    if chosen is not None:  # the tiers the estimate chose at the bound of what only the data decide, priced again
        stash, why = chosen["stash"], chosen["why"]
        out = held(chosen["states"] == "host", stash)
    elif plugin.config.states == "auto" and over:
        states_need = need(out)
        stash = plugin.stashes_held(True)
        out = held(True, stash)  # the run starts them on the host (`states_tier.StatesTier`)
        why = (f"the estimated model states, gradients and optimizer step with them on the device, "
               f"{format_bytes(states_need)}, exceed memory_budget {format_bytes(int(budget))}")
        plugin.estimate_note = HOST_NOTE + why
    # run_plan settles the tier from it; the predicted step prices the host copies from it (`StatesTier.step_seconds`)
    on_host, stashes = why is not None or parked, bool(holds_shard and stash)
    plugin.estimate_plan = {"states": "host" if on_host else "device", "why": why, "stash": stash,
                            "state_bytes": states, "stashes_shard": stashes, "stash_bytes": comm_bytes,
                            "first_bucket_state_bytes": sizes[0] if overlapped else None,
                            # the stash's copies on a side stream: the first bucket's shard back on the compute stream
                            "first_bucket_stash_numel": shards[0] if stashes and stash_overlapped else None}
    pinned = pins(shape.device != "cpu", getattr(plugin.session, "device_profile", None))
    tensors = _state_tensors(plugin.session.state_quantizer, len(numels))
    buckets = [(n, [t for i in b for t in tensors(len(numels) - 1 - i, math.ceil(order[i] / world))] if on_host
                else []) for n, b in zip(shards, planned)]
    host = host_bytes(buckets, comm_bytes if stashes else 0, pinned)
    plugin.estimate_plan["host_bytes"] = host
    if parked:  # what keeps the states off the host where the config put them there (`estimator.host_over_budget`)
        plugin.estimate_plan["host_fix"] = HOST_FIX
    for cats in out.values():  # held the whole step, in the buffers the run reuses every step
        cats["host"] = cats.get("host", 0) + host
    return out


HOST_FIX = "keep the optimizer states on the device (xirang.grad_release.states \"auto\" or \"device\")"
"""The estimate's and initialize's fix for ``states: host`` over ``host_memory_budget``."""


def host_bytes(buckets: list[tuple[int, list[int]]], stash_bytes_per_element: int, pinned: bool) -> int:
    """The host bytes grad_release's tiers hold as the host ledger counts them (`xirang_ds.memory.host_ledger`),
    one buffer per tensor: each bucket's ``(shard elements, [bytes of each optimizer state tensor on the host]``),
    and exact clipping's stash, one buffer per bucket shard in the reduced gradient's dtype
    (``stash_bytes_per_element``; 0: no stash); each buffer pinned on an accelerator (``pinned``: its block the
    next power of two)."""
    total = 0
    for shard, states in buckets:
        if stash_bytes_per_element:
            total += block_bytes(stash_bytes_per_element * shard, pinned)
        total += sum(block_bytes(n, pinned) for n in states)
    return total


def _state_tensors(quantizer: Any, count: int) -> Any:
    """``(parameter index, piece elements) -> [bytes of each state tensor]`` of a bucket's optimizer over a piece:
    torch's Adam keeps two fp32 moments; optimizer_states (``quantizer``) its format's tensors (codes and scales per
    moment), fp32 for the parameters it keeps."""
    layout = quantizer.estimate_layout() if quantizer is not None else None
    params, kept, fmt = layout if layout is not None and len(layout[0]) == count else ((), (), None)

    def tensors(i: int, n: int) -> list[int]:
        if fmt is None or id(params[i]) in kept:
            return [4 * n, 4 * n]
        return [t.numel() * t.element_size() for m in ("exp_avg", "exp_avg_sq")
                for t in fmt.zeros(m, n, torch.device("meta")).values()]

    return tensors


def _held_after(arrived: list[int], numels: list[int], planned: list[list[int]], buffers: list[int], world: int,
                comm_bytes: int, overlap: bool, rows: int, holds: bool) -> int:
    """The gradient bytes the buckets hold mid-backward once the gradients ``arrived`` (indices into ``numels``,
    registration order) have been taken (`pipeline.ReleasePipeline`): every bucket that has some of its
    gradients and is not launched, its buffer (a bucket by rows: its rows' share, ``rows``); the buckets launched
    in order as each completes, the last one still reducing (its buffer and its reduced shard) while
    ``overlap`` (not one by rows, whose rounds were reduced as they came); with ``holds`` the reduced shards of those
    completed before it. A gradient autograd is making
    (whole, before its hook) is not in it: the trace holds that one."""
    last = len(numels) - 1
    got = {last - i for i in arrived}  # positions in launch order (reverse registration)
    launched = _launched(arrived, numels, planned)
    total = 0
    for b, indices in enumerate(planned):
        shard = sum(math.ceil(numels[last - i] / world) for i in indices)
        buffer = comm_bytes * buffers[b] if buffers[b] else rows
        reduced = comm_bytes * shard if world > 1 else 0  # unsharded, the buffer is reduced in place
        if b >= launched:
            total += buffer if any(i in got for i in indices) else 0
        elif b == launched - 1 and overlap and buffers[b]:  # by rows, each round was reduced as it came
            total += buffer + reduced
        elif holds:
            total += comm_bytes * shard
    return total


def _launched(arrived: list[int], numels: list[int], planned: list[list[int]]) -> int:
    """How many buckets are launched once the gradients ``arrived`` (indices into ``numels``) are taken: in
    launch order, each once all its gradients are there."""
    last = len(numels) - 1
    got = {last - i for i in arrived}
    launched = 0
    while launched < len(planned) and all(i in got for i in planned[launched]):
        launched += 1
    return launched


def _buckets(order: list[int], planned: list[list[int]], world: int,
             by_rows: list[int]) -> tuple[list[int], list[int], int]:
    """The planned buckets' gradient buffers in launch order (elements, padding included; none for a gradient
    that comes by rows, `rows.RowSink`), the elements each bucket's all-gather holds at the end of backward
    (`Bucket.gather`: its shard, and the whole buffer unless one unpadded parameter is gathered in place), and the
    largest bucket's elements (padding included)."""
    rows_left, buffers, gathers, largest = list(by_rows), [], [], 0
    for indices in planned:
        numels = [order[i] for i in indices]
        shard = sum(math.ceil(n / world) for n in numels)
        direct = len(numels) == 1 and numels[0] % world == 0
        gathers.append(shard + (0 if direct or world == 1 else world * shard))
        largest = max(largest, world * shard)
        if len(numels) == 1 and numels[0] in rows_left:
            rows_left.remove(numels[0])
            buffers.append(0)
        else:
            buffers.append(world * shard)
    return buffers, gathers, largest


def rows_numels(plugin: Any, world: int, bucket_numel: int) -> list[int]:
    """Element counts of the estimate's parameters whose gradient comes by rows (`rows.fits`): an
    input ``nn.Embedding``'s weight and a head the block fixes to ``chunk``, larger than a bucket,
    untied, their rows split evenly over ``world`` ranks."""
    model = plugin.session.model
    if model is None:
        return []
    weights = [m.weight for m in model.modules() if type(m) is torch.nn.Embedding and plain(m)]
    activations = plugin.session.plugin("activations")
    weights += [model.get_submodule(n).weight for n in getattr(activations, "traced_heads", ())]
    return _taken_by_rows(model, weights, world, bucket_numel)


def planned_heads(plugin: Any, world: int, bucket_numel: int) -> list[int]:
    """Element counts of the output heads the activation planner may chunk (not fixed to ``chunk``) whose gradient
    would then come by rows (`_by_rows`)."""
    model, activations = plugin.session.model, plugin.session.plugin("activations")
    if model is None or activations is None:
        return []
    fixed = set(getattr(activations, "traced_heads", ()))
    heads = [n for n in getattr(activations, "head_names", ()) if n not in fixed]
    return _taken_by_rows(model, [getattr(model.get_submodule(n), "weight", None) for n in heads], world, bucket_numel)


def _taken_by_rows(model: torch.nn.Module, weights: list, world: int, bucket_numel: int) -> list[int]:
    """Element counts of the distinct ``weights`` whose gradient can come by rows (`_by_rows`)."""
    owners = rows_owners(model)
    return [w.numel() for w in {id(w): w for w in weights if w is not None}.values()
            if _by_rows(w, world, bucket_numel, owners)]


def _by_rows(weight: torch.Tensor, world: int, bucket_numel: int, owners: dict) -> bool:
    """Whether ``weight``'s gradient can come by rows (`rows.fits`): 2-D and trainable, alone in its bucket, its rows
    split evenly over ``world`` ranks, and one module's (untied)."""
    return (weight.requires_grad and weight.ndim == 2 and weight.numel() >= bucket_numel
            and weight.shape[0] % world == 0 and owners.get(id(weight)) == 1)


def _sharding(plugin: Any, shape: Any, total: int) -> tuple[int, int, int]:
    """``(ranks the states are sharded over, bytes of a communicated element, bucket elements)`` for ``total``
    trainable elements: 1 rank at ZeRO 0 or on one rank."""
    world = shape.world_size if shape.stage >= 1 and shape.world_size > 1 else 1
    comm_bytes = plugin.setup.comm_dtype.itemsize if plugin.setup is not None else shape.lp_bytes
    return world, comm_bytes, plugin._bucket_numel(total, comm_bytes, shape.world_size)


def rows_round(plugin: Any, weight: torch.Tensor, shape: Any) -> Optional[tuple[int, int]]:
    """``(ranks, bytes of a communicated element)`` where a chunked head's ``weight`` would give its gradient by
    rows (`rows.RowSink`: ZeRO 1/2 over several ranks, `_by_rows`), else ``None``: the activation planner prices
    that backward (`head_rows.round_bytes`) whether the block fixes the head to chunk or the plan chooses it."""
    model = plugin.session.model
    if model is None:
        return None
    world, comm_bytes, bucket_numel = _sharding(plugin, shape, sum(p.numel() for p in model.parameters()
                                                                   if p.requires_grad))
    taken = world > 1 and _by_rows(weight, world, bucket_numel, rows_owners(model))
    return (world, comm_bytes) if taken else None


__all__ = ["adjust_estimate", "rows_numels", "rows_round"]
