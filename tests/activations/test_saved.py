"""What autograd gets back from every pack/unpack path of the activations plugin (`saved.PackContext` with each
handler, the profiling pass, a composed outer pair): the saved tensor's exact size, stride and storage offset, for
permuted, sliced, expanded and channels-last views wherever they sit in their storage (a compiled backward asserts
sizes and strides); and a backward over a retained graph (grad_release's ``two_pass``) can unpack every packed and
recomputed tensor again."""
import contextlib

import pytest
import torch
import torch.nn as nn

from tests.activations.test_units import _Arena
from xirang_ds.memory.device_profile import PROFILES
from xirang_ds.plugins.activations.handlers import CodecHandler, OffloadHandler
from xirang_ds.plugins.activations.offload import Offloader
from xirang_ds.plugins.activations.profile import Profiler
from xirang_ds.plugins.activations.recompute import RecomputeScope, full_context, run_checkpointed
from xirang_ds.plugins.activations.saved import Eligibility, PackContext
from xirang_ds.plugins.activations.storage import PayloadStorage


def _data(*shape):
    """bf16-exact values, three in four zero: every encoding shrinks them."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g) * (torch.rand(*shape, generator=g) < 0.25)
    return x.bfloat16().float()


def _views():
    """``{name: [views saved together]}``, each case over a storage of its own."""
    grid = _data(16, 32)
    qkv = _data(3, 4, 8)
    image = _data(4, 3, 5, 5).contiguous(memory_format=torch.channels_last)
    return {
        "permuted, first half": [_data(2, 8, 6, 4)[0].permute(2, 0, 1)],
        "permuted, whole": [_data(8, 6, 4).permute(2, 0, 1)],
        "sliced, first half": [grid[2:6, 3:19]],
        "sliced, second half": [_data(16, 32)[10:14, ::2]],
        "expanded, first half": [_data(16, 32)[3:4].expand(5, 32)],
        "expanded, whole": [_data(1, 32).expand(5, 32)],
        "channels-last, first half": [image[:2]],
        "channels-last, whole": [_data(4, 3, 5, 5).contiguous(memory_format=torch.channels_last)],
        "q, k and v of one storage": [qkv[i].t() for i in range(3)],
        "two slices of one storage": [grid[0:2, 1:9], grid[8:16, ::4]],
    }


def _layout(t):
    return tuple(t.shape), t.stride(), t.storage_offset()


def _codec(kind, **settings):
    handler = CodecHandler(kind, PayloadStorage(), **settings)
    return handler, lambda: handler.stored_bytes


def _offload():
    handler = OffloadHandler(Offloader(torch.device("cpu")))
    return handler, lambda: handler.offloader.offloaded_bytes


PATHS = {
    "compress": lambda: _codec("compress"),
    "quantize": lambda: _codec("quantize", block_size=16),
    "sparsify": lambda: _codec("sparsify", threshold=0.0),
    "offload": _offload,
}
LOSSLESS = ("compress", "offload", "profile", "composed")


def _context(path):
    """``(context, bytes packed so far)`` of one path."""
    eligible = Eligibility("cpu", 0)
    if path == "profile":  # the profiling pass's own pack context (offloads every saved storage)
        handler, packed = _offload()
        profiler = Profiler(eligible, handler, PayloadStorage(), frozenset(), (), 64, 0.0, PROFILES["cpu"])
        return profiler.run_pass(), packed
    if path == "composed":  # an outer pair (a user's) around ours: its pack runs first
        handler, packed = _offload()

        @contextlib.contextmanager
        def both():
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), PackContext(handler, eligible):
                yield

        return both(), packed
    handler, packed = PATHS[path]()
    return PackContext(handler, eligible), packed


@pytest.mark.parametrize("path", [*PATHS, "profile", "composed"])
def test_every_pack_path_gives_back_the_saved_size_stride_and_storage_offset(path):
    w = torch.ones((), requires_grad=True)
    for case, views in _views().items():
        ctx, packed = _context(path)
        before = packed()
        with ctx:
            products = [v * w for v in views]  # MulBackward0 saves the view for w's gradient
        assert packed() > before, (path, case)  # the views were packed, not kept
        for view, y in zip(views, products):
            back = y.grad_fn._saved_self
            assert _layout(back) == _layout(view), (path, case)
            if path in LOSSLESS:
                assert torch.equal(back, view), (path, case)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))


def _twice(model, x, ctx=None, recompute=False):
    """Gradients of two backwards over one retained graph (grad_release's two_pass)."""
    model.zero_grad()
    with ctx if ctx is not None else contextlib.nullcontext():
        if recompute:
            y = run_checkpointed(model, (x,), {}, full_context(RecomputeScope(contextlib.nullcontext)))
        else:
            y = model(x)
    loss = y.square().sum()
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    loss.backward()
    return first, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("path", ["offload", "compress in lent memory", "recompute", "recompute with offload"])
def test_a_retained_graph_unpacks_every_packed_and_recomputed_tensor_again(path):
    model, x = _mlp(), _data(8, 32)
    ref_first, ref_both = _twice(model, x)
    eligible = Eligibility("cpu", 0)
    eligible.refresh(model)
    if path == "compress in lent memory":
        storage = PayloadStorage()
        storage.provider = _Arena(1 << 20)
        ctx = PackContext(CodecHandler("compress", storage), eligible)
    else:
        ctx = PackContext(OffloadHandler(Offloader(torch.device("cpu"))), eligible) if "offload" in path else None
    first, both = _twice(model, x, ctx, recompute=path.startswith("recompute"))
    assert all(torch.equal(a, b) for a, b in zip(first, ref_first))
    assert all(torch.equal(a, b) for a, b in zip(both, ref_both))
