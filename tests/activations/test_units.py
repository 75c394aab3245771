"""The activations plugin's parts without an engine: codecs (bit-exact or within their stated
bound), storage-level packing (views, strides, composition with outer hooks), the lending seam,
the planner (against brute force), selectors and their errors, and the private torch APIs."""
import contextlib
import itertools
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from xirang_ds.memory.categories import ACTIVATIONS, HOST
from xirang_ds.memory.tracker import MemoryTracker
from xirang_ds.models import BUILTIN_SPECS, build_model
from xirang_ds.plugins.activations import codecs
from xirang_ds.plugins.activations.codecs import (
    CHUNK_ELEMENTS,
    bit_view,
    encode_int8,
    encode_lossless,
    encode_sparse,
    int8_bound,
    lossless_plan,
    trial,
)
from xirang_ds.plugins.activations.config import ActivationsConfig
from xirang_ds.plugins.activations.handlers import CodecHandler, OffloadHandler
from xirang_ds.plugins.activations.offload import Offloader
from xirang_ds.plugins.activations.planner import BudgetError, Choice, Node, estimate_peak, plan
from xirang_ds.plugins.activations.saved import Eligibility, PackContext
from xirang_ds.plugins.activations.selection import find_candidates, fixed_plan
from xirang_ds.plugins.activations.storage import Lease, PayloadStorage


def _special_fp32(n=4096):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g).bfloat16().float()  # exactly bf16 values
    x[:8] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1e-40, -1e-40, 2.0 ** 100, 3.0]).bfloat16().float()
    return x


def test_lossless_is_bit_exact_and_narrows_only_when_exact():
    storage = PayloadStorage()
    x = _special_fp32()
    p = encode_lossless(x, storage)
    assert p.kind == "narrow" and p.nbytes == x.numel() * 2
    assert torch.equal(bit_view(p.decode()), bit_view(x))  # -0.0, infinities, subnormals included
    y = x[8:].clone()
    y[100] = 1.0 + 2 ** -10  # not a bf16 value: fp16 is exact for it, bf16 is not
    q = encode_lossless(y, storage)
    assert q.kind == "narrow" and q.parts["values"].dtype == torch.float16
    assert torch.equal(bit_view(q.decode()), bit_view(y))
    z = torch.randn(4096)  # generic fp32: nothing exact to gain
    assert encode_lossless(z, storage) is None


def test_lossless_trial_of_a_large_tensor_reads_it_a_chunk_at_a_time_with_the_same_answer():
    """The profiling passes' compress trial of a tensor above one chunk: the bytes `encode_lossless`
    makes of it, exactly, including a tensor whose first chunk narrows and whose last does not."""
    storage = PayloadStorage()
    n = CHUNK_ELEMENTS + CHUNK_ELEMENTS // 2
    g = torch.Generator().manual_seed(0)
    narrow = torch.randn(n, generator=g).bfloat16().float()
    mixed = narrow.clone()
    mixed[-1] = 1.0 + 2 ** -20  # neither bf16 nor fp16: the whole tensor does not narrow
    sparse = torch.zeros(n)
    sparse[::97] = 1.5
    cases = {"narrow": narrow, "mixed": mixed, "sparse": sparse, "random": torch.randn(n, generator=g),
             "bool": torch.rand(n, generator=g) > 0.5}
    for name, x in cases.items():
        whole = lossless_plan(x)
        assert lossless_plan(x, CHUNK_ELEMENTS // 3) == whole, name
        payload = encode_lossless(x, storage)
        dense = x.numel() * x.element_size()
        assert trial("compress", x, storage).nbytes == (payload.nbytes if payload is not None else dense), name
    assert lossless_plan(mixed) is None and lossless_plan(narrow)[0] == "narrow"


def test_each_codec_reads_the_host_once_per_tensor_whatever_its_chunks():
    """Issue 58 item 3: the checks stay on the device across chunks (and the narrower dtypes) and are read
    once, at the end; the answers are the ones chunk by chunk (test above)."""
    from xirang_ds.step_counts import count_ops

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3 * CHUNK_ELEMENTS + 5, generator=g)
    x[::7] = 0.0
    for encode in (lambda: lossless_plan(x, CHUNK_ELEMENTS // 2), lambda: encode_int8(x, PayloadStorage(), 64),
                   lambda: encode_sparse(x, PayloadStorage(), 0.01)):
        assert count_ops(encode)[1].host_syncs == 1
    x[5] = float("inf")
    for encode in (lambda: encode_int8(x, PayloadStorage(), 64), lambda: encode_sparse(x, PayloadStorage(), 0.01)):
        with pytest.raises(codecs.BoundExceeded):  # no finite scale or cutoff: stored by the module's reserve
            encode()
        x[5] = float("nan")


def test_lossless_zero_mask_and_bits():
    storage = PayloadStorage()
    x = torch.relu(torch.randn(10_001)).bfloat16()
    x[x < 1.0] = 0  # ~84 % exact zeros
    x[5] = -0.0  # a negative zero is a value, not a zero bit pattern
    p = encode_lossless(x, storage)
    assert p.kind == "zero_mask" and p.nbytes < 0.4 * x.numel() * 2
    assert torch.equal(bit_view(p.decode()), bit_view(x))
    m = torch.rand(1003) > 0.5
    b = encode_lossless(m, storage)
    assert b.kind == "bits" and b.nbytes == 126 and torch.equal(b.decode(), m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_within_stated_bound(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(5000, generator=g) * torch.logspace(-3, 3, 5000)).to(dtype)  # heavy dynamic range
    before = x.clone()
    p = encode_int8(x, PayloadStorage(), 64)
    assert torch.equal(x, before)  # encoding never writes into the saved tensor
    assert p.nbytes < x.numel() * x.element_size()
    err = (p.decode().float() - x.float()).abs()
    unit = torch.finfo(dtype).eps / 2
    bound = int8_bound(x, 64)
    assert bool((err <= bound + (x.float().abs() + bound) * unit + 1e-12).all())
    t = codecs.trial("quantize", x, PayloadStorage(), 64)
    assert 0 < t.error_ratio <= 1.0


def test_sparse_within_threshold_and_declines_dense():
    x = F.gelu(torch.randn(8192) - 2.0)  # mostly tiny negative values
    p = encode_sparse(x, PayloadStorage(), 0.01)
    cutoff = float(x.abs().max()) * 0.01
    assert p is not None and float((p.decode() - x).abs().max()) <= cutoff
    assert encode_sparse(torch.randn(8192), PayloadStorage(), 0.0) is None  # dense: no gain


# ------------------------------------------------------------------------------------------------
# packing


class _Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)
        self.out = nn.Linear(32, 32)

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 16, 3, 4, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(F.gelu(y.transpose(1, 2).reshape(2, 16, 32)))


def _grads(module, x, ctx_factory=None):
    module.zero_grad()
    xx = x.clone().requires_grad_()
    if ctx_factory is None:
        y = module(xx)
    else:
        with ctx_factory():
            y = module(xx)
    y.square().sum().backward()
    return [p.grad.clone() for p in module.parameters()] + [xx.grad.clone()]


@pytest.mark.parametrize("kind", ["compress", "offload"])
def test_packing_gives_bit_identical_gradients_and_packs_each_storage_once(kind):
    torch.manual_seed(0)
    m = _Attn()
    x = torch.randn(2, 16, 32)
    ref = _grads(m, x)
    stored = []
    if kind == "offload":
        handler = OffloadHandler(Offloader(torch.device("cpu")))
        real = handler.store
        handler.store = lambda flat, call: stored.append(flat.numel()) or real(flat, call)
    else:
        handler = CodecHandler("compress", PayloadStorage())
        real = handler.store
        handler.store = lambda flat, call: stored.append(flat.numel()) or real(flat, call)
    eligible = Eligibility("cpu", 0)
    eligible.refresh(m)
    got = _grads(m, x, lambda: PackContext(handler, eligible))
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    # q, k and v are three saved views of one storage: packed once
    assert stored.count(2 * 16 * 96) == 1


def test_outer_hooks_compose_and_checkpoint_regions_are_left_alone():
    m = _Attn()
    x = torch.randn(2, 16, 32)
    ref = _grads(m, x)
    calls = {"pack": 0, "unpack": 0}

    def pack(t):
        calls["pack"] += 1
        return t.clone()

    def unpack(t):
        calls["unpack"] += 1
        return t

    handler = OffloadHandler(Offloader(torch.device("cpu")))
    eligible = Eligibility("cpu", 0)
    eligible.refresh(m)

    def both():
        class _Ctx:
            def __enter__(self):
                self.outer = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
                self.outer.__enter__()
                self.inner = PackContext(handler, eligible)
                self.inner.__enter__()

            def __exit__(self, *exc):
                self.inner.__exit__(*exc)
                self.outer.__exit__(*exc)
        return _Ctx()

    got = _grads(m, x, both)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert calls["pack"] > 0 and calls["unpack"] == calls["pack"]  # the outer pair still ran

    entered = []

    def inside(t):
        ctx = PackContext(handler, eligible)
        with ctx:
            entered.append(ctx.pushed)
            return m(t)

    xx = x.clone().requires_grad_()
    torch.utils.checkpoint.checkpoint(inside, xx, use_reentrant=False).sum().backward()
    assert entered == [False, False]  # forward and recomputation: the checkpoint's hooks stay innermost


def test_offload_moves_device_bytes_to_the_host_tier():
    lin1, lin2 = nn.Linear(256, 1024), nn.Linear(1024, 256)
    x = torch.randn(64, 256)
    tracker = MemoryTracker("cpu")
    handler = OffloadHandler(Offloader(torch.device("cpu"), host_tier=tracker.host_tier))
    eligible = Eligibility("cpu", 0)
    for offload in (False, True):
        with tracker:
            tracker.reset_peak()
            tracker.set_phase("forward")
            if offload:
                with PackContext(handler, eligible):
                    y = lin2(F.gelu(lin1(x)))
            else:
                y = lin2(F.gelu(lin1(x)))
            tracker.set_phase("backward")
            report = tracker.report()
            live = tracker.by_category(tracker.live_records())
            y.sum().backward()
            tracker.set_phase("idle")
        if not offload:
            plain_act = live[ACTIVATIONS]
        else:
            assert live[ACTIVATIONS] <= 64 * 256 * 4 + 64  # only the output and small stats remain
            assert live[HOST] >= plain_act - 64 * 256 * 4
        del y, report


class _Arena:
    """A lender: one buffer, bump allocation, reclaimable."""

    def __init__(self, nbytes):
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.used = 0
        self.leases = []
        self.released = 0

    def lease(self, nbytes, device):
        if self.used + nbytes > self.buffer.numel():
            return None
        view = self.buffer[self.used:self.used + nbytes]
        self.used += nbytes
        lease = Lease(view, on_release=self._released)
        self.leases.append(lease)
        return lease

    def _released(self):
        self.released += 1

    def reclaim(self):
        for lease in self.leases:
            lease.evict()
        self.used = 0


def test_lent_storage_holds_payloads_and_eviction_keeps_them_readable():
    x = torch.relu(torch.randn(4096)).float().bfloat16().float()  # exact in bf16, half zeros
    arena = _Arena(1 << 20)
    storage = PayloadStorage()
    storage.provider = arena
    p = encode_lossless(x, storage)
    assert arena.used > 0 and storage.leased_bytes == p.nbytes
    arena.reclaim()  # the lender needs its memory back before the payload is decoded
    assert p.lease.evicted and arena.released == 1
    assert torch.equal(bit_view(p.decode()), bit_view(x))
    q = encode_lossless(x, storage)
    assert torch.equal(bit_view(q.decode()), bit_view(x))
    q.release()
    assert arena.released == 2
    with pytest.raises(RuntimeError, match="decoded twice"):
        q.decode()


# ------------------------------------------------------------------------------------------------
# planner


def _assignments(node):
    """Every plan of a subtree: {name: Choice} dicts (a node's option, or its children's plans)."""
    out = [{node.name: c} for c in node.choices]
    if node.children and not node.fixed:
        for combo in itertools.product(*[_assignments(c) for c in node.children]):
            merged = {}
            for part in combo:
                merged.update(part)
            out.append(merged)
    return out


def _random_tree(rng):
    def node(name, depth, order):
        keep = rng.randint(100, 1000)
        choices = [Choice("keep", keep, 0.0, 0)]
        for i in range(rng.randint(1, 3)):
            kept = rng.randint(0, keep)
            choices.append(Choice(f"o{i}", kept, rng.random(), rng.randint(0, keep - kept + 200)))
        n = Node(name, choices, keep, order=order)
        if depth < 1:
            n.children = [node(f"{name}.{i}", depth + 1, order * 10 + i + 1) for i in range(rng.randint(0, 2))]
            n.keep_bytes = keep + sum(k.keep_bytes for k in n.children)
            n.choices[0] = Choice("keep", n.keep_bytes, 0.0, 0)
        return n
    return [node(f"b{i}", 0, 100 * i) for i in range(rng.randint(1, 3))]


def test_planner_matches_brute_force_and_respects_every_point_of_the_step():
    rng = random.Random(0)
    for _ in range(30):
        roots = _random_tree(rng)
        before, after = rng.randint(0, 300), rng.randint(0, 300)
        plans = [dict(x for part in combo for x in part.items())
                 for combo in itertools.product(*[_assignments(r) for r in roots])]
        peaks = [max(estimate_peak(roots, p, before, after)) for p in plans]
        budget = rng.randint(min(peaks), max(peaks))
        best = min(sum(c.added_s for c in p.values()) for p, pk in zip(plans, peaks) if pk <= budget)
        chosen = plan(roots, budget, before, after, resolution=4096)
        assert max(estimate_peak(roots, chosen, before, after)) <= budget
        assert sum(c.added_s for c in chosen.values()) <= best + 0.05  # exact up to byte rounding


def test_backward_transient_counts():
    """Recomputing a late module brings its tensors back while the earlier ones are still kept."""
    early = Node("a", [Choice("keep", 100, 0, 0), Choice("recompute", 10, 1.0, 90)], 100, order=0)
    late = Node("b", [Choice("keep", 100, 0, 0), Choice("recompute", 10, 1.0, 90)], 100, order=1)
    # both recomputed: 20 kept at the end of forward, but 10 + 10 + 90 = 110 during b's backward
    assert estimate_peak([early, late], {"a": early.choices[1], "b": late.choices[1]}, 0, 0) == (20, 110)
    with pytest.raises(BudgetError) as e:
        plan([early, late], 105)
    assert 105 < e.value.least_bytes <= 111


# ------------------------------------------------------------------------------------------------
# selectors


def _problems(block, ds_config=None):
    from xirang_ds.config.loader import validate_block

    cfg = validate_block({"activations": {"enabled": True, **block}}).activations
    model = build_model(BUILTIN_SPECS["gpt-tiny"])
    problems = []
    candidates = find_candidates(model, cfg, problems)
    plan_, settings = fixed_plan(model, cfg, ds_config or {}, problems)
    return candidates, plan_, settings, problems


def test_auto_candidates_are_blocks_and_their_children():
    candidates, plan_, _, problems = _problems({})
    assert problems == [] and plan_ == {}
    assert candidates[:5] == ["blocks.0", "blocks.0.ln_1", "blocks.0.attn", "blocks.0.ln_2", "blocks.0.mlp"]
    assert len(candidates) == 10


def test_selector_errors_name_key_value_and_fix():
    _, _, _, problems = _problems({"recompute": ["blocks.*.mlpp"], "offload": ["blocks.0"],
                                   "compress": ["blocks.0"], "quantize": ["blocks.1"],
                                   "keep": ["blocks.1.mlp"]})
    text = "\n".join(f"{p}: {m}" for p, m in problems)
    assert "xirang.activations.recompute[0]: 'blocks.*.mlpp' matches no module" in text
    assert "xirang.activations.offload: 'blocks.0' is also fixed by xirang.activations.compress" in text
    assert "quantize is lossy and 'blocks.1' is not marked tolerant" in text
    _, _, _, problems = _problems({"recompute": ["blocks.1"], "keep": ["blocks.1.mlp"]})
    assert "inside 'blocks.1', which xirang.activations.recompute recomputes" in problems[0][1]
    _, plan_, _, problems = _problems({"quantize": ["blocks.1.mlp"], "tolerant": ["blocks.1"]})
    assert problems == [] and plan_ == {"blocks.1.mlp": "quantize"}  # tolerance is inherited


def test_glob_selects_subtrees_not_substrings():
    _, plan_, _, problems = _problems({"recompute": ["blocks.*"]})
    assert plan_ == {"blocks.0": "recompute", "blocks.1": "recompute"} and problems == []
    _, _, _, problems = _problems({"offload": ["blocks.1"], "compress": ["blocks.10"]})
    assert problems[0][0] == "xirang.activations.compress[0]"


def test_deepspeed_activation_checkpointing_section_maps_to_options():
    _, plan_, settings, problems = _problems({"planner": False}, {"activation_checkpointing": {
        "cpu_checkpointing": True, "number_checkpoints": 1, "synchronize_checkpoint_boundary": True,
        "profile": True, "partition_activations": True}})
    assert problems == [] and plan_ == {"blocks.0": "recompute_offload"}
    assert settings == {"synchronize": True, "profile": True}
    _, plan_, _, _ = _problems({"planner": False, "keep": ["blocks.0"]}, {"activation_checkpointing": {}})
    assert plan_ == {"blocks.0": "keep", "blocks.1": "recompute"}  # the block's own lists win
    _, _, _, problems = _problems({"planner": False}, {"activation_checkpointing": {"cpu_checkpoint": True}})
    assert "unknown key 'cpu_checkpoint'" in problems[0][1]
    _, plan_, _, _ = _problems({"planner": False, "honour_deepspeed_checkpointing": False},
                               {"activation_checkpointing": {}})
    assert plan_ == {}


def test_config_rules():
    from xirang_ds.config.loader import validate_block
    from xirang_ds.config.validate import XirangConfigError

    with pytest.raises(XirangConfigError, match="budget_fraction: cannot be set together with budget"):
        validate_block({"activations": {"budget": "1GB", "budget_fraction": 0.5}})
    assert ActivationsConfig().planner


# ------------------------------------------------------------------------------------------------
# private APIs


def test_private_torch_apis_still_behave():
    from xirang_ds.compat.torch import current_saved_tensors_hooks, is_checkpoint_hook, sac_ignored_ops

    assert current_saved_tensors_hooks() is None
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert current_saved_tensors_hooks() is not None
    seen = []

    def f(t):
        seen.append(is_checkpoint_hook(current_saved_tensors_hooks()))
        return t.sin()

    x = torch.randn(3, requires_grad=True)
    torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False).sum().backward()
    assert seen == [True, True]
    assert torch.ops.aten.detach.default in sac_ignored_ops()


def test_window_category_peaks_sees_each_category_at_its_own_moment():
    """The bench's activations peak: activations highest at the end of forward even when the
    overall peak is later (here a big temporary after the activations are gone)."""
    t = MemoryTracker("cpu")
    with t:
        w = t.open_window()
        t.set_phase("forward")
        a = torch.empty(1000)  # 4000 bytes, alive at the end of forward: activations
        t.set_phase("backward")
        del a
        b = torch.empty(3000)  # 12000 bytes temporary: the overall peak
        del b
        t.set_phase("idle")
        peaks = w.category_peaks()
        assert w.peak_bytes == 12000 and w.report().by_category[ACTIVATIONS] == 0
        assert peaks[ACTIVATIONS] == 4000 and peaks["temporaries"] == 12000
        w.close()


def test_nested_options_innermost_wins_and_keep_shields():
    """offload on a block, compress or keep on a module inside it: the inner option applies there."""
    from xirang_ds.plugins.activations.wrapper import ModuleWrapper, Runtime

    model = build_model(BUILTIN_SPECS["gpt-tiny"]).float()
    x = torch.randint(0, 256, (4, 64))

    def grads():
        model.zero_grad()
        model(x, x).backward()
        return [p.grad.clone() for p in model.parameters()]

    ref = grads()
    tracker = MemoryTracker("cpu")
    rt = Runtime(torch.device("cpu"), 0, 1, 64, 0.01, tracker.host_tier, contextlib.nullcontext)
    rt.eligible.refresh(model)
    modules = dict(model.named_modules())
    block = ModuleWrapper("blocks.0", modules["blocks.0"], rt)
    inner = ModuleWrapper("blocks.0.mlp", modules["blocks.0.mlp"], rt)
    block.apply("offload")
    seen = []
    for option in ("keep", "compress"):
        inner.apply(option, passthrough=option == "keep")
        before = rt.offloader.offloaded_bytes
        got = grads()
        assert all(torch.equal(a, b) for a, b in zip(ref, got))
        seen.append(rt.offloader.offloaded_bytes - before)
    inner.apply(None)  # covered: follows the block
    before = rt.offloader.offloaded_bytes
    grads()
    covered = rt.offloader.offloaded_bytes - before
    # the mlp's tensors (fc_in input and output, gelu output) are what the inner option kept from offload
    assert seen[0] == seen[1] < covered
    block.remove()
    inner.remove()
    assert "forward" not in vars(modules["blocks.0"]) and "forward" not in vars(modules["blocks.0.mlp"])


def test_measurement_configs_are_valid():
    """The ds_configs docs/activations.md measures with: blocks valid, activations enabled."""
    import glob
    import json
    import os

    from xirang_ds.config import load_config

    files = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "activations", "*.json")))
    assert len(files) >= 10
    for path in files:
        with open(path, encoding="utf-8") as f:
            assert load_config(json.load(f)).activations.enabled, path


def test_tolerant_feed_forward_marks_each_blocks_mlp():
    from xirang_ds.plugins.activations.config import ActivationsConfig
    from xirang_ds.models import build_model, parse_model_spec
    from xirang_ds.plugins.activations.selection import tolerant_names

    model = build_model(parse_model_spec("gpt-tiny"))
    names = tolerant_names(model, ActivationsConfig(enabled=True, tolerant=("feed_forward",)))
    blocks = len(model.blocks)
    assert {f"blocks.{i}.mlp" for i in range(blocks)} <= names
    assert not any(n.startswith("blocks.0.attn") or n == "blocks.0" for n in names)
    # a model without feed-forward children: nothing tolerant, and no error
    plain = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2)]))
    assert tolerant_names(plain, ActivationsConfig(enabled=True, tolerant=("feed_forward",))) == frozenset()


# the host buffers of offload -------------------------------------------------------------------
def test_host_buffers_are_reused_by_size_class_whatever_the_length():
    """Variable sequence lengths: sizes that differ step to step share size-class buffers, so the
    host bytes held stop growing (with exact sizes every new length was a new pinned buffer)."""
    from xirang_ds.plugins.activations.storage import HostPool, host_size_class

    assert [host_size_class(n) for n in (1, 4096, 4097, 5000, 5121, 8192, 9000)] == [
        4096, 4096, 5120, 5120, 6144, 8192, 10240]
    assert all(n <= host_size_class(n) <= max(4096, n * 1.25) for n in range(1, 200_000, 997))
    pool = HostPool(pin=False)
    for length in range(1000, 1400, 7):  # 58 different lengths, one tensor in use at a time
        buf = pool.get(length * 64)
        assert buf.numel() == length * 64
        pool.put(buf)
    assert pool.allocated_bytes <= 2 * host_size_class(1400 * 64)  # a few classes, not 58 buffers
    assert pool.in_use_bytes == 0


def test_host_buffers_trim_to_the_budget_and_refuse_what_cannot_fit():
    from xirang_ds.plugins.activations.storage import HostPool

    pool = HostPool(pin=False, budget_bytes=64 * 1024)
    held = [pool.get(16 * 1024) for _ in range(3)]
    assert pool.allocated_bytes == 48 * 1024
    for buf in held:
        pool.put(buf)  # cached: the budget still holds them
    del held, buf  # returned, as the offloader drops its copies' buffers (a view kept would keep the bytes)
    assert pool.allocated_bytes == 48 * 1024
    big = pool.get(40 * 1024)  # a new class: the oldest cached buffers are dropped to make room
    assert big is not None and pool.allocated_bytes <= 64 * 1024 and pool.trimmed_bytes >= 16 * 1024
    assert pool.get(32 * 1024) is None  # 40 KiB in use + 32 KiB > 64 KiB: refused, nothing allocated
    assert (pool.refused, pool.refused_bytes) == (1, 32 * 1024)
    assert pool.allocated_bytes <= 64 * 1024


def test_offload_past_the_host_budget_keeps_the_bytes_on_the_device():
    import torch

    from xirang_ds.plugins.activations.offload import Offloader

    off = Offloader(torch.device("cpu"), host_budget_bytes=8192)
    first = torch.arange(2048, dtype=torch.float32)  # 8 KiB: fits
    second = torch.arange(1024, dtype=torch.float32)
    a = off.to_host(first.view(torch.uint8))
    b = off.to_host(second.view(torch.uint8))  # the budget is full: stays where it is
    assert a.host is not None and b.host is None and off.kept_on_device_bytes == 4096
    assert torch.equal(off.fetch(b).view(torch.float32), second)
    assert torch.equal(off.fetch(a).view(torch.float32), first)
    assert off.pool.in_use_bytes == 0


def test_head_choices_and_candidates():
    """An output head's profile offers keep (with the whole logits as its transient) and chunk at
    halving slice sizes; the planner takes the largest slice that fits; auto candidates add the head."""
    from xirang_ds.plugins.activations.planner import option_costs
    from xirang_ds.plugins.activations.profile import ModuleProfile

    head = ModuleProfile("lm_head", calls=1, saved_bytes=40_000_000, input_bytes=400_000, time_s=0.01,
                         chunk_calls=1, chunk_bytes=402_000, chunk_tokens=512, chunk_rows=384,
                         chunk_row_bytes=12 * 10_000, keep_transient_bytes=80_000_000)
    choices = option_costs(head, ("keep", "compress", "offload", "chunk"), False, 1e10, False)
    assert [c.option for c in choices] == ["keep"] + ["chunk"] * 5  # the loss is in its profile: no other option
    assert choices[0].transient_bytes == 80_000_000
    assert [c.rows for c in choices[1:]] == [384, 192, 96, 48, 24]
    assert all(c.device_bytes == 402_000 for c in choices[1:])
    node = Node("lm_head", choices, head.keep_bytes, order=0)
    chosen = plan([node], 402_000 + 100 * 12 * 10_000)  # room for a slice of 100 rows in backward
    assert chosen["lm_head"].rows == 96
    fixed = ModuleProfile(**{**head.__dict__, "chunk_fixed": 1})
    assert [c.rows for c in option_costs(fixed, ("chunk",), False, 1e10, False)] == [384]
    assert option_costs(ModuleProfile("x", calls=1, saved_bytes=10), ("chunk",), False, 1e10, False) == []

    model = build_model(BUILTIN_SPECS["gpt-tiny"])
    from xirang_ds.plugins.activations.head_loss import head_modules

    with_heads = find_candidates(model, ActivationsConfig(enabled=True), [],
                                 heads=lambda blocks: head_modules(model, blocks))
    assert with_heads[-1] == "lm_head" and "lm_head" not in find_candidates(model, ActivationsConfig(enabled=True), [])
