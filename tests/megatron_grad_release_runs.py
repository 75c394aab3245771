"""Ranks for tests/test_megatron_grad_release.py: megatron-core runs of ``examples/megatron_gpt.py`` with
and without xirang.grad_release, in one process per rank (module-level functions for
``xirang_ds.launch.run_ranks``)."""
from __future__ import annotations

import copy
import hashlib
import os
from typing import Any, Callable, Optional

import torch

from tests.harness.megatron_runs import example, write_block

CLIP = 0.05
"""A limit below the example's gradient norms (about 0.4 to 1.6 in its first steps), so every step clips."""


def digest(model: Any) -> str:
    """Hash of every parameter's bytes on this rank."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def loop(ex: Any, argv: list[str], steps: int, before_step: Callable[[Any, Any], None] = None,
         skip: int = 0, results: Optional[list] = None) -> tuple[Any, Any, Any, Callable[[], float]]:
    """Build the example's model, optimizer and session, and a step function over its data (the
    first ``skip`` steps' micro-batches dropped); ``before_step(model, optimizer)`` runs before each
    ``optimizer.step()``, and ``results`` collects what each returns."""
    opts = ex.parse_args(argv)
    model, optimizer, session, make_data = ex.build_loop(opts)
    data = make_data()
    for _ in range(skip * opts.num_microbatches):
        next(data)
    if before_step is not None or results is not None:
        inner = optimizer.step

        def step(*args: Any, **kwargs: Any) -> Any:
            if before_step is not None:
                before_step(model, optimizer)
            result = inner(*args, **kwargs)
            if results is not None:
                results.append(result)
            return result

        optimizer.step = step
    return model, optimizer, session, ex.step_function(opts, model, optimizer, data)


def megatron_clip(max_norm: float, norms: list) -> Callable[[Any, Any], None]:
    """Megatron's clipping rule on ``param.main_grad`` before its step (what ``clip_grad_norm`` does on
    GPU; its implementation asserts CUDA tensors): the L2 norm over the TP group counting replicated
    parameters once (``param_is_not_tensor_parallel_duplicate``), ``coeff = max_norm / (norm + 1e-6)``."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    def clip(model: Any, optimizer: Any) -> None:
        grads = [p.main_grad for p in model.parameters()]
        counted = [p.main_grad for p in model.parameters() if param_is_not_tensor_parallel_duplicate(p)]
        total = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32).double() ** 2 for g in counted]).sum()
        torch.distributed.all_reduce(total, group=parallel_state.get_model_parallel_group())
        norm = float(total.sqrt())
        norms.append(norm)
        coeff = max_norm / (norm + 1e-6)
        if coeff < 1.0:
            for g in grads:
                g.mul_(coeff)

    return clip


def tp2_grad_release(rank: int, world: int, tmp: str, steps: int) -> dict:
    """TP=2 on 2 ranks: plain Megatron against grad_release (accumulation, one micro-batch with small
    buckets, exact and previous-step clipping), the optimizer state dict round trip, removal, and the
    settings refused."""
    from xirang_ds.integration.megatron_compat import buffer_tensors

    ex = example()
    created = ex.setup(rank, world, 2)
    try:
        gr = write_block(os.path.join(tmp, f"gr{rank}.json"), {"grad_release": {"enabled": True}})
        small = write_block(os.path.join(tmp, f"small{rank}.json"),
                            {"grad_release": {"enabled": True, "bucket_size_numel": 8192}})
        previous = write_block(os.path.join(tmp, f"prev{rank}.json"),
                               {"grad_release": {"enabled": True, "clipping": "previous_step"}})
        common = ["--steps", str(steps), "--overlap-grad-reduce"]
        one = common + ["--num-microbatches", "1"]

        def trained(argv: list[str]) -> dict:
            out = {}

            def inspect(model: Any, optimizer: Any, session: Any) -> dict:
                grads, _ = buffer_tensors([model])
                out["buffer_bytes"] = sum(g.untyped_storage().nbytes() for g in grads)
                return {"digest": digest(model)}

            result = ex.train(ex.parse_args(argv), inspect)
            return {**result, **out}

        res: dict[str, Any] = {
            "plain": trained(common), "gr": trained(common + ["--xirang-config", gr]),
            "plain_one": trained(one), "gr_one": trained(one + ["--xirang-config", small]),
        }

        # clipping: Megatron's rule applied by hand to plain Megatron, against grad_release's
        clip = ["--clip-grad", str(CLIP)]
        norms: list[float] = []
        model, optimizer, _, run_step = loop(ex, common + ["--clip-grad", "0"], steps, megatron_clip(CLIP, norms))
        res["clip_reference"] = {"losses": [run_step() for _ in range(steps)], "norms": norms}
        for name, config in (("clip_exact", gr), ("clip_previous", previous)):
            results: list = []
            model, optimizer, session, run_step = loop(ex, common + clip + ["--xirang-config", config], steps,
                                                       results=results)
            losses = [run_step() for _ in range(steps)]
            res[name] = {"losses": losses, "norms": [r[1] for r in results], "success": [r[0] for r in results]}
            session.remove()

        res["resume"] = resume(ex, common, gr, steps)
        int8 = {"optimizer_states": {"enabled": True, "schedule": [{"dtype": "int8"}]}}
        states = write_block(os.path.join(tmp, f"states{rank}.json"), int8)
        both = write_block(os.path.join(tmp, f"both{rank}.json"), {**int8, "grad_release": {"enabled": True}})
        res["states_alone"] = trained(common + ["--xirang-config", states])
        res["states_with_gr"] = trained(common + ["--xirang-config", both])
        res["resume_states"] = resume(ex, common, both, steps, plain=False)
        res["removal"] = removal(ex, common, gr, steps)
        res["miscount"] = miscount(ex, common, gr)
        skip = write_block(os.path.join(tmp, f"skip{rank}.json"),
                           {"grad_release": {"enabled": True, "nonfinite": "skip_step"}})
        res["nonfinite_skip"] = nonfinite(ex, common, skip)
        res["nonfinite_raise"] = nonfinite(ex, common, gr)
        return res
    finally:
        ex.teardown(created)


def resume(ex: Any, common: list[str], config: str, steps: int, plain: bool = True) -> dict:
    """Megatron's ``optimizer.state_dict()`` after ``steps`` steps, then ``steps`` more: the same from
    a fresh run loading it (with grad_release, and plain Megatron loading the same dict)."""
    with_gr = common + ["--xirang-config", config]
    model, optimizer, session, run_step = loop(ex, with_gr, steps)
    for _ in range(steps):
        run_step()
    saved_model = copy.deepcopy(model.module.state_dict())
    saved = copy.deepcopy(optimizer.state_dict())  # torch returns the live state tensors
    keys = sorted(saved["state"][0]) if saved.get("state") else []
    saved_bytes = sum(t.numel() * t.element_size() for st in saved.get("state", {}).values()
                      for t in st.values() if isinstance(t, torch.Tensor))
    continued = [run_step() for _ in range(steps)]
    session.remove()
    out = {"continued": continued, "state_keys": keys, "states": len(saved.get("state", {})), "bytes": saved_bytes}
    for name, argv in (("resumed", with_gr), ("resumed_plain", common))[:2 if plain else 1]:
        model, optimizer, session, run_step = loop(ex, argv, steps, skip=steps)
        model.module.load_state_dict(saved_model)
        optimizer.load_state_dict(copy.deepcopy(saved))  # loading may keep references too
        out[name] = [run_step() for _ in range(steps)]
        if session is not None:
            session.remove()
    return out


def removal(ex: Any, common: list[str], config: str, steps: int) -> dict:
    """``steps`` steps with grad_release, ``session.remove()``, ``steps`` plain ones: the losses of plain
    Megatron over both; DDP's buffer and hooks are back."""
    from xirang_ds.integration.megatron_compat import buffer_tensors

    model, optimizer, session, run_step = loop(ex, common + ["--xirang-config", config], steps)
    losses = [run_step() for _ in range(steps)]
    grads, _ = buffer_tensors([model])
    during = {"buffer_bytes": sum(g.untyped_storage().nbytes() for g in grads),
              "ddp_hooked_params": len(model.param_to_bucket_group)}
    session.remove()
    losses += [run_step() for _ in range(steps)]
    after = {"buffer_bytes": sum(g.untyped_storage().nbytes() for g in grads),
             "ddp_hooked_params": len(model.param_to_bucket_group),
             "grad_hooks": sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters()),
             "wrapped": sorted(vars(model).keys() & {"zero_grad_buffer", "finish_grad_sync", "start_grad_sync"})}
    model, optimizer, _, run_step = loop(ex, common, steps)
    return {"losses": losses, "plain": [run_step() for _ in range(2 * steps)], "during": during, "after": after}


def nonfinite(ex: Any, common: list[str], config: str) -> dict:
    """One step, then the final layernorm's weight set to nan (on both TP ranks: it is replicated) and
    one more step: Megatron's step result, and whether any other parameter changed."""
    results: list = []
    model, optimizer, session, run_step = loop(ex, common + ["--xirang-config", config], 2, results=results)
    run_step()
    results.clear()
    poisoned = dict(model.named_parameters())["module.decoder.final_layernorm.weight"]
    with torch.no_grad():
        poisoned.fill_(float("nan"))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p is not poisoned}
    out: dict[str, Any] = {}
    try:
        run_step()
    except RuntimeError as e:
        out["error"] = str(e)
    out["result"] = [str(x) for x in results[0]] if results else None
    out["changed"] = sorted(n for n, p in model.named_parameters()
                            if p is not poisoned and not torch.equal(p.detach(), before[n]))
    out["global_steps"] = session.engine.global_steps
    session.remove()
    return out


def miscount(ex: Any, common: list[str], config: str) -> str:
    """attach told 3 micro-batches while the schedule runs 2: ``optimizer.step()`` says so."""
    from xirang_ds.integration import megatron as xm

    opts = ex.parse_args(common + ["--xirang-config", config])
    real = xm.attach

    def attach(*args: Any, **kwargs: Any) -> Any:
        return real(*args, **{**kwargs, "num_microbatches": 3})

    xm.attach = attach
    try:
        model, optimizer, session, make_data = ex.build_loop(opts)
    finally:
        xm.attach = real
    run_step = ex.step_function(opts, model, optimizer, make_data())
    try:
        run_step()
        return ""
    except RuntimeError as e:
        return str(e)
    finally:
        session.remove()


def refusals(rank: int, world: int, tmp: str) -> dict:
    """One rank, TP=1: each Megatron setting grad_release refuses at attach, with its message."""
    import dataclasses

    from xirang_ds.config.validate import XirangConfigError
    from xirang_ds.integration import megatron as xm

    ex = example()
    created = ex.setup(rank, world, 1)
    block = {"xirang": {"grad_release": {"enabled": True}}}
    out = {}
    try:
        def attempt(name: str, change: Callable[[Any], None], **attach_kwargs: Any) -> None:
            model, optimizer, _ = ex.build(ex.parse_args([]), 1)
            change(model)
            session = xm.build_session(block)
            try:
                xm.attach(session, model, optimizer, **{"num_microbatches": 2, **attach_kwargs})
                out[name] = ""
            except XirangConfigError as e:
                out[name] = str(e)
            finally:
                session.remove()

        def ddp(**fields: Any) -> Callable[[Any], None]:
            return lambda model: setattr(model, "ddp_config", dataclasses.replace(model.ddp_config, **fields))

        def transformer(**fields: Any) -> Callable[[Any], None]:
            return lambda model: [setattr(model.module.config, k, v) for k, v in fields.items()]

        attempt("distributed_optimizer", ddp(use_distributed_optimizer=True))
        attempt("sequence_parallel", transformer(sequence_parallel=True))
        attempt("gradient_accumulation_fusion", transformer(gradient_accumulation_fusion=True))
        attempt("per_token_loss", transformer(calculate_per_token_loss=True))
        attempt("unknown_microbatches", lambda model: None, num_microbatches=None)
        attempt("accepted", lambda model: None)

        # settings that only matter at TP > 1, checked on this rank's real objects as if TP were 2
        from xirang_ds.integration.megatron_run import MegatronRun
        from xirang_ds.plugins.grad_release.megatron import problems

        section = xm.build_session(block).config.grad_release
        model, optimizer, _ = ex.build(ex.parse_args([]), 1)
        run = MegatronRun([model], optimizer, num_microbatches=2)
        run.tp_world_size = 2
        model.module.config.qk_layernorm = True
        out["qk_layernorm"] = " | ".join(m for _, m in problems(section, run, [0.0]))
        model.module.config.qk_layernorm = False
        next(model.module.parameters()).average_gradients_across_tp_domain = True
        out["tp_averaged"] = " | ".join(m for _, m in problems(section, run, [0.0]))
        run.remove()
        try:
            xm.build_session({"xirang": {"grad_release": {"enabled": True, "exact_method": "two_pass"}}})
            out["two_pass"] = ""
        except XirangConfigError as e:
            out["two_pass"] = str(e)
        return out
    finally:
        ex.teardown(created)


def dp2_grad_release(rank: int, world: int, tmp: str, steps: int) -> dict:
    """TP=1 × DP=2: plain Megatron against grad_release (accumulation), and exact clipping against
    Megatron's rule applied by hand."""
    ex = example()
    created = ex.setup(rank, world, 1)
    try:
        gr = write_block(os.path.join(tmp, f"gr{rank}.json"), {"grad_release": {"enabled": True,
                                                                                "bucket_size_numel": 8192}})
        common = ["--steps", str(steps), "--micro-batch-size", "2", "--overlap-grad-reduce"]
        res = {}
        for name, argv in (("plain", common), ("gr", common + ["--xirang-config", gr])):
            model, optimizer, session, run_step = loop(ex, argv, steps)
            res[name] = {"losses": [run_step() for _ in range(steps)], "digest": digest(model)}
            if session is not None:
                session.remove()
        norms: list[float] = []
        model, optimizer, _, run_step = loop(ex, common, steps, megatron_clip(CLIP, norms))
        res["clip_reference"] = {"losses": [run_step() for _ in range(steps)], "norms": norms}
        model, optimizer, session, run_step = loop(ex, common + ["--clip-grad", str(CLIP), "--xirang-config", gr],
                                                   steps)
        res["clip_exact"] = {"losses": [run_step() for _ in range(steps)]}
        session.remove()
        return res
    finally:
        ex.teardown(created)
