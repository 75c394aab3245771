"""What an on-demand restore holds at once in backward (`saved_nodes.restore_peak`, the planner's transient of
offload and of the codecs): the profile's ``restore_bytes`` equals, to the byte, the most restored bytes alive
at once while the module's backward runs with every saved storage offloaded, on modules whose nodes save one
storage each, two at once, outputs after inputs, and one storage for several nodes."""
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from xirang_ds.memory.device_profile import PROFILES
from xirang_ds.plugins.activations.handlers import OffloadHandler
from xirang_ds.plugins.activations.offload import Offloader
from xirang_ds.plugins.activations.profile import Profiler
from xirang_ds.plugins.activations.saved_nodes import restore_peak
from xirang_ds.plugins.activations.saved import Eligibility
from xirang_ds.plugins.activations.storage import PayloadStorage


class _Attention(nn.Module):
    """q @ k^T saves two activations in one node; softmax saves its output; q, k, v are views of one storage
    that three nodes save."""

    def __init__(self, width: int = 32, heads: int = 4):
        super().__init__()
        self.qkv, self.out, self.heads = nn.Linear(width, 3 * width), nn.Linear(width, width), heads

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-2, -1) / (c // self.heads) ** 0.5, dim=-1)
        return self.out((att @ v).transpose(1, 2).reshape(b, t, c))


class _Block(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(width), _Attention(width)
        self.ln_2, self.fc, self.proj = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class _Gated(nn.Module):
    """SwiGLU: silu(a) * b saves a, silu(a) and b across two nodes."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.up, self.gate, self.down = nn.Linear(width, 96), nn.Linear(width, 96), nn.Linear(96, width)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


MODULES = {
    "mlp": lambda: nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)),
    "attention": _Attention,
    "block": _Block,
    "gated": _Gated,
}


class _Counting(OffloadHandler):
    """Offloads, and counts the restored bytes alive during backward."""

    def __init__(self):
        super().__init__(Offloader(torch.device("cpu")))
        self.live = self.peak = 0

    def restore(self, copy, dtype, numel, keep):
        flat = super().restore(copy, dtype, numel, keep)
        nbytes = flat.untyped_storage().nbytes()
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(flat.untyped_storage(), self._freed, nbytes)
        return flat

    def _freed(self, nbytes):
        self.live -= nbytes


@pytest.mark.parametrize("name", sorted(MODULES))
def test_profile_restore_bytes_is_the_most_backward_holds_back_at_once(name):
    torch.manual_seed(0)
    model = MODULES[name]()
    x = torch.randn(2, 8, 32, requires_grad=True)
    eligible = Eligibility("cpu", 0)
    eligible.refresh(model)
    handler = _Counting()
    profiler = Profiler(eligible, handler, PayloadStorage(), frozenset(), (), 64, 0.0, PROFILES["cpu"])
    with profiler.run_pass(), profiler.frame("m", (x,), {}):
        y = model(x)
    y.square().sum().backward()
    p = profiler.combined()["m"]
    assert handler.peak > 0
    assert p.restore_bytes == handler.peak, (name, p.restore_bytes, handler.peak, p.largest_bytes, p.saved_bytes)
    assert p.restore_bytes <= p.saved_bytes


def test_restore_peak_frees_before_it_restores_at_one_position():
    assert restore_peak([]) == 0
    assert restore_peak([(1, 1, 10), (2, 2, 20)]) == 20  # one node after the other
    assert restore_peak([(1, 3, 10), (2, 2, 20)]) == 30  # held across the node between
    assert restore_peak([(1, 2, 10), (3, 4, 20), (2, 3, 5)]) == 25
