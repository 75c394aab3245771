"""Compiled models users bring, under every preset, with and without a budget, on 2 ranks: a tied-embedding GPT
built on ``nn.MultiheadAttention`` compiled whole, and Hugging Face ``LlamaDecoderLayer``s (from a config) compiled
one by one. Each tensor a profiling pass, offload, compress or recompute hands back to the compiled backward has the
size and stride it asserts (`saved.storage_flat`), and a recomputed Llama layer writes no KV cache
(`recompute.without_cache_writes`), so Llama layers fixed to recompute train bit-identically to the compiled plain
run."""
import pytest

from tests.harness.engine_runs import ds_config
from xirang_ds.launch import run_ranks

PRESETS = ("conservative", "balanced", "aggressive")
VOCAB, SEQ = 128, 16


def _gpt():
    import torch
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x):
            y = self.ln_1(x)
            mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)
            x = x + self.attn(y, y, y, attn_mask=mask, need_weights=False)[0]
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self, d=64, layers=2, heads=4):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, d)
            self.pos = nn.Parameter(torch.zeros(SEQ, d))
            self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
            self.ln_f = nn.LayerNorm(d)
            self.lm_head = nn.Linear(d, VOCAB, bias=False)
            self.lm_head.weight = self.embed.weight  # tied

        def forward(self, idx, labels):
            x = self.embed(idx) + self.pos[:idx.shape[1]]
            for block in self.blocks:
                x = block(x)
            logits = self.lm_head(self.ln_f(x))
            return nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    torch.manual_seed(0)
    return torch.compile(GPT())


def _llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)  # use_cache defaults to True: each layer is called with a DynamicCache
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = torch.compile(layer)
    return model


def _train(rank, build, xirang, steps=3):
    import torch

    import xirang_ds

    model = build()
    cfg = ds_config(stage=2, dtype="fp32", micro=2, xirang=xirang)
    init = xirang_ds.initialize if xirang is not None else __import__("deepspeed").initialize
    engine, *_ = init(model=model, model_parameters=model.parameters(), config=cfg)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        out = engine(idx, labels=idx)
        loss = out if isinstance(out, torch.Tensor) else out.loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    session = getattr(engine, "xirang", None)
    plugin = session.plugin("activations") if session is not None else None
    out = {"losses": losses, "plan": dict(plugin.plan) if plugin is not None else None,
           "params": [p.detach().clone() for p in engine.module.parameters()]}
    if session is not None:
        session.remove()
    return out


def _attempt(rank, build, xirang):
    from xirang_ds.config.validate import XirangConfigError

    try:
        return _train(rank, build, xirang)
    except XirangConfigError as e:  # a budget the whole compiled model cannot meet: refused by name
        return {"refused": str(e)}


def _runs(rank, world, builder):
    import torch._dynamo

    torch._dynamo.reset()
    build = {"gpt": _gpt, "llama": _llama}[builder]
    out = {"plain": _train(rank, build, None)}
    for preset in PRESETS:
        out[preset] = _train(rank, build, {"preset": preset})
        out[preset + " budget"] = _attempt(rank, build, {"preset": preset, "activations": {"budget_fraction": 0.5}})
    if builder == "llama":
        out["recompute"] = _train(rank, build, {"activations": {"enabled": True, "recompute": ["model.layers.*"]}})
    return out


@pytest.fixture(scope="module", params=["gpt", "llama"])
def runs(request):
    return request.param, run_ranks(_runs, 2, request.param)


def test_compiled_models_train_under_every_preset_with_and_without_a_budget(runs):
    import math

    builder, ranks = runs
    for rank in ranks:
        for preset in PRESETS:
            run = rank[preset]
            assert all(math.isfinite(x) for x in run["losses"]), (preset, run)
            if preset == "conservative":  # lossless: the compiled plain run's losses
                # to the last bits of fp32: under grad_release's gradient hooks Dynamo may compile a layer anew,
                # and Inductor's new kernel can sum in another order (seen on some x86 hosts: one loss of
                # llama's 6 off by 5e-7, the steps after equal again)
                assert run["losses"] == pytest.approx(rank["plain"]["losses"], rel=1e-6, abs=0)
            budgeted = rank[preset + " budget"]
            if builder == "gpt":  # one unit: every saved tensor is back at once in its backward
                assert "the model was compiled before initialize, so the model is one unit" in budgeted["refused"]
            else:
                assert all(math.isfinite(x) for x in budgeted["losses"]), (preset, budgeted)
                assert set(budgeted["plan"].values()) - {"keep"}, budgeted["plan"]  # the budget made it act


def test_compiled_llama_layers_fixed_to_recompute_train_bit_identically(runs):
    import torch

    builder, ranks = runs
    if builder != "llama":
        pytest.skip("the Llama layers' run")
    for rank in ranks:
        run = rank["recompute"]
        assert run["plan"]["model.layers.0"] == run["plan"]["model.layers.1"] == "recompute"
        assert run["losses"] == rank["plain"]["losses"]
        assert all(torch.equal(a, b) for a, b in zip(run["params"], rank["plain"]["params"]))
        assert all(torch.equal(a, b) for a, b in zip(run["params"], rank["plain"]["params"]))
