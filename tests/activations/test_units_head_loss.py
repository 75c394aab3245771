"""The chunked output head and loss (plugins/activations/head_loss.py), without an engine: the loss is
bit-identical to ``F.cross_entropy`` on the whole logits, gradients bit-identical with one slice and
exact to rounding with many; the loss code of a decoder, of HF's ``ForCausalLMLoss`` and of the
older shifted-logits style reaches the chunked path; any other use of the logits computes them
whole, exactly as without the plugin."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from xirang_ds.plugins.activations import head_loss as hl

H, V, B, S = 16, 40, 3, 7


def _setup(dtype, bias=False, tied=False, seed=0):
    torch.manual_seed(seed)
    head = nn.Linear(H, V, bias=bias).to(dtype)
    embed = nn.Embedding(V, H).to(dtype)
    if tied:
        head.weight = embed.weight
    ids = torch.randint(0, V, (B, S))
    labels = torch.randint(0, V, (B, S))
    labels[0, :3] = -100
    return head, embed, ids, labels


class _Head:
    """What the plugin's wrapper does for a head under chunk, with a count of chunked losses."""

    def __init__(self, head, tokens):
        self.head, self.tokens, self.chunked, self.whole = head, tokens, 0, 0

    def __call__(self, x):
        out = hl.defer(self.head, (x,), {}, self.consume, self.materialize)
        assert out is not None
        return out

    def consume(self, logits, target, whole, chunked):
        self.chunked += 1
        call = logits.call
        return chunked(logits.tokens, call.weight, call.bias, logits.casts, self.tokens, None, None)

    def materialize(self, call):
        self.whole += 1
        return F.linear(call.hidden, call.weight, call.bias)


def _grads(modules):
    return [p.grad.clone() for m in modules for p in m.parameters()]


def _run(loss_fn, dtype, tokens, bias=False, tied=False):
    """(plain loss, plain grads), (chunked loss, chunked grads), the head stand-in."""
    head, embed, ids, labels = _setup(dtype, bias, tied)
    results = []
    stand_in = _Head(head, tokens)
    for chunked in (False, True):
        for p in list(head.parameters()) + list(embed.parameters()):
            p.grad = None
        x = embed(ids) * 1.5
        logits = stand_in(x) if chunked else head(x)
        loss = loss_fn(logits, labels)
        loss.backward()
        results.append((loss.detach(), _grads([head, embed])))
    return results[0], results[1], stand_in


def _decoder_loss(reduction="mean", ignore_index=-100):
    def fn(logits, labels):
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1),
                               ignore_index=ignore_index, reduction=reduction)
        return loss.sum() / 5 if reduction == "none" else loss
    return fn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_loss_bit_identical_and_gradients_by_slices(dtype, reduction):
    # one slice: everything bit-identical
    (l0, g0), (l1, g1), stand_in = _run(_decoder_loss(reduction), dtype, tokens=10_000, bias=reduction == "sum")
    assert stand_in.chunked == 1 and stand_in.whole == 0  # the logits were never made whole
    assert torch.equal(l0, l1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    # five rows a slice: the loss still bit-identical, the weight gradient's slices add up to rounding
    (l0, g0), (l1, g1), _ = _run(_decoder_loss(reduction), dtype, tokens=5, bias=reduction == "sum")
    assert torch.equal(l0, l1)
    eps = torch.finfo(dtype).eps
    for a, b in zip(g0, g1):
        assert torch.allclose(a.float(), b.float(), rtol=8 * eps, atol=8 * eps * a.float().abs().max().item()), \
            (a - b).abs().max()


def test_tied_embeddings_ignore_index_and_no_cast():
    zero_ignored = _decoder_loss(ignore_index=0)
    for loss_fn in (lambda lg, y: zero_ignored(lg, y.clamp(min=0)),  # class 0 and the -100s ignored
                    lambda lg, y: F.cross_entropy(lg.view(-1, V), y.reshape(-1))):
        (l0, g0), (l1, g1), stand_in = _run(loss_fn, torch.bfloat16, tokens=4, tied=True)
        assert stand_in.chunked == 1
        assert torch.equal(l0, l1)
        for a, b in zip(g0, g1):
            assert torch.allclose(a.float(), b.float(), rtol=0.02, atol=0.02 * a.float().abs().max().item())


def test_hf_causal_lm_loss_and_shifted_logits_reach_the_chunked_path():
    loss_utils = pytest.importorskip("transformers.loss.loss_utils")

    def hf(logits, labels):  # what LlamaForCausalLM.forward calls: ForCausalLMLoss, num_items_in_batch given
        return loss_utils.ForCausalLMLoss(logits, labels, vocab_size=V, num_items_in_batch=torch.tensor(11))

    def shifted(logits, labels):  # the style of older HF models: shift the logits, not the labels
        shift = logits[..., :-1, :].contiguous()
        return F.cross_entropy(shift.view(-1, shift.size(-1)), labels[..., 1:].contiguous().view(-1))

    for loss_fn in (hf, shifted):
        (l0, g0), (l1, g1), stand_in = _run(loss_fn, torch.float32, tokens=10_000)
        assert stand_in.chunked == 1 and stand_in.whole == 0, loss_fn
        assert torch.equal(l0, l1)
        assert all(torch.equal(a, b) for a, b in zip(g0, g1))


def test_any_other_use_computes_the_logits_whole_as_without_the_plugin():
    def other(logits, labels):  # softmax, a sum, argmax: none is a cross_entropy of token-wise logits
        probs = logits.float().softmax(-1)
        assert logits.argmax(-1).shape == (B, S)
        return probs.square().sum() + logits.float()[..., :5].sum()

    (l0, g0), (l1, g1), stand_in = _run(other, torch.float32, tokens=4)
    assert stand_in.chunked == 0 and stand_in.whole == 1  # computed once, reused by every later use
    assert torch.equal(l0, l1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    # what cross_entropy cannot take chunked goes whole too: label smoothing, class weights, 3-D input
    for kwargs in ({"label_smoothing": 0.1}, {"weight": torch.ones(V)}):
        (l0, _), (l1, _), stand_in = _run(lambda lg, y: F.cross_entropy(lg.view(-1, V), y.reshape(-1), **kwargs),
                                          torch.float32, tokens=4)
        assert stand_in.chunked == 0 and torch.equal(l0, l1)
    (l0, _), (l1, _), stand_in = _run(lambda lg, y: F.cross_entropy(lg.transpose(1, 2), y), torch.float32, tokens=4)
    assert stand_in.chunked == 0 and torch.equal(l0, l1)


def test_metadata_without_computing_and_indexing_rules():
    head, embed, ids, _ = _setup(torch.float32)
    stand_in = _Head(head, 4)
    logits = stand_in(embed(ids))
    assert isinstance(logits, torch.Tensor) and logits.shape == (B, S, V) and logits.dim() == 3
    assert logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.requires_grad
    assert logits.size(-1) == V and len(logits) == B and "DeferredLogits" in repr(logits)
    assert stand_in.whole == 0
    keeps = hl._keeps_last_dim
    assert keeps((Ellipsis, slice(None, -1), slice(None)), 3) and keeps((slice(None), slice(1, None)), 3)
    assert keeps(torch.ones(B, S, dtype=torch.bool), 3) and keeps(Ellipsis, 3)
    assert not keeps((Ellipsis, slice(None, 5)), 3) and not keeps((0, 0, 0), 3) and not keeps((None, 0), 3)
    assert not keeps((slice(None), slice(None), slice(None, None, -1)), 3)


def test_not_deferred_under_autocast():
    head, embed, ids, _ = _setup(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert hl.defer(head, (embed(ids),), {}, None, None) is None
    assert hl.auto_tokens(torch.empty(V, H, dtype=torch.bfloat16)) == H // 2
    assert hl.auto_tokens(torch.empty(V, H)) == H
