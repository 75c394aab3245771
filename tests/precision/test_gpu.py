"""The precision policy on CUDA (skipped without a GPU): AutocastCUDA kernels, dtypes, and the
allocator's own figure for weight copies not kept between forward and backward."""
import contextlib

import pytest
import torch

from xirang_ds.models import BUILTIN_SPECS, build_model
from xirang_ds.plugins.precision.kernels import CastPolicy, install
from xirang_ds.plugins.precision.op_lists import build_op_lists

pytestmark = pytest.mark.gpu


def _policy(dtype: torch.dtype) -> CastPolicy:
    return CastPolicy(build_op_lists(("default",), ("default",), "p", []), "cuda", dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_lists_and_weight_copies(dtype):
    model = build_model(BUILTIN_SPECS["gpt-small"]).cuda()
    x = torch.randint(0, 256, (8, 128), device="cuda")
    after_forward = {}
    for name, mode in (("native", torch.autocast("cuda", dtype=dtype, cache_enabled=False)), ("ours", None)):
        handle = install(_policy(dtype), contextlib.nullcontext) if mode is None else None
        try:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            with mode or torch.autocast("cuda", dtype=dtype, cache_enabled=False):
                logits = model(x)
                probs = torch.softmax(logits, -1)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x.flatten())
            torch.cuda.synchronize()
            after_forward[name] = torch.cuda.memory_allocated() - base
            if mode is None:
                assert logits.dtype == dtype and probs.dtype == torch.float32  # softmax is fp32-listed
            loss.backward()
            assert all(p.grad.dtype == torch.float32 for p in model.parameters())
            model.zero_grad(set_to_none=True)
            del logits, probs, loss
        finally:
            if handle is not None:
                handle.remove()
    linear_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    # autocast keeps a 16-bit copy of every linear weight for backward; the plugin keeps none
    assert after_forward["native"] - after_forward["ours"] >= 2 * linear_weights * 0.9
