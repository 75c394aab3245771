"""Encodings of a saved storage's bytes: lossless, 8-bit block-quantized, and threshold-sparse.

Every codec takes a flat (1-D, contiguous) tensor and returns a `Payload` whose ``decode()``
gives a flat tensor of the same dtype and length back, or ``None`` when the encoding would not be
smaller (the tensor is then kept as it is).

What "lossless" means here: ``decode()`` returns the same bits, every element, signed zeros and
NaN payloads included, so gradients are bit-identical to the run without compression. Three
encodings qualify and the smallest that applies is used, checked per tensor at pack time:

* narrower float storage: an fp32 tensor whose every value survives a round trip through bf16
  (or fp16) bit for bit (upcasts of 16-bit values, masks, small integers) is stored in 16 bits;
  fp64 likewise in fp32;
* zero bitmask: when most elements are exact (+0.0) zeros, one bit per element plus the nonzero
  values (after ReLU, masked attention, padding);
* bools packed 8 per byte.

Lossy encodings, only for modules marked tolerant, with their stated bounds:

* ``quantize``: blocks of ``block_size`` elements share one fp32 scale ``max|x|/127``; each value is
  rounded to the nearest int8 multiple of the scale, so ``|x - x'| <= max|block| / 254`` before the
  result is cast back to the tensor's dtype (which adds at most its own rounding,
  ``2**-8 |x'|`` for bf16).
* ``sparsify``: values with ``|x| <= threshold * max|x|`` are dropped (decoded as 0), the rest kept
  exactly, so ``|x - x'| <= threshold * max|x|``.

Both bounds hold by construction on finite data; a tensor with inf or NaN has no finite scale or cutoff,
and the encoder raises `BoundExceeded` (found in the one host read each already makes per tensor), so
the caller stores it losslessly instead (`reserve.py`).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from xirang_ds.plugins.activations.storage import Lease, PayloadStorage

_ALIGN = 16
_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_NARROWER = {torch.float32: (torch.bfloat16, torch.float16), torch.float64: (torch.float32,)}
SPARSE_GAIN = 0.85
"""A bitmask encoding is used only when it is at most this fraction of the dense size."""


REASONS = ("non-finite values",)
"""Why a lossy encoding cannot meet its bound (`BoundExceeded.reason`; ranks agree on the index)."""


class BoundExceeded(ValueError):
    """A lossy encoding cannot meet its stated bound on this tensor.

    Attributes:
        kind: the encoding (``quantize``, ``sparsify``).
        reason: what broke it, one of `REASONS`.
    """

    def __init__(self, kind: str, reason: str):
        self.kind, self.reason = kind, reason
        super().__init__(f"{kind}: {reason}")


@dataclass(frozen=True)
class _Part:
    dtype: torch.dtype
    offset: int
    numel: int


class Payload:
    """An encoded flat tensor in one leased buffer.

    Attributes:
        kind: the encoding (``narrow``, ``zero_mask``, ``bits``, ``int8``, ``sparse``; ``raw``: the
            bytes unchanged, only ever in lent memory).
        dtype, numel: of the tensor it decodes to.
        nbytes: bytes of the encoding (the lease may be larger).
        lease: where the bytes are; read at decode time so an evicted payload still decodes.
    """

    __slots__ = ("kind", "dtype", "numel", "nbytes", "lease", "parts", "device", "meta")

    def __init__(self, kind: str, dtype: torch.dtype, numel: int, nbytes: int, lease: Lease,
                 parts: dict[str, _Part], device: torch.device, meta: Optional[dict] = None):
        self.kind, self.dtype, self.numel, self.nbytes = kind, dtype, numel, nbytes
        self.lease, self.parts, self.device, self.meta = lease, parts, device, meta or {}

    def part(self, name: str) -> torch.Tensor:
        p = self.parts[name]
        if not self.lease.readable:
            raise RuntimeError("xirang activations: a compressed tensor in lent memory was decoded twice; lent "
                               "memory is handed back at the first decode of a backward that does not retain "
                               "its graph")
        buf = self.lease.buffer
        if buf.device != self.device:  # evicted to host by the lender
            buf = buf.to(self.device, non_blocking=True)
        return buf[p.offset:p.offset + p.numel * p.dtype.itemsize].view(p.dtype)

    def decode(self) -> torch.Tensor:
        """The flat tensor (same dtype, length and, for lossless kinds, bits)."""
        return _DECODERS[self.kind](self)

    def release(self) -> None:
        self.lease.release()

    def __del__(self) -> None:
        self.lease.release()


def _carve(storage: PayloadStorage, device: torch.device, specs: list[tuple[str, torch.dtype, int]]
           ) -> tuple[Lease, dict[str, _Part], int]:
    parts, offset = {}, 0
    for name, dtype, numel in specs:
        offset = -(-offset // _ALIGN) * _ALIGN
        parts[name] = _Part(dtype, offset, numel)
        offset += numel * dtype.itemsize
    return storage.allocate(offset, device), parts, offset


def _payload(kind: str, flat: torch.Tensor, storage: PayloadStorage, specs: list[tuple[str, torch.dtype, int]],
             meta: Optional[dict] = None) -> Payload:
    lease, parts, nbytes = _carve(storage, flat.device, specs)
    return Payload(kind, flat.dtype, flat.numel(), nbytes, lease, parts, flat.device, meta)


# ------------------------------------------------------------------------------------------------
# bits


def pack_bits(mask: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A bool tensor packed 8 elements per byte (element ``i`` is bit ``i % 8`` of byte ``i // 8``)."""
    n = mask.numel()
    pad = (-n) % 8
    m = mask.reshape(-1).to(torch.uint8)
    if pad:
        m = torch.cat([m, m.new_zeros(pad)])
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=mask.device)
    packed = (m.view(-1, 8) * weights).sum(1, dtype=torch.uint8)
    if out is None:
        return packed
    return out.copy_(packed)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `pack_bits`: the first ``n`` bits as a bool tensor."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 1).view(-1)[:n].bool()


def bit_view(flat: torch.Tensor) -> torch.Tensor:
    """The same bytes as integers of the same width (for bit-exact comparisons)."""
    return flat.view(_INT_VIEW[flat.element_size()])


# ------------------------------------------------------------------------------------------------
# lossless


def lossless_plan(flat: torch.Tensor, chunk: Optional[int] = None) -> Optional[tuple[str, torch.dtype, int, int]]:
    """What `encode_lossless` makes of ``flat``: ``(kind, values dtype, nonzeros, bytes)`` (kind
    ``bits``, ``zero_mask`` or ``narrow``), or ``None`` when no encoding is smaller. Read ``chunk``
    elements at a time (default: at once): the same answer, with temporaries of one chunk."""
    n = flat.numel()
    if flat.dtype == torch.bool:
        return "bits", torch.uint8, 0, (n + 7) // 8
    if not (flat.is_floating_point() or flat.dtype in (torch.int32, torch.int64, torch.int16)):
        return None
    if flat.element_size() not in _INT_VIEW:
        return None
    narrowers = list(_NARROWER.get(flat.dtype, ()))
    # kept on the device and read once at the end: one host sync per tensor, not one per chunk and dtype
    found = torch.zeros(len(narrowers) + 1, dtype=torch.int64, device=flat.device)  # inexact chunks, nonzeros
    step = chunk or max(n, 1)
    for start in range(0, n, step):
        part = flat[start:start + step]
        bits = bit_view(part)
        for i, narrow in enumerate(narrowers):
            found[i] += (bit_view(part.to(narrow).to(flat.dtype)) != bits).any()
        found[-1] += torch.count_nonzero(bits)
    *inexact, nnz = found.tolist()
    values_dtype = next((narrow for narrow, bad in zip(narrowers, inexact) if not bad), flat.dtype)
    dense_bytes = n * values_dtype.itemsize
    sparse_bytes = (n + 7) // 8 + nnz * values_dtype.itemsize
    if sparse_bytes <= SPARSE_GAIN * dense_bytes:
        return "zero_mask", values_dtype, nnz, sparse_bytes
    if values_dtype != flat.dtype:
        return "narrow", values_dtype, nnz, dense_bytes
    return None


def encode_lossless(flat: torch.Tensor, storage: PayloadStorage) -> Optional[Payload]:
    """The smallest bit-exact encoding of ``flat`` (`lossless_plan`), or ``None`` when none is smaller."""
    plan = lossless_plan(flat)
    if plan is None:
        return None
    kind, values_dtype, nnz, _ = plan
    n = flat.numel()
    if kind == "bits":
        payload = _payload("bits", flat, storage, [("bits", torch.uint8, (n + 7) // 8)])
        pack_bits(flat, out=payload.part("bits"))
        return payload
    if kind == "zero_mask":
        nonzero = bit_view(flat) != 0
        payload = _payload("zero_mask", flat, storage, [("mask", torch.uint8, (n + 7) // 8),
                                                        ("values", values_dtype, nnz)])
        pack_bits(nonzero, out=payload.part("mask"))
        values = payload.part("values")
        if values_dtype == flat.dtype:
            torch.masked_select(flat, nonzero, out=values)
        else:
            values.copy_(torch.masked_select(flat, nonzero))
        return payload
    payload = _payload("narrow", flat, storage, [("values", values_dtype, n)])
    payload.part("values").copy_(flat)
    return payload


def _decode_narrow(p: Payload) -> torch.Tensor:
    return p.part("values").to(p.dtype)


def _decode_mask(p: Payload) -> torch.Tensor:
    mask = unpack_bits(p.part("mask"), p.numel)
    out = torch.zeros(p.numel, dtype=p.dtype, device=p.device)
    return out.masked_scatter_(mask, p.part("values").to(p.dtype))


def _decode_bits(p: Payload) -> torch.Tensor:
    return unpack_bits(p.part("bits"), p.numel)


# ------------------------------------------------------------------------------------------------
# lossy


CHUNK_ELEMENTS = 1 << 20
"""int8 encodes and decodes this many elements at a time, so its fp32 working copy stays small."""


def encode_int8(flat: torch.Tensor, storage: PayloadStorage, block_size: int) -> Optional[Payload]:
    """8-bit block quantization (see the module docstring for the bound); floats only.

    Raises:
        BoundExceeded: a block holds inf or NaN (no finite scale).
    """
    if not flat.is_floating_point():
        return None
    n = flat.numel()
    blocks = math.ceil(n / block_size)
    if blocks * (block_size + 4) >= n * flat.element_size():
        return None
    payload = _payload("int8", flat, storage, [("scale", torch.float32, blocks), ("q", torch.int8, blocks * block_size)],
                       meta={"block_size": block_size})
    scales, q = payload.part("scale"), payload.part("q").view(blocks, block_size)
    step = max(1, CHUNK_ELEMENTS // block_size)
    for first in range(0, blocks, step):
        last = min(blocks, first + step)
        lo, hi = first * block_size, min(n, last * block_size)
        x = torch.zeros((last - first) * block_size, dtype=torch.float32, device=flat.device)  # never an alias
        x[:hi - lo].copy_(flat[lo:hi])
        xb = x.view(-1, block_size)
        scale = xb.abs().amax(1).div_(127.0)
        scales[first:last].copy_(scale)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q[first:last].copy_(xb.div_(safe.unsqueeze(1)).round_().clamp_(-127, 127))
    if not bool(torch.isfinite(scales).all()):  # one host read per tensor, not one per chunk
        del payload, scales, q  # the payload's lease goes back before the caller stores the tensor otherwise
        raise BoundExceeded("quantize", REASONS[0])  # inf or NaN have no 8-bit scale
    return payload


def _decode_int8(p: Payload) -> torch.Tensor:
    block = p.meta["block_size"]
    scales, q = p.part("scale"), p.part("q").view(-1, block)
    out = torch.empty(p.numel, dtype=p.dtype, device=p.device)
    step = max(1, CHUNK_ELEMENTS // block)
    for first in range(0, q.shape[0], step):
        last = min(q.shape[0], first + step)
        lo, hi = first * block, min(p.numel, last * block)
        out[lo:hi].copy_((q[first:last].float() * scales[first:last].unsqueeze(1)).view(-1)[:hi - lo])
    return out


def int8_bound(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per-element bound ``max|block| / 254`` of `encode_int8` (before the cast to the dtype)."""
    n = flat.numel()
    blocks = math.ceil(n / block_size)
    x = flat.float().abs()
    pad = blocks * block_size - n
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    amax = x.view(blocks, block_size).amax(1)
    return (amax / 254.0).repeat_interleave(block_size)[:n]


def encode_sparse(flat: torch.Tensor, storage: PayloadStorage, threshold: float) -> Optional[Payload]:
    """Drop ``|x| <= threshold * max|x|`` and keep the rest exactly; floats only.

    Raises:
        BoundExceeded: the tensor holds inf or NaN (no finite cutoff; an inf one would drop every value).
    """
    if not flat.is_floating_point():
        return None
    n = flat.numel()
    if n:
        cutoff_t = flat.abs().max().double() * threshold
        keep = torch.where(cutoff_t > 0, flat.abs() > cutoff_t, bit_view(flat) != 0)
        cutoff, nnz = torch.stack([cutoff_t, keep.sum().double()]).tolist()  # one host read: the payload's size
        nnz = int(nnz)
        if not math.isfinite(cutoff):
            raise BoundExceeded("sparsify", REASONS[0])  # inf or NaN have no finite cutoff
    else:
        cutoff, keep, nnz = 0.0, bit_view(flat) != 0, 0
    if (n + 7) // 8 + nnz * flat.element_size() > SPARSE_GAIN * n * flat.element_size():
        return None
    payload = _payload("sparse", flat, storage, [("mask", torch.uint8, (n + 7) // 8), ("values", flat.dtype, nnz)],
                       meta={"cutoff": cutoff})
    pack_bits(keep, out=payload.part("mask"))
    torch.masked_select(flat, keep, out=payload.part("values"))
    return payload


# ------------------------------------------------------------------------------------------------
# raw (lent memory only)


def park_raw(flat: torch.Tensor, storage: PayloadStorage) -> Optional[Payload]:
    """The bytes of ``flat`` as they are, in memory a provider lends (``None`` when none is lent:
    a plain copy would only add bytes)."""
    n = flat.numel() * flat.element_size()
    lease = storage.lend(n, flat.device)
    if lease is None:
        return None
    payload = Payload("raw", flat.dtype, flat.numel(), n, lease, {"bytes": _Part(torch.uint8, 0, n)}, flat.device)
    payload.part("bytes").copy_(flat.reshape(-1).view(torch.uint8))
    return payload


def _decode_raw(p: Payload) -> torch.Tensor:
    return p.part("bytes").clone().view(p.dtype)  # a copy: the lent bytes go back right after


_DECODERS: dict[str, Callable[[Payload], torch.Tensor]] = {
    "narrow": _decode_narrow, "zero_mask": _decode_mask, "bits": _decode_bits, "int8": _decode_int8,
    "sparse": _decode_mask, "raw": _decode_raw,
}


# ------------------------------------------------------------------------------------------------
# trials (profiling)


@dataclass
class Trial:
    """What one encoding does to one tensor: its size, its cost and (lossy) its worst error.

    Attributes:
        nbytes: encoded bytes (the dense size when the encoding does not apply).
        seconds: encode plus decode time.
        error_ratio: max over elements of ``|x - x'| / bound`` (0 for lossless; <= 1 is in bound).
    """

    nbytes: int
    seconds: float
    error_ratio: float = 0.0


def trial(kind: str, flat: torch.Tensor, storage: PayloadStorage, block_size: int = 64, threshold: float = 0.0,
          synchronize: Callable[[], None] = lambda: None) -> Trial:
    """Encode and decode ``flat`` once with ``kind`` (``compress``, ``quantize``, ``sparsify``)."""
    dense = flat.numel() * flat.element_size()
    if kind == "compress" and flat.numel() > CHUNK_ELEMENTS:
        return _lossless_trial(flat, storage, synchronize)
    synchronize()
    start = time.perf_counter()
    try:
        if kind == "compress":
            payload = encode_lossless(flat, storage)
        elif kind == "quantize":
            payload = encode_int8(flat, storage, block_size)
        else:
            payload = encode_sparse(flat, storage, threshold)
    except BoundExceeded:  # priced at the dense size, as the run would store it losslessly
        payload = None
    if payload is None:
        synchronize()
        return Trial(dense, time.perf_counter() - start)
    out = payload.decode()
    synchronize()
    seconds = time.perf_counter() - start
    nbytes = payload.nbytes
    error = 0.0
    # the error check runs over chunks of whole blocks, so its fp32 temporaries stay a few MiB
    # however large the tensor (they count in the profiling passes' peak)
    step = max(block_size, (_CHECK_CHUNK // block_size) * block_size)
    if kind == "quantize":
        for start in range(0, flat.numel(), step):
            a, b = flat[start:start + step], out[start:start + step]
            bound = int8_bound(a, block_size)
            tol = bound + (a.float().abs() + bound) * _rounding(flat.dtype)
            err = (b.float() - a.float()).abs_().div_(tol.clamp_min_(torch.finfo(torch.float32).tiny))
            error = max(error, float(err.max()))
    elif kind == "sparsify":
        cutoff = payload.meta["cutoff"]
        err = 0.0
        for start in range(0, flat.numel(), step):
            err = max(err, float((out[start:start + step].float() - flat[start:start + step].float()).abs().max()))
        error = err / cutoff if cutoff > 0 else (0.0 if err == 0 else math.inf)
    del payload, out
    return Trial(nbytes, seconds, error)


_CHECK_CHUNK = 1 << 18
"""Elements per chunk of `trial`'s error check."""


def _lossless_trial(flat: torch.Tensor, storage: PayloadStorage, synchronize: Callable[[], None]) -> Trial:
    """`trial` of ``compress`` on a large tensor with temporaries of one chunk: its bytes exactly
    (`lossless_plan` read a chunk at a time), its time as the chunks' encode and decode (a saved tensor
    as large as the logits would otherwise be copied twice at the profiling passes' peak)."""
    plan = lossless_plan(flat, CHUNK_ELEMENTS)
    synchronize()
    start = time.perf_counter()
    if plan is not None:
        for first in range(0, flat.numel(), CHUNK_ELEMENTS):
            payload = encode_lossless(flat[first:first + CHUNK_ELEMENTS], storage)
            if payload is not None:
                payload.decode()  # made and dropped: the time is what is measured
    synchronize()
    seconds = time.perf_counter() - start
    return Trial(plan[3] if plan is not None else flat.numel() * flat.element_size(), seconds)


def trial_bytes(flat: torch.Tensor, kinds: tuple[str, ...]) -> int:
    """At most what `trial` allocates for ``flat`` over ``kinds``: the payload and the decoded copy (each
    at most the dense bytes), the int8 encoder's fp32 working copies (12 bytes per element; measured:
    13 bytes per element of fp32 input in all, 11 of bf16) and the error check's fp32 temporaries over
    one chunk."""
    lossy = 12 * flat.numel() if "quantize" in kinds else 0
    whole = kinds != ("compress",) or flat.numel() <= CHUNK_ELEMENTS  # compress alone goes a chunk at a time
    copies = 2 * (flat.numel() if whole else CHUNK_ELEMENTS) * flat.element_size()
    return copies + lossy + 16 * min(flat.numel(), _CHECK_CHUNK)


def _rounding(dtype: torch.dtype) -> float:
    """Unit roundoff of ``dtype`` (half an ulp, relative)."""
    return float(torch.finfo(dtype).eps) / 2 if dtype.is_floating_point else 0.0
