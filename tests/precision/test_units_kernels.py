"""The cast policy on plain PyTorch: dtypes ops really run in, exact fp32 outputs, equality with
torch.autocast, weight copies not kept for backward, saved-tensor hooks, removal, module rules."""
import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from xirang_ds import XirangConfigError
from xirang_ds.memory.tracker import MemoryTracker
from xirang_ds.models import BUILTIN_SPECS, build_model
from xirang_ds.plugins.precision.config import PrecisionConfig
from xirang_ds.plugins.precision.kernels import CastPolicy, install, installed_policy
from xirang_ds.plugins.precision.modules import match_modules
from xirang_ds.plugins.precision.op_lists import build_op_lists, torch_cpu_autocast_lists
from xirang_ds.plugins.precision.runtime import apply_precision

BF16 = torch.bfloat16


def policy(low=("default",), fp32=("default",), narrow=True) -> CastPolicy:
    found: list = []
    lists = build_op_lists(low, fp32, "p", found)
    assert found == []
    return CastPolicy(lists, "cpu", BF16, narrow)


@contextlib.contextmanager
def installed(p: CastPolicy, scope=contextlib.nullcontext):
    handle = install(p, scope)
    try:
        with torch.autocast("cpu", dtype=BF16, cache_enabled=False):
            yield handle
    finally:
        handle.remove()


class Executed(TorchDispatchMode):
    """Records each executed ATen op (below autocast and autograd) with its tensor inputs' dtypes."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        dtypes = tuple(a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point())
        self.calls.append((func.overloadpacket.__name__, dtypes))
        return func(*args, **(kwargs or {}))

    def dtypes_of(self, name: str) -> list[tuple]:
        return [d for n, d in self.calls if n == name]


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(16, 32)
        self.ln = nn.LayerNorm(32)
        self.head = nn.Linear(32, 10)

    def forward(self, x, y):
        h = F.gelu(self.ln(F.softmax(self.fc(x), -1)))
        return F.cross_entropy(self.head(h), y)


def run_small(p: CastPolicy) -> Executed:
    model, x, y = Small(), torch.randn(4, 16), torch.tensor([1, 2, 3, 4])
    rec = Executed()
    with installed(p), rec:
        model(x, y)
    return rec


def test_listed_ops_run_in_their_dtype():
    rec = run_small(policy())
    assert rec.dtypes_of("addmm") == [(BF16, BF16, BF16)] * 2  # fc and head: inputs, weight and bias in bf16
    assert rec.dtypes_of("_softmax") == [(torch.float32,)]
    assert rec.dtypes_of("native_layer_norm") == [(torch.float32,) * 3]
    assert rec.dtypes_of("gelu") == [(torch.float32,)]  # not listed: follows its fp32 input (layer_norm's output)
    assert rec.dtypes_of("_log_softmax") == [(torch.float32,)] and rec.dtypes_of("nll_loss_forward") == [(torch.float32,)]


def test_edited_lists_move_ops():
    rec = run_small(policy(low=("default", "-linear", "gelu"), fp32=("default", "-layer_norm", "-native_layer_norm")))
    assert rec.dtypes_of("addmm") == [(torch.float32,) * 3] * 2  # linear decides for the addmm it calls
    assert rec.dtypes_of("native_layer_norm") == [(torch.float32,) * 3]  # follows: softmax's output is fp32
    assert rec.dtypes_of("gelu") == [(BF16,)]


def test_fp32_listed_outputs_equal_fp32_exactly():
    torch.manual_seed(1)
    x = torch.randn(8, 64).to(BF16)
    w, b, y = torch.randn(64), torch.randn(64), torch.randint(0, 64, (8,))
    with installed(policy()):
        got = [F.softmax(x, -1), F.log_softmax(x, -1), F.layer_norm(x, (64,), w, b), F.cross_entropy(x, y),
               x.exp(), x.sum(-1), x.pow(2.0)]
    ref = [F.softmax(x.float(), -1), F.log_softmax(x.float(), -1), F.layer_norm(x.float(), (64,), w, b),
           F.cross_entropy(x.float(), y), x.float().exp(), x.float().sum(-1), x.float().pow(2.0)]
    for g, r in zip(got, ref):
        assert g.dtype == torch.float32 and torch.equal(g, r)


def gpt_step(model, x, mode):
    for p in model.parameters():
        p.grad = None
    with mode:
        loss = model(x, x)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_autocasts_own_lists_give_torch_autocasts_results_bit_for_bit():
    """With PyTorch's CPU lists, the kernels (weight copies remade in backward) reproduce
    torch.autocast exactly: same loss, same gradients."""
    model = build_model(BUILTIN_SPECS["llama-tiny"])
    x = torch.randint(0, 256, (2, 64))
    native = gpt_step(model, x, torch.autocast("cpu", dtype=BF16))
    ours = gpt_step(model, x, installed(CastPolicy(torch_cpu_autocast_lists(), "cpu", BF16)))
    assert torch.equal(native[0], ours[0])
    for a, b in zip(native[1], ours[1]):
        assert torch.equal(a, b)


def test_only_listed_ops_reach_python(monkeypatch):
    """The hot path's Python: a GPT's forward and backward call a Python kernel once per call of a
    listed op it makes (linear, layer_norm, attention, the loss) and never for the rest (embedding,
    gelu, add, dropout, views, every backward op): those stay PyTorch's autocast fallthrough."""
    import collections

    from xirang_ds.plugins.precision import kernels

    calls: collections.Counter = collections.Counter()
    make = kernels._make_kernel

    def counting(op, kind, inst):
        kernel = make(op, kind, inst)

        def counted(*args, **kwargs):
            calls[op.__name__] += 1
            return kernel(*args, **kwargs)
        return counted

    monkeypatch.setattr(kernels, "_make_kernel", counting)
    spec = BUILTIN_SPECS["gpt-tiny"]
    model = build_model(spec)
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    norms = sum(isinstance(m, nn.LayerNorm) for m in model.modules())
    gpt_step(model, torch.randint(0, spec.vocab, (2, spec.seq)), installed(policy()))
    assert dict(calls) == {"linear.default": linears, "layer_norm.default": norms,
                           "scaled_dot_product_attention.default": spec.layers,
                           "cross_entropy_loss.default": 1}


def live_bf16_weight_copies(tracker: MemoryTracker, model: nn.Module) -> int:
    shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    return sum(1 for r in tracker.live_records() if r.dtype == "bfloat16" and r.shape in shapes)


def test_weight_copies_are_not_kept_for_backward():
    model = build_model(BUILTIN_SPECS["gpt-tiny"])
    x = torch.randint(0, 256, (2, 64))
    kept = {}
    for name, mode in (("native", torch.autocast("cpu", dtype=BF16, cache_enabled=False)),
                       ("ours", installed(policy()))):
        tracker = MemoryTracker("cpu")
        with tracker, mode:
            loss = model(x, x)
        kept[name] = live_bf16_weight_copies(tracker, model)
        loss.backward()
    assert kept["native"] >= 9  # qkv, proj, fc_in, fc_out per block and lm_head: saved in bf16 until backward
    assert kept["ours"] == 0


def test_weight_copies_counted_as_parameters_and_remade_in_backward():
    model = build_model(BUILTIN_SPECS["gpt-tiny"])
    x = torch.randint(0, 256, (2, 64))
    tracker = MemoryTracker("cpu")
    tracker.seed(list(model.parameters()), "parameters")
    with tracker:
        with installed(policy(), lambda: tracker.scope("parameters")):
            loss = model(x, x)
        after_forward = [r for r in tracker.records if r.category == "parameters" and r.dtype == "bfloat16"]
        loss.backward()
    remade = [r for r in tracker.records if r.category == "parameters" and r.dtype == "bfloat16"]
    assert after_forward and all(r.freed is not None for r in after_forward)  # made and freed within forward
    assert len(remade) > len(after_forward)  # made again in backward
    assert all(r.freed is not None for r in remade)


def test_narrow_saved_upcast_halves_saved_bytes_with_identical_gradients():
    results = {}
    for narrow in (True, False):
        torch.manual_seed(0)
        a = torch.randn(64, 256, requires_grad=True)
        w = torch.randn(256, requires_grad=True)
        tracker = MemoryTracker("cpu")
        with installed(policy(narrow=narrow)), tracker:
            x = (a * 2).to(BF16)  # a 16-bit activation
            before = tracker.live_bytes
            y = F.layer_norm(x, (256,), w)
            saved = tracker.live_bytes - before - y.untyped_storage().nbytes()
        y.sum().backward()
        results[narrow] = (saved, a.grad, w.grad)
    assert results[False][0] - results[True][0] == 64 * 256 * 4  # the fp32 copy of x is not kept
    assert torch.equal(results[True][1], results[False][1]) and torch.equal(results[True][2], results[False][2])


def test_in_place_change_of_a_narrow_saved_source_is_a_clear_error():
    a = torch.randn(8, 32, requires_grad=True)
    with installed(policy()):
        x = (a * 2).to(BF16)
        y = F.layer_norm(x, (32,))
    x.add_(1)
    with pytest.raises(RuntimeError, match="narrow_saved_upcasts to false"):
        y.sum().backward()


def test_outer_saved_tensor_hooks_still_get_the_other_tensors():
    packed = []

    def pack(t):
        packed.append(t.dtype)
        return t

    lin = nn.Linear(32, 32)
    x = torch.randn(4, 32, requires_grad=True)
    with installed(policy()), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = lin(x)
    y.sum().backward()
    assert packed == [BF16]  # the bf16 input reached the outer hook; the weight copy did not


def test_removal_restores_torch_autocast():
    x = torch.randn(4, 4).to(BF16)
    with installed(policy()) as handle:
        assert F.softmax(x, -1).dtype == torch.float32
        kinds = handle.kinds
    assert kinds["aten::softmax.int"] == "fp32" and kinds["aten::mm"] == "low" and kinds["aten::cat"] == "widest"
    assert installed_policy("cpu") is None
    with torch.autocast("cpu", dtype=BF16):
        assert F.softmax(x, -1).dtype == BF16  # PyTorch's CPU autocast leaves softmax alone
        assert torch.cat([x, x.float()]).dtype == torch.float32


def test_one_policy_per_device_and_process():
    first = install(policy(), contextlib.nullcontext)
    try:
        second = install(policy(), contextlib.nullcontext)  # the same policy is shared
        with pytest.raises(RuntimeError, match="another xirang precision policy is active for cpu"):
            install(policy(low=("default", "gelu")), contextlib.nullcontext)
        second.remove()
        assert installed_policy("cpu") is not None
    finally:
        first.remove()
    assert installed_policy("cpu") is None


def test_globs_match_full_names_only():
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(21))
    names, found = match_modules(model, ("layers.2",), "p")
    assert names == ["layers.2"] and found == []
    names, _ = match_modules(model, ("layers.2*",), "p")
    assert names == ["layers.2", "layers.20"]
    _, found = match_modules(model, ("layer.2", "layers.*"), "p")
    assert found == [("p[0]", "glob 'layer.2' matches no module (globs match full names, like "
                               "\"blocks.*.ln_1\"); close names: layers.2, layers.20, layers.12")]


def test_fp32_module_runs_in_fp32_and_the_rest_does_not():
    model, x, y = Small(), torch.randn(4, 16), torch.tensor([1, 2, 3, 4])
    handle = apply_precision(model, PrecisionConfig(fp32_modules=("head",)))
    rec = Executed()
    try:
        with rec:
            loss = model(x, y)
        loss.backward()
    finally:
        handle.remove()
    assert rec.dtypes_of("addmm")[:2] == [(BF16, BF16, BF16), (torch.float32,) * 3]  # fc, head
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    assert "forward" not in vars(model) and "forward" not in vars(model.head)


def test_apply_precision_rejects_16_bit_parameters_and_unmatched_globs():
    model = Small().to(BF16)
    with pytest.raises(XirangConfigError) as info:
        apply_precision(model, PrecisionConfig(fp32_modules=("nope",)))
    paths = [p for p, _ in info.value.problems]
    assert paths == ["xirang.precision", "xirang.precision.fp32_modules[0]"]
    assert "6 parameter(s) are not fp32 (first: fc.weight, torch.bfloat16)" in info.value.problems[0][1]


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_recompute_gives_identical_results(reentrant):
    """torch.utils.checkpoint re-enters autocast for the recompute, so the lists and the remade
    weight copies apply there too: same loss and gradients as without recompute."""
    from torch.utils.checkpoint import checkpoint

    model = build_model(BUILTIN_SPECS["gpt-tiny"])
    x = torch.randint(0, 256, (2, 64))
    autocast = torch.autocast("cpu", dtype=BF16, cache_enabled=False)
    handle = install(policy(), contextlib.nullcontext)  # installed through backward, as the plugin keeps it
    try:
        plain = gpt_step(model, x, autocast)
        for block in model.blocks:
            block.forward = (lambda f: (lambda h: checkpoint(f, h, use_reentrant=reentrant)))(block.forward)
        recomputed = gpt_step(model, x, autocast)
    finally:
        handle.remove()
    assert torch.equal(plain[0], recomputed[0])
    assert all(torch.equal(a, b) for a, b in zip(plain[1], recomputed[1]))
