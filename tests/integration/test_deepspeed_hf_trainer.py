"""HF Trainer with TrainingArguments(deepspeed=...) and patch_deepspeed() honours the block."""
import pytest

from xirang_ds.launch import run_ranks


def _hf_run(out_dir, block, hog_bytes=0):
    """``hog_bytes``: the second forward of the first block allocates this much (once)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    ds = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 1e6},
        "xirang": block,
    }
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64))
    calls = []
    if hog_bytes:
        def hog(module, args, output):
            calls.append(1)
            if len(calls) == 2:
                torch.empty(hog_bytes, dtype=torch.uint8)

        model.transformer.h[0].register_forward_hook(hog)
    ids = torch.randint(0, 256, (32, 32))
    data = [{"input_ids": x, "labels": x} for x in ids]
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=4, max_steps=4, use_cpu=True,
                             bf16=True, deepspeed=ds, report_to=[], logging_steps=1, save_strategy="no",
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    result = trainer.train()
    engine = trainer.model_wrapped
    session = getattr(engine, "xirang", None)
    out = {
        "plugins": [p.section for p in session.plugins] if session else None,
        "preset": session.config.preset if session else None,
        "choice": session.preset_choice if session else None,
        "steps": result.global_step,
        "loss": result.training_loss,
        "checks": len(session.plugin("monitor").history) if session else 0,
        "peak": max(h["peak_bytes"] for h in session.plugin("monitor").history) if session else 0,
        "retries": [(r["step"], r["where"], r["pieces"]) for r in session.plugin("monitor").guard.retries]
        if session and session.plugin("monitor").guard else [],
        "plan": dict(session.plugin("activations").plan) if session and session.plugin("activations") else None,
        "calibration": session.calibration.as_dict() if session else None,
        # the estimator on the session's copy of the HF model, called with the Trainer's keywords
        "estimator_error": session.calibration.estimator_error() if session else None,
    }
    if session is not None:  # its enforced budget ends with it, before the process trains anything else
        session.remove()
    return out


def _hf_train(rank, world, out_dir):
    import xirang_ds
    from xirang_ds.plugins.activations import head_loss

    xirang_ds.patch_deepspeed()
    plain = _hf_run(out_dir, {"monitor": {"enabled": True}})
    # GPT-2's tied lm_head through HF's own loss_function, chunked 8 tokens at a time; the calls on real
    # tensors counted (the session's estimate runs the chunked loss once more, in its fake trace)
    from torch._subclasses.fake_tensor import FakeTensor

    chunked = []
    original = head_loss.chunked_cross_entropy

    def counted(hidden, *a, **k):
        if not isinstance(hidden, FakeTensor):
            chunked.append(1)
        return original(hidden, *a, **k)

    head_loss.chunked_cross_entropy = counted
    try:
        chunk = _hf_run(out_dir, {"monitor": {"enabled": True}, "activations": {
            "enabled": True, "planner": False, "chunk": ["lm_head"], "chunk_tokens": 8}})
    finally:
        head_loss.chunked_cross_entropy = original
    # rank 1 runs out of memory in the second step's forward: HF's ModelOutput loss, accelerate's backward
    budget = 3 * plain["peak"]
    survived = _hf_run(out_dir, {"memory_budget": budget, "monitor": {
        "enabled": True, "on_oom": "halve_micro_batch", "enforce_budget": True}}, hog_bytes=budget if rank else 0)
    return plain, chunk, len(chunked), survived


@pytest.mark.distributed
def test_hf_trainer_with_patch_deepspeed(two_ranks):
    for r, chunk, chunked_calls, survived in (ranks["train"] for ranks in two_ranks):
        assert r["plugins"] == ["monitor"]
        assert r["steps"] == 4
        assert r["checks"] == 4  # the monitor saw every optimizer step
        assert r["loss"] > 0
        cal = r["calibration"]  # fixed shapes: calibrated on the first step, within bytes after it
        assert cal["calibrated_at"] == 1 and len(cal["checks"]) == 3
        assert all(abs(c["error"]) <= 1e-4 for c in cal["checks"]), cal["checks"]
        assert r["estimator_error"] is not None and abs(r["estimator_error"]) < 0.05, r["estimator_error"]
        # the chunked head under HF Trainer: every micro-batch's loss went through it, training alike
        assert chunk["plan"] == {"lm_head": "chunk"} and chunk["steps"] == 4
        assert chunked_calls == 4
        assert abs(chunk["loss"] - r["loss"]) <= 1e-3 * r["loss"], (chunk["loss"], r["loss"])
        # on_oom under HF Trainer: both ranks retried step 2 in two pieces; training alike
        assert survived["steps"] == 4 and survived["retries"] == [(2, "forward", 2)]
        assert abs(survived["loss"] - r["loss"]) <= 1e-3 * r["loss"], (survived["loss"], r["loss"])


def _hf_auto(rank, world, out_dir):
    import xirang_ds

    xirang_ds.patch_deepspeed()
    # "auto" in the block beside HF's own "auto" fields: Accelerate fills HF's, xirang resolves its own
    return _hf_run(out_dir, {"preset": "auto", "memory_budget": "auto", "activations": {"budget": "auto"},
                             "monitor": {"enabled": True}})


def test_hf_trainer_with_preset_auto(tmp_path):
    r = run_ranks(_hf_auto, 1, str(tmp_path))[0]
    assert r["steps"] == 4 and r["loss"] > 0
    assert r["preset"] == "conservative" and r["choice"].startswith("preset auto took conservative"), r["choice"]


def _hf_resumable(out_dir, block, resume_from=None):
    """4 steps of HF Trainer, checkpointed every 2; returns the final parameters, the losses logged at
    each step this run trained, the step-2 checkpoint and the block's sections the engine ran."""
    import os

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": 0.0,
          "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2, "reduce_bucket_size": 1e6}}
    if block is not None:
        ds["xirang"] = block
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64))
    ids = torch.randint(0, 256, (64, 32), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": x, "labels": x} for x in ids]
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=4, max_steps=4, use_cpu=True,
                             bf16=True, deepspeed=ds, report_to=[], save_strategy="steps", save_steps=2,
                             max_grad_norm=0.0, disable_tqdm=True, logging_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train(resume_from_checkpoint=resume_from)
    params = torch.cat([p.detach().float().reshape(-1) for p in trainer.model_wrapped.module.parameters()])
    losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    session = getattr(trainer.model_wrapped, "xirang", None)
    sections = sorted(p.section for p in session.plugins) if session is not None else []
    return params, losses, os.path.join(out_dir, "checkpoint-2"), sections


def _hf_resume(rank, world, out_dir):
    import os

    import torch

    import xirang_ds

    xirang_ds.patch_deepspeed()
    release = {"grad_release": {"enabled": True}}
    plain, plain_losses, plain_ckpt, plain_ran = _hf_resumable(os.path.join(out_dir, "plain"), None)
    added, added_losses, _, added_ran = _hf_resumable(os.path.join(out_dir, "added"), release, resume_from=plain_ckpt)
    ours, ours_losses, ours_ckpt, ours_ran = _hf_resumable(os.path.join(out_dir, "ours"), release)
    removed, removed_losses, _, removed_ran = _hf_resumable(os.path.join(out_dir, "removed"), None,
                                                            resume_from=ours_ckpt)
    changed, _, _, changed_ran = _hf_resumable(os.path.join(out_dir, "changed"), {"optimizer_states": {"enabled": True}},
                                               resume_from=ours_ckpt)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    weights = get_fp32_state_dict_from_zero_checkpoint(ours_ckpt)  # the grad_release run's, with GPT-2's tied head
    tied = "lm_head.weight" in weights and torch.equal(weights["lm_head.weight"], weights["transformer.wte.weight"])
    return {"tied": tied, "added": torch.equal(plain, added), "removed": torch.equal(ours, removed),
            "changed": torch.equal(ours, changed), "plain_losses": plain_losses, "added_losses": added_losses,
            "ours_losses": ours_losses, "removed_losses": removed_losses,
            "ran": {"plain": plain_ran, "added": added_ran, "ours": ours_ran, "removed": removed_ran,
                    "changed": changed_ran}}


@pytest.mark.distributed
def test_hf_trainer_resume_from_checkpoint_with_the_block_added_removed_and_changed(two_ranks):
    for r in (ranks["resume"] for ranks in two_ranks):
        # the resumed runs logged steps 3 and 4 (1 and 2 come from the checkpoint's trainer state) as the
        # uninterrupted runs did
        assert sorted(r["added_losses"]) == sorted(r["removed_losses"]) == [1, 2, 3, 4]
        assert r["added_losses"] == r["plain_losses"] and r["removed_losses"] == r["ours_losses"]
        # and end on the uninterrupted run's parameters, bit for bit, in every direction
        assert r["added"] and r["removed"] and r["changed"]
        assert r["tied"]  # zero_to_fp32 names the tied head as DeepSpeed's own checkpoints do
        # the block ran where it was written (through patch_deepspeed), and nowhere else
        assert r["ran"] == {"plain": [], "added": ["grad_release"], "ours": ["grad_release"], "removed": [],
                            "changed": ["optimizer_states"]}, r["ran"]


USER_CONFIGS = {
    # name: (ds_config zero_optimization, TrainingArguments keywords, what balanced leaves out there)
    "ZeRO-3, HF gradient checkpointing": ({"stage": 3}, {"gradient_checkpointing": True}, {"grad_release"}),
    "ZeRO-2, TrainingArguments(torch_compile=True)": ({"stage": 2}, {"torch_compile": True}, set()),
    "ZeRO-2, offload_optimizer": ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, {},
                                  {"grad_release", "optimizer_states"}),
    "ZeRO-1, accumulation 4": ({"stage": 1}, {"gradient_accumulation_steps": 4}, set()),
}


def _hf_user_run(out_dir, zero, keywords, block):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
          "bf16": {"enabled": "auto"}, "zero_optimization": zero}
    if block is not None:
        ds["xirang"] = block
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64))
    ids = torch.randint(0, 256, (64, 32), generator=torch.Generator().manual_seed(1))
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=4, max_steps=3, use_cpu=True, bf16=True,
                             deepspeed=ds, report_to=[], save_strategy="no", disable_tqdm=True, learning_rate=1e-3,
                             logging_steps=1, **keywords)
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": x, "labels": x} for x in ids])
    trainer.train()
    session = getattr(trainer.model_wrapped, "xirang", None)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    left_out = {item.section for item in session.left_out} if session is not None else None
    if session is not None:
        session.remove()
    return losses, left_out


def _hf_user_configs(rank, world, out_dir):
    import xirang_ds

    xirang_ds.patch_deepspeed()
    return {name: (_hf_user_run(out_dir, zero, keywords, None), _hf_user_run(out_dir, zero, keywords,
                                                                             {"preset": "balanced"}))
            for name, (zero, keywords, _) in USER_CONFIGS.items()}


def _two_rank_scenarios(rank, world, out_dir):
    """Everything that runs on 2 ranks, in one process pair: each launch imports transformers and
    warms HF Trainer up again, which costs more than a run."""
    import os

    return {"train": _hf_train(rank, world, os.path.join(out_dir, "train")),
            "resume": _hf_resume(rank, world, os.path.join(out_dir, "resume")),
            "users": _hf_user_configs(rank, world, os.path.join(out_dir, "users"))}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_ranks(_two_rank_scenarios, 2, str(tmp_path_factory.mktemp("hf_trainer")))


@pytest.mark.distributed
def test_a_preset_under_hf_trainer_in_the_configurations_users_write(two_ranks):
    """balanced under HF Trainer as users configure it: ZeRO-3 with HF's own gradient checkpointing,
    ``torch_compile=True``, optimizer offload, accumulation; it trains as plain DeepSpeed does there
    (int8 states: within 2%) and leaves out what cannot run, with its line."""
    for results in (ranks["users"] for ranks in two_ranks):
        for name, ((plain, _), (ours, left_out)) in results.items():
            assert len(ours) == len(plain) == 3, name
            assert ours == pytest.approx(plain, rel=2e-2), name
            assert left_out == USER_CONFIGS[name][2], (name, left_out)
