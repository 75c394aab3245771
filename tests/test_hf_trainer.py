"""HF Trainer with TrainingArguments(deepspeed=...) and patch_deepspeed() honours the block."""
import pytest

from xirang_ds.launch import run_ranks


def _hf_run(out_dir, block):
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
    ids = torch.randint(0, 256, (32, 32))
    data = [{"input_ids": x, "labels": x} for x in ids]
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=4, max_steps=4, use_cpu=True,
                             bf16=True, deepspeed=ds, report_to=[], logging_steps=1, save_strategy="no",
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    result = trainer.train()
    engine = trainer.model_wrapped
    session = getattr(engine, "xirang", None)
    return {
        "plugins": [p.section for p in session.plugins] if session else None,
        "steps": result.global_step,
        "loss": result.training_loss,
        "checks": len(session.plugin("monitor").history) if session else 0,
        "plan": dict(session.plugin("activations").plan) if session and session.plugin("activations") else None,
    }


def _hf_train(rank, world, out_dir):
    import xirang_ds
    from xirang_ds.plugins.activations import head_loss

    xirang_ds.patch_deepspeed()
    plain = _hf_run(out_dir, {"monitor": {"enabled": True}})
    # GPT-2's tied lm_head through HF's own loss_function, chunked 8 tokens at a time
    chunked = []
    original = head_loss.chunked_cross_entropy
    head_loss.chunked_cross_entropy = lambda *a, **k: chunked.append(1) or original(*a, **k)
    try:
        chunk = _hf_run(out_dir, {"monitor": {"enabled": True}, "activations": {
            "enabled": True, "planner": False, "chunk": ["lm_head"], "chunk_tokens": 8}})
    finally:
        head_loss.chunked_cross_entropy = original
    return plain, chunk, len(chunked)


@pytest.mark.distributed
def test_hf_trainer_with_patch_deepspeed(tmp_path):
    results = run_ranks(_hf_train, 2, str(tmp_path))
    for r, chunk, chunked_calls in results:
        assert r["plugins"] == ["monitor"]
        assert r["steps"] == 4
        assert r["checks"] == 4  # the monitor saw every optimizer step
        assert r["loss"] > 0
        # the chunked head under HF Trainer: every micro-batch's loss went through it, training alike
        assert chunk["plan"] == {"lm_head": "chunk"} and chunk["steps"] == 4
        assert chunked_calls == 4
        assert abs(chunk["loss"] - r["loss"]) <= 1e-3 * r["loss"], (chunk["loss"], r["loss"])
