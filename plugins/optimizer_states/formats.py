"""Storage formats of one Adam moment: how to make its zeros, decode a chunk, encode it back.

The optimizer (`optimizer.py`) owns the bookkeeping and the update math (`update.py`); a format
only knows its buffers, the way torchao's ``subclass_8bit.py``/``subclass_4bit.py`` only supply
their zeros. Buffers are plain tensors kept in ``optimizer.state[p]`` under
``"<moment>"`` (fp32, bf16) or ``"<moment>_codes"`` and ``"<moment>_scales"`` (int8, int4), so
DeepSpeed saves them per rank with the optimizer's ``state_dict`` and the memory tracker counts
them like any state tensor.

Work is done in chunks of whole blocks: ``decode`` returns an fp32 chunk, ``encode`` stores one.
For fp32 the chunk is a view of the state itself, so the update runs in place and equals
``torch.optim.AdamW`` bit for bit; quantized formats decode into temporaries of chunk size only.
"""
from __future__ import annotations

import abc
import math
from typing import Callable, NamedTuple, Optional, Union

import torch

from xirang_ds.plugins.grad_release.stochastic import random_bits
from xirang_ds.plugins.optimizer_states.config import STATE_DTYPE_ORDER
from xirang_ds.plugins.optimizer_states.qmaps import (
    FIRST_MOMENT_4BIT,
    FIRST_MOMENT_8BIT,
    SECOND_MOMENT_4BIT,
    SECOND_MOMENT_8BIT,
    CompandingMap,
)

MOMENTS = ("exp_avg", "exp_avg_sq")
"""State keys of Adam's moments, as ``torch.optim.AdamW`` names them."""

Buffers = dict[str, torch.Tensor]


class Draws(NamedTuple):
    """Stochastic rounding's noise for a tensor's states (counter-based: `stochastic.random_bits`): value
    ``j`` of a chunk encoded at ``start`` draws element ``offset + start + j``'s bits under ``keys``, in
    one stream per moment, so the draws do not depend on the chunking, eager or compiled.

    Attributes:
        keys: `stochastic.noise_keys` of the optimizer's seed and the step.
        offset: the index of the tensor's element 0 (an int; a 0-d int64 tensor in a compiled graph).
        drawn: ``None``, or the chunk's draws already made (`draw_chunk`: both moments, int32, at the
            format's `StateFormat.draw_bits`), which `bits` then returns.
    """

    keys: torch.Tensor
    offset: Union[int, torch.Tensor]
    drawn: Optional[torch.Tensor] = None

    def bits(self, moment: str, start: int, n: int, bits: int) -> torch.Tensor:
        """``n`` uniform ``bits``-bit integers of ``moment``'s values from ``start`` on."""
        if self.drawn is not None:
            return self.drawn[MOMENTS.index(moment), start:start + n]
        return random_bits(self.keys, self.offset + start, n, bits, stream=1 + MOMENTS.index(moment))


def draw_chunk(keys: torch.Tensor, offset: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Both moments' draws of ``n`` elements from ``offset`` (what `Draws.bits` draws), as a ``(2, n)`` int32
    tensor."""
    return torch.stack([random_bits(keys, offset, n, bits, stream=1 + i).to(torch.int32) for i in range(len(MOMENTS))])

Empty = Callable[[int, torch.dtype, torch.device], torch.Tensor]
"""``empty(numel, dtype, device)``: where quantized buffers are allocated (the memory pool)."""


def _empty(empty: Optional[Empty], numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if empty is None or device.type == "meta":
        return torch.empty(numel, dtype=dtype, device=device)
    return empty(numel, dtype, device)


class StateFormat(abc.ABC):
    """Base of the storage formats. Subclasses set `name`, `bits` and the methods below.

    Attributes:
        name: the dtype word of the config (``"fp32"``, ``"bf16"``, ``"int8"``, ``"int4"``).
        block_size: elements per scale (1 for unquantized formats); chunks are multiples of it.
    """

    name: str = ""
    block_size: int = 1
    draw_bits: int = 0
    """Bits of noise an element's stochastic rounding draws."""

    @abc.abstractmethod
    def zeros(self, moment: str, numel: int, device: torch.device, empty: Optional[Empty] = None) -> Buffers:
        """Zero-valued buffers for ``numel`` elements of ``moment``, keyed by state key (quantized
        formats allocate them through ``empty`` when given)."""

    @abc.abstractmethod
    def decode(self, moment: str, buffers: Buffers, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` as fp32 (a view for fp32, else a new tensor)."""

    @abc.abstractmethod
    def encode(self, moment: str, values: torch.Tensor, buffers: Buffers, start: int,
               draws: Optional[Draws] = None) -> None:
        """Store fp32 ``values`` as elements ``[start, start + len)``; ``values`` may be consumed.

        Args:
            draws: the noise of stochastic rounding; ``None`` rounds to nearest.
        """

    def keys(self, moment: str) -> tuple[str, ...]:
        """State keys this format stores for ``moment``."""
        return (moment,)

    def window(self, moment: str, buffers: Buffers, start: int, end: int) -> Buffers:
        """Views of the buffers that hold elements ``[start, end)`` (``start`` on a block boundary):
        ``decode(moment, window, 0, end - start)`` and ``encode(moment, values, window, 0)`` then
        read and write that chunk alone (the fused kernel's inputs)."""
        return {moment: buffers[moment].view(-1)[start:end]}

    @staticmethod
    def nbytes(buffers: Buffers) -> int:
        """Bytes held by the buffers."""
        return sum(t.numel() * t.element_size() for t in buffers.values())

    def state_bytes(self, numel: int) -> int:
        """Bytes both moments of ``numel`` elements hold in this format (measured on the meta device)."""
        return sum(self.nbytes(self.zeros(m, numel, torch.device("meta"))) for m in MOMENTS) if numel else 0


class Fp32Format(StateFormat):
    """Full precision: exactly ``torch.optim.AdamW``'s ``exp_avg`` and ``exp_avg_sq``."""

    name = "fp32"

    def zeros(self, moment: str, numel: int, device: torch.device, empty: Optional[Empty] = None) -> Buffers:
        return {moment: torch.zeros(numel, dtype=torch.float32, device=device)}

    def decode(self, moment: str, buffers: Buffers, start: int, end: int) -> torch.Tensor:
        return buffers[moment].view(-1)[start:end]  # torch.optim.AdamW keeps the parameter's shape

    def encode(self, moment: str, values: torch.Tensor, buffers: Buffers, start: int,
               draws: Optional[Draws] = None) -> None:
        dst = buffers[moment].view(-1)[start:start + values.numel()]
        if dst.data_ptr() != values.data_ptr():
            dst.copy_(values)


class Bf16Format(StateFormat):
    """bfloat16 storage: 2 bytes per element, fp32's exponent range, 8 bits of mantissa."""

    name = "bf16"
    draw_bits = 16

    def zeros(self, moment: str, numel: int, device: torch.device, empty: Optional[Empty] = None) -> Buffers:
        return {moment: torch.zeros(numel, dtype=torch.bfloat16, device=device)}

    def decode(self, moment: str, buffers: Buffers, start: int, end: int) -> torch.Tensor:
        return buffers[moment].view(-1)[start:end].float()

    def encode(self, moment: str, values: torch.Tensor, buffers: Buffers, start: int,
               draws: Optional[Draws] = None) -> None:
        dst = buffers[moment].view(-1)[start:start + values.numel()]
        if draws is None:
            dst.copy_(values)
            return
        # Stochastic rounding to bf16: add uniform noise below the kept 16 bits, then truncate
        # (torchao's _fp32_to_bf16_sr does the same with a select).
        bits = values.view(torch.int32)
        bits.add_(draws.bits(moment, start, values.numel(), self.draw_bits).to(torch.int32)).bitwise_and_(-65536)
        dst.copy_(bits.view(torch.float32))


class BlockQuantFormat(StateFormat):
    """Block-wise quantization: one fp32 scale per ``block_size`` elements and integer codes.

    ``bits == 8``: one code per byte. ``bits == 4``: two codes per byte; within a block, byte
    ``j`` holds code ``j`` in its high nibble and code ``j + block_size // 2`` in its low nibble, so
    packing and unpacking touch contiguous halves (no strided access). The element count is padded
    to whole blocks; padding elements are zero and never read back.

    Args:
        bits: 8 or 4.
        block_size: elements per scale; a multiple of 32 (of 2 for packing at 4 bits).
        maps: the quantization map of each moment.
    """

    def __init__(self, bits: int, block_size: int, maps: dict[str, CompandingMap]):
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8; got {bits}")
        if block_size <= 0 or block_size % 2:
            raise ValueError(f"block_size must be a positive even number; got {block_size}")
        self.bits = bits
        self.block_size = block_size
        self.draw_bits = 24  # torch.rand's
        self.maps = maps
        self.name = f"int{bits}"

    def keys(self, moment: str) -> tuple[str, ...]:
        return (f"{moment}_codes", f"{moment}_scales")

    def window(self, moment: str, buffers: Buffers, start: int, end: int) -> Buffers:
        b = self.block_size
        if start % b:
            raise ValueError(f"chunks must start on a block boundary; start={start}, block_size={b}")
        codes_key, scales_key = self.keys(moment)
        first, last = start // b, math.ceil(end / b)
        per_byte = 8 // self.bits
        return {codes_key: buffers[codes_key][first * b // per_byte:last * b // per_byte],
                scales_key: buffers[scales_key][first:last]}

    def zeros(self, moment: str, numel: int, device: torch.device, empty: Optional[Empty] = None) -> Buffers:
        blocks = math.ceil(numel / self.block_size)
        signed = self.maps[moment].signed and self.bits == 8
        codes = _empty(empty, blocks * self.block_size * self.bits // 8, torch.int8 if signed else torch.uint8, device)
        codes.fill_(0x88 if self.bits == 4 and self.maps[moment].signed else 0)  # 4 bits: code 0 is stored as 8
        codes_key, scales_key = self.keys(moment)
        return {codes_key: codes, scales_key: _empty(empty, blocks, torch.float32, device).zero_()}

    def decode(self, moment: str, buffers: Buffers, start: int, end: int) -> torch.Tensor:
        codes_key, scales_key = self.keys(moment)
        b = self.block_size
        first, last = start // b, math.ceil(end / b)
        per_byte = 8 // self.bits
        raw = buffers[codes_key][first * b // per_byte:last * b // per_byte]
        qmap = self.maps[moment]
        if self.bits == 8:
            codes = raw.view(last - first, b)
        else:
            packed = raw.view(last - first, b // 2)
            codes = torch.cat((packed >> 4, packed & 0x0F), dim=1).to(torch.int8)
            if qmap.signed:
                codes.sub_(8)
        values = qmap.decode(codes).mul_(buffers[scales_key][first:last].unsqueeze(1))
        return values.view(-1)[start - first * b:end - first * b]

    def encode(self, moment: str, values: torch.Tensor, buffers: Buffers, start: int,
               draws: Optional[Draws] = None) -> None:
        codes_key, scales_key = self.keys(moment)
        b = self.block_size
        if start % b:
            raise ValueError(f"chunks must start on a block boundary; start={start}, block_size={b}")
        n = values.numel()
        blocks = math.ceil(n / b)
        if n % b:  # the tensor's last block: pad with zeros (a zero never raises the scale)
            values = torch.nn.functional.pad(values, (0, blocks * b - n))
        qmap = self.maps[moment]
        x = values.view(blocks, b)
        scale = (x.abs() if qmap.signed else x).amax(dim=1, keepdim=True)
        first = start // b
        buffers[scales_key][first:first + blocks].copy_(scale.view(-1))
        x = x.div_(scale.clamp_(min=torch.finfo(torch.float32).tiny))
        uniform = None if draws is None else draws.bits(moment, start, x.numel(), self.draw_bits).to(torch.float32).mul_(
            2.0 ** -24).view(x.shape)  # torch.rand's 24 bits
        codes = qmap.encode(x, uniform)
        dst = buffers[codes_key]
        if self.bits == 8:
            dst[first * b:(first + blocks) * b].view(blocks, b).copy_(codes)
            return
        if qmap.signed:
            codes.add_(8)
        codes = codes.to(torch.uint8)
        packed = (codes[:, :b // 2] << 4).bitwise_or_(codes[:, b // 2:])
        dst[first * b // 2:(first + blocks) * b // 2].view(blocks, b // 2).copy_(packed)


def make_format(name: str, int8_block_size: int = 256, int4_block_size: int = 128) -> StateFormat:
    """The format of a config dtype word.

    Raises:
        ValueError: an unknown name (the config validator reports it first, with its path).
    """
    if name == "fp32":
        return Fp32Format()
    if name == "bf16":
        return Bf16Format()
    if name == "int8":
        return BlockQuantFormat(8, int8_block_size, {"exp_avg": FIRST_MOMENT_8BIT, "exp_avg_sq": SECOND_MOMENT_8BIT})
    if name == "int4":
        return BlockQuantFormat(4, int4_block_size, {"exp_avg": FIRST_MOMENT_4BIT, "exp_avg_sq": SECOND_MOMENT_4BIT})
    raise ValueError(f"unknown optimizer-state format {name!r}; one of fp32, bf16, int8, int4")


def format_of(state: dict) -> str:
    """The format name of a parameter's state dict (``"fp32"`` for ``torch.optim.AdamW`` state).

    The state holds the format as its index in ``STATE_DTYPE_ORDER`` (an int: ``torch.optim``'s
    ``load_state_dict`` rebuilds strings character by character).
    """
    if "format" in state:
        return STATE_DTYPE_ORDER[int(state["format"])]
    if "exp_avg_codes" in state:
        return "int4" if state["exp_avg_codes"].dtype == torch.uint8 else "int8"
    if "exp_avg" in state and state["exp_avg"].dtype == torch.bfloat16:
        return "bf16"
    return "fp32"


def update_error(reference: tuple[torch.Tensor, torch.Tensor], fmt: StateFormat, buffers: dict, start: int,
                 end: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Squared norms of (stored direction - true direction) and of the true direction (float64
    device scalars: no host sync)."""
    m, v = reference
    true = m / (v.sqrt_() + eps)
    stored = fmt.decode("exp_avg", buffers, start, end) / (fmt.decode("exp_avg_sq", buffers, start, end).sqrt_() + eps)
    return stored.sub_(true).double().square().sum(), true.double().square().sum()


def encode_with_error(src: StateFormat, dst: StateFormat, buffers: dict, out: dict, numel: int, chunk: int,
                      draws: Optional[Draws], eps: float) -> float:
    """Encode the moments in ``buffers`` (format ``src``) into ``out`` (format ``dst``), ``chunk``
    elements at a time; return the relative error of the Adam update direction ``dst`` gives,
    ``|m'/(sqrt(v')+eps) - m/(sqrt(v)+eps)| / |m/(sqrt(v)+eps)|`` over the tensor (one host sync)."""
    sums = torch.zeros(2, dtype=torch.float64, device=next(iter(buffers.values())).device)
    for start in range(0, numel, chunk):
        end = min(numel, start + chunk)
        m = src.decode("exp_avg", buffers, start, end).clone()
        v = src.decode("exp_avg_sq", buffers, start, end).clone()
        reference = (m.clone(), v.clone())
        dst.encode("exp_avg", m, out, start, draws)
        dst.encode("exp_avg_sq", v, out, start, draws)
        du, u = update_error(reference, dst, out, start, end, eps)
        sums[0] += du
        sums[1] += u
    du, u = sums.tolist()
    return math.sqrt(du / u) if u > 0 else 0.0
