"""Rows of a weight gradient against autograd's whole gradient, in one process: the chunked head's
rounds (`head_rows.backward`) and the input embedding's (`embedding_rows.RowsEmbedding`), through a
sink that keeps what each round would reduce; and a real `RowSink`'s rounds going where the whole shard
would (the device shard, the host buffer, the accumulator) over a bucket of rank 0 of 2."""
import pytest
import torch
import torch.nn.functional as F

from xirang_ds.plugins.activations import head_loss
from xirang_ds.plugins.grad_release.embedding_rows import RowsEmbedding


class Sink:
    """A `RowSink` of ``world`` ranks that keeps every rank's rows in place of reducing them."""

    def __init__(self, vocab, width, world=2, dtype=torch.float32, device="cpu"):
        self.world, self.rows, self.row_numel, self.dtype, self.device = world, vocab // world, width, dtype, device
        self.done, self.closed = 0, 0
        self.grad = torch.full((vocab, width), float("nan"), dtype=dtype, device=device)
        self.bucket = type("Bucket", (), {"scope": staticmethod(lambda c: torch.no_grad())})()

    def round_rows(self, parts=8):
        return max(1, -(-self.rows // parts))

    def buffer(self, rows):
        return torch.empty((self.world, rows, self.row_numel), dtype=self.dtype, device=self.device)

    def reduce(self, buffer):
        for r in range(self.world):
            start = r * self.rows + self.done
            self.grad[start:start + buffer.shape[1]] = buffer[r]
        self.done += buffer.shape[1]

    def close(self):
        assert self.done == self.rows
        self.closed += 1


class Hand:
    def __init__(self, sink):
        self.sink, self.uses = sink, 0

    def used(self):
        self.uses += 1

    def take(self):
        return self.sink


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction,bias,ignore", [("mean", False, True), ("sum", True, False), ("none", False, True)])
def test_head_rows_equal_autograd_gradients(reduction, bias, ignore, device):
    torch.manual_seed(0)
    n, width, vocab = 37, 16, 64
    hidden = torch.randn(n, width, device=device, requires_grad=True)
    weight = torch.randn(vocab, width, device=device, requires_grad=True)
    b = torch.randn(vocab, device=device, requires_grad=True) if bias else None
    target = torch.randint(0, vocab, (n,), device=device)
    if ignore:
        target[::5] = -100
    grad_out = torch.rand(n, device=device) if reduction == "none" else None

    def total(loss):
        return (loss * grad_out).sum() if grad_out is not None else loss

    total(F.cross_entropy(F.linear(hidden, weight, b).float(), target, reduction=reduction)).backward()
    want = (hidden.grad.clone(), weight.grad.clone(), b.grad.clone() if bias else None)
    hidden.grad = weight.grad = None
    if bias:
        b.grad = None
    sink = Sink(vocab, width, device=device)
    weight.xirang_rows = Hand(sink)
    total(head_loss.chunked_cross_entropy(hidden, weight, b, target, (torch.float32,), reduction=reduction,
                                          tokens=8)).backward()
    assert weight.xirang_rows.uses == 1 and sink.closed == 1
    assert weight.grad is None  # handed over, not accumulated
    torch.testing.assert_close(sink.grad, want[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden.grad, want[0], rtol=1e-5, atol=1e-5)
    if bias:
        torch.testing.assert_close(b.grad, want[2], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padding_idx", [None, 3])
def test_embedding_rows_equal_autograd_gradient(padding_idx, dtype, device):
    """Each row's tokens added in their order in the gradient's dtype: on CPU the gradient autograd
    makes, bit for bit (repeated ids and the padding id among them)."""
    torch.manual_seed(0)
    vocab, width = 40, 8
    weight = torch.randn(vocab, width, device=device, dtype=dtype, requires_grad=True)
    ids = torch.randint(0, vocab, (3, 11), device=device)
    ids[0, :4] = 3  # repeated ids, the padding one among them
    ids[1, :6] = 17
    upstream = torch.randn(3, 11, width, device=device, dtype=dtype)
    (F.embedding(ids, weight, padding_idx) * upstream).sum().backward()
    want, weight.grad = weight.grad.clone(), None
    sink = Sink(vocab, width, dtype=dtype, device=device)
    out = RowsEmbedding.apply(ids, weight, padding_idx, Hand(sink))
    torch.testing.assert_close(out, F.embedding(ids, weight, padding_idx), rtol=0, atol=0)
    (out * upstream).sum().backward()
    assert sink.closed == 1 and weight.grad is None
    if device == "cpu":
        assert torch.equal(sink.grad, want)
    else:  # CUDA's embedding backward sums repeated ids in its own order
        torch.testing.assert_close(sink.grad, want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)


def test_embedding_without_the_rows_is_autograds_own_gradient():
    vocab, width = 40, 8
    weight = torch.randn(vocab, width, requires_grad=True)
    ids = torch.randint(0, vocab, (2, 9))
    upstream = torch.randn(2, 9, width)
    (F.embedding(ids, weight, 0) * upstream).sum().backward()
    want, weight.grad = weight.grad.clone(), None
    hand = Hand(None)  # take() gives no sink: the whole gradient, as autograd makes it
    (RowsEmbedding.apply(ids, weight, 0, hand) * upstream).sum().backward()
    assert torch.equal(weight.grad, want)


class TwoRanks:
    """Rank 0 of two ranks that make the same gradients: a reduce-scatter is this rank's half, doubled."""

    world, rank = 2, 0

    def reduce_scatter(self, out, buffer):
        torch.mul(buffer.view(2, -1)[0], 2, out=out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,stash,acc,late", [
    ("hold", True, False, False), ("hold", False, False, False), ("fused", False, False, False),
    ("accumulate", False, False, False), ("hold", True, True, False), ("hold", True, False, True),
    ("hold", True, True, True)])
def test_a_sinks_rounds_go_where_the_whole_shard_would(kind, stash, acc, late, device):
    """A real `RowSink` over a bucket of rank 0 of 2: under ``host`` (stash) each round goes to the pinned
    host buffer, under accumulation into the fp32 accumulator, else into the device shard; the bucket then
    finalizes to the same gradient and norm as the whole shard, and the device never held the shard
    where the rounds went on. A late gradient (``Bucket.add_late``) is added where the rounds went: the
    shard comes back from the host to the device, or the accumulator takes it."""
    from xirang_ds.plugins.grad_release.bucket import Bucket
    from xirang_ds.plugins.grad_release.layout import BucketLayout
    from xirang_ds.plugins.grad_release.pipeline import Pass
    from xirang_ds.plugins.grad_release.rows import RowSink

    torch.manual_seed(0)
    vocab, width = 64, 8
    weight = torch.nn.Parameter(torch.randn(vocab, width, device=device, dtype=torch.bfloat16))
    bucket = Bucket(0, [weight], ["head.weight"], [0], BucketLayout.build([weight.numel()], 2), TwoRanks(),
                    torch.optim.AdamW([weight]), torch.bfloat16)
    earlier = torch.randn(vocab // 2 * width, device=device)
    if acc:
        bucket.acc = earlier.clone()
    pipeline = type("Pipeline", (), {"kind": Pass[kind.upper()], "stash_held": stash, "buckets": [bucket],
                                     "delivered": lambda self, b: None})()
    bucket.begin_backward()
    sink = RowSink(pipeline, 0)
    grad = torch.randn(vocab, width, device=device, dtype=torch.bfloat16)  # every rank's, alike
    shards = []
    for start in range(0, sink.rows, 5):
        rows = min(5, sink.rows - start)
        buffer = sink.buffer(rows)
        for r in range(2):
            buffer[r] = grad[r * sink.rows + start:r * sink.rows + start + rows]
        sink.reduce(buffer)
        shards.append(bucket.reduced)
    sink.close()
    reduced = (grad[:sink.rows] * 2).reshape(-1)  # rank 0's rows, summed over the two ranks
    went_on = stash or kind == "accumulate" or acc
    assert (bucket.reduced is None) == went_on and all(s is None for s in shards) == went_on
    after = 0
    if late:  # a use of the weight the rows did not see, reduced on arrival
        other = torch.randn(vocab, width, device=device, dtype=torch.bfloat16)
        bucket.add_late(0, other)
        extra = (other[:sink.rows] * 2).reshape(-1)
        if acc:
            after = extra.float() / 2  # added to the accumulator after the rounds
        else:
            reduced = reduced + extra  # in bf16, as the shard brought back adds it
        stash = acc  # the shard is on the device again
    if kind == "accumulate":
        bucket.fold()
        torch.testing.assert_close(bucket.acc, reduced.float() / 2, rtol=0, atol=0)
        return
    bucket.finalize()
    whole = reduced.float() / 2 + (earlier if acc else 0) + after
    if device == "cuda":
        torch.cuda.synchronize()
    assert bucket.grad.device.type == ("cpu" if stash and not acc else device)
    torch.testing.assert_close(bucket.grad.float().to(device) * bucket.grad_scale, whole, rtol=0, atol=0)
    torch.testing.assert_close(bucket.sumsq(), whole.double().square().sum(), rtol=1e-6, atol=0)
    if stash and not acc and device == "cuda":
        assert bucket.grad.is_pinned()
