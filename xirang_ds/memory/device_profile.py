"""Device profiles: the figures that turn counts (FLOPs, bytes moved, launches, host-link bytes) into
time, so that a plan priced from counts is the same on every machine for the same device profile.

The activation planner used to time every op of its profiling passes (synchronised per op on an
accelerator) and every encoding: plans moved with machine noise, and CPU timings, where a launch and
a host copy cost next to nothing, decided plans for GPU users. Now the passes count and a profile
prices: an op costs ``max(FLOPs / FLOP rate, bytes / memory bandwidth) + launch``, a host copy its
bytes over the host link. The profile of a run is its device's, named by the device
(`profile_for`); an accelerator it does not know takes H100's figures and says so.

Figures (spec sheets; the FLOP rates scaled by ``efficiency``, what dense matmuls reach in practice:
about 790 of the H200's 989 bf16 TFLOP/s were measured on the lent H200, docs of the device tool):

========  ============  ==========  ============  =============  ========  ====================
profile   bf16 matmul   fp32        memory        host link      launch    interconnect
========  ============  ==========  ============  =============  ========  ====================
h100      989 TFLOP/s   67 TFLOP/s  3.35 TB/s     64 GB/s PCIe5  5 us      450 GB/s NVLink4
h200      989 TFLOP/s   67 TFLOP/s  4.8 TB/s      64 GB/s PCIe5  5 us      450 GB/s NVLink4
a100      312 TFLOP/s   19.5        2.04 TB/s     32 GB/s PCIe4  5 us      300 GB/s NVLink3
cpu       100 GFLOP/s   100 GFLOP/s 20 GB/s       10 GB/s        5 us      5 GB/s (gloo)
========  ============  ==========  ============  =============  ========  ====================

(interconnect: one direction per GPU, SXM parts.)

The CPU's figures are stated constants for a small x86 server (2 cores with AVX2 FMA at about
2.5 GHz, DDR4), not a measurement of this machine: a plan made on a CPU is the CPU profile's plan.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch

from xirang_ds.compat.torch import TorchDispatchMode, flop_aliases
from xirang_ds.memory.storages import tensors_in

MATMUL_EFFICIENCY = 0.8
"""Fraction of the spec FLOP rate dense matmuls reach (790 of 989 TFLOP/s measured on an H200)."""
MEMORY_EFFICIENCY = 0.85
"""Fraction of the spec memory bandwidth streaming ops reach."""


@dataclass(frozen=True)
class DeviceProfile:
    """What one device does per second, and what one launch costs.

    Attributes:
        name: ``h100``, ``h200``, ``a100`` or ``cpu``.
        matmul_flops_per_s: 16-bit (bf16/fp16) dense matrix FLOP rate, spec.
        fp32_flops_per_s: 32-bit FLOP rate (matmuls in fp32 without TF32, and arithmetic), spec.
        memory_bytes_per_s: device memory bandwidth, spec.
        host_link_bytes_per_s: device-host copy bandwidth, one direction (PCIe x16 for GPUs).
        launch_s: the host's cost to start one kernel (an eager op's dispatch on a CPU).
        interconnect_bytes_per_s: one direction between two ranks' devices, what a ring collective moves per
            second per rank (NVLink for the GPUs; the CPU's gloo over shared memory).
        memory_bytes: device memory as torch reports it (``total_memory``), what ``memory_budget: auto``
            stands for in an estimate for this device (``xirang-ds estimate --gpu``); 0 for the CPU, whose
            memory is the machine's.
    """

    name: str
    matmul_flops_per_s: float
    fp32_flops_per_s: float
    memory_bytes_per_s: float
    host_link_bytes_per_s: float
    launch_s: float
    memory_bytes: int = 0
    interconnect_bytes_per_s: float = 5e9

    @property
    def accelerator(self) -> bool:
        """A GPU's profile (the CPU's, stated or measured, are named ``cpu...``)."""
        return not self.name.startswith("cpu")

    def op_seconds(self, flops: float, bytes_moved: float, low_precision: bool = True) -> float:
        """One op: the larger of its arithmetic and its memory traffic (a roofline), plus its launch."""
        rate = (self.matmul_flops_per_s if low_precision else self.fp32_flops_per_s) * MATMUL_EFFICIENCY
        return max(flops / rate, bytes_moved / (self.memory_bytes_per_s * MEMORY_EFFICIENCY)) + self.launch_s

    def copy_seconds(self, nbytes: float) -> float:
        """One device-host copy of ``nbytes`` (one direction)."""
        return nbytes / self.host_link_bytes_per_s + self.launch_s

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


PROFILES: dict[str, DeviceProfile] = {
    "h100": DeviceProfile("h100", 989e12, 67e12, 3.35e12, 64e9, 5e-6, 80 * 2**30, 450e9),
    "h200": DeviceProfile("h200", 989e12, 67e12, 4.8e12, 64e9, 5e-6, 150_109_880_320, 450e9),
    "a100": DeviceProfile("a100", 312e12, 19.5e12, 2.039e12, 32e9, 5e-6, 80 * 2**30, 300e9),
    "cpu": DeviceProfile("cpu", 1e11, 1e11, 2e10, 1e10, 5e-6, 0, 5e9),
}
"""The named profiles (the module docstring's table). Memory: the H200's as the lent one reported it
(benchmarks/results/gpu/20261204/env.json), the 80 GB H100 and A100 at 80 GiB (their spec; torch reports
slightly less where the driver keeps some)."""
UNKNOWN_ACCELERATOR = "h100"
"""The figures an accelerator of no known name is priced with."""

HOSTS: dict[str, DeviceProfile] = {
    "h100": DeviceProfile("host-dgx-h100", 7.17e12, 7.17e12, 614e9, 64e9, 5e-6, 0, 0.0),
    "a100": DeviceProfile("host-dgx-a100", 4.61e12, 4.61e12, 410e9, 32e9, 5e-6, 0, 0.0),
}
"""The host CPUs of a GPU profile, where work runs on the host (DeepSpeed's ``offload_optimizer`` update): spec
figures of the DGX servers' two sockets (DGX H100 and H200: two Xeon Platinum 8480C, 56 cores at 2.0 GHz, two
AVX-512 FMA units, 8 channels of DDR5-4800 each; DGX A100: two EPYC 7742, 64 cores at 2.25 GHz, AVX2, 8 channels
of DDR4-3200 each; 16-bit arithmetic at the fp32 rate). An op there is priced as on a device (`DeviceProfile.op_seconds`); a CPU profile is its own
host."""


def host_profile(profile: DeviceProfile) -> DeviceProfile:
    """The profile that prices ``profile``'s host work (`HOSTS`; the CPU's is itself)."""
    if not profile.accelerator:
        return profile
    return HOSTS["a100" if profile.name == "a100" else "h100"]


def profile_named(name: str) -> DeviceProfile:
    """The profile called ``name`` (case-insensitive).

    Raises:
        ValueError: naming the known profiles.
    """
    key = name.lower()
    if key not in PROFILES:
        raise ValueError(f"no device profile {name!r}; known: {', '.join(sorted(PROFILES))}")
    return PROFILES[key]


def profile_for(device: torch.device | str, device_name: Optional[str] = None) -> tuple[DeviceProfile, str]:
    """The profile of ``device`` (its marketing name from ``device_name`` or the CUDA runtime) and a
    note of how it was chosen."""
    device = torch.device(device)
    if device.type == "cpu":
        return PROFILES["cpu"], "cpu (stated constants)"
    if device_name is None and device.type == "cuda" and torch.cuda.is_available():
        device_name = torch.cuda.get_device_name(device)
    text = (device_name or "").lower()
    for key in ("h200", "h100", "a100"):
        if key in text:
            return PROFILES[key], f"{key} (from the device name {device_name!r})"
    return PROFILES[UNKNOWN_ACCELERATOR], (f"{UNKNOWN_ACCELERATOR}'s figures: no profile for {device_name or device}")


def measure_cpu_profile(threads: Optional[int] = None, repeats: int = 5) -> DeviceProfile:
    """This machine's CPU, measured by a short micro-benchmark (about a second) with ``threads`` intra-op
    threads (default torch's): a 1024-square bf16 and fp32 matmul for the FLOP rates, a 32 MiB copy for the
    memory bandwidth (and the host link, the same memory), a one-element add for an op's dispatch cost; each
    the best of ``repeats``. The rates are stored divided by the efficiencies `DeviceProfile.op_seconds`
    applies, so an op priced by the profile takes what it took here. The interconnect keeps the stated
    constant (gloo between processes is not measured here)."""
    import time

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        def best(fn: Any) -> float:
            fn()
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return min(times)

        n = 1024
        rates = {}
        for dtype in (torch.bfloat16, torch.float32):
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            rates[dtype] = 2 * n ** 3 / best(lambda: torch.mm(a, b))
        src = torch.empty(8 * 2**20)
        dst = torch.empty_like(src)
        bandwidth = 2 * src.nbytes / best(lambda: dst.copy_(src))
        one = torch.zeros(1)
        launch = best(lambda: [torch.add(one, one) for _ in range(1000)]) / 1000
    finally:
        torch.set_num_threads(before)
    cpu = PROFILES["cpu"]
    return DeviceProfile("cpu-measured", rates[torch.bfloat16] / MATMUL_EFFICIENCY, rates[torch.float32] / MATMUL_EFFICIENCY,
                         bandwidth / MEMORY_EFFICIENCY, bandwidth, launch, 0, cpu.interconnect_bytes_per_s)


# ------------------------------------------------------------------------------------------------
# counting one op


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size() if t.layout == torch.strided else 0


_FLOPS_AS = flop_aliases()
"""Ops PyTorch's FLOP table leaves out, counted as the op of the same arithmetic it has (the fake trace runs on
the CPU, whose SDPA is its own flash kernel, whatever device the estimate is for)."""


def op_counts(func: Any, args: tuple, kwargs: dict, out: Any) -> tuple[int, int, bool]:
    """``(FLOPs, bytes moved, low precision)`` of one ATen op call: FLOPs from PyTorch's own table
    (``torch.utils.flop_counter``: matmuls, convolutions, attention; 0 for the rest, which their
    bytes price), bytes as every tensor argument read and every output written once. Shapes only:
    the same on any machine, and on fake tensors."""
    from torch.utils.flop_counter import flop_registry

    inputs = list(tensors_in((args, kwargs)))
    outputs = list(tensors_in(out))
    moved = sum(_nbytes(t) for t in inputs) + sum(_nbytes(t) for t in outputs)
    packet = getattr(func, "overloadpacket", func)
    counter = flop_registry.get(_FLOPS_AS.get(packet, packet))
    flops = 0
    if counter is not None:
        try:
            flops = int(counter(*args, **kwargs, out_val=out))
        except Exception:  # a signature the table does not cover: priced by its bytes
            flops = 0
    low = any(t.dtype in (torch.bfloat16, torch.float16) for t in inputs) if inputs else True
    return flops, moved, low


def op_seconds(profile: DeviceProfile, func: Any, args: tuple, kwargs: dict, out: Any) -> float:
    """`op_counts` priced by ``profile``."""
    flops, moved, low = op_counts(func, args, kwargs, out)
    return profile.op_seconds(flops, moved, low)


FUSED_ADAM_BYTES = 28
"""Bytes an element of one fused Adam pass moves (torch's fused kernel, DeepSpeed's ``DeepSpeedCPUAdam``): the fp32
parameter, gradient and both moments read, the parameter and moments written."""

_BARE = (0, 0, True)
"""A launch that moves nothing the tally prices: a collective (its bytes are the step's communication), a host read."""


class OpTally:
    """The ops of a stretch of work (a fake forward and backward), counted to be priced by any profile: each
    op that launches a kernel (views and size queries launch none) kept as its `op_counts`, equal ones
    together."""

    def __init__(self) -> None:
        self.ops: dict[tuple[int, int, bool], int] = {}
        self.host_syncs = 0

    def add_counts(self, flops: int, bytes_moved: int, low_precision: bool, times: int = 1) -> None:
        """``times`` launches of known counts that no ATen op here runs (a compiled graph's call, written by its
        caller)."""
        key = (flops, bytes_moved, low_precision)
        self.ops[key] = self.ops.get(key, 0) + times

    def collective(self) -> None:
        """One collective launched (an all-reduce written beside fake ops, which run none): a launch here, its
        bytes priced as the step's communication."""
        self.add_counts(*_BARE)

    def host_read(self) -> None:
        """One device scalar read on the host (``.item()``, ``bool(t)``; on fake tensors it cannot run): a
        launch and a host sync, as `xirang_ds.step_counts` counts ``aten._local_scalar_dense``."""
        self.add_counts(*_BARE)
        self.host_syncs += 1

    def ops_from(self, other: "OpTally", times: int = 1) -> None:
        """Add ``other``'s ops and host syncs, ``times`` over, to this tally."""
        for key, n in other.ops.items():
            self.add_counts(*key, times=n * times)
        self.host_syncs += other.host_syncs * times

    def add(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        from xirang_ds.step_counts import launches_nothing

        if launches_nothing(func):
            return  # views, sizes, allocations without a write, metadata (prim: a tensor's device)
        key = op_counts(func, args, kwargs or {}, out)
        self.ops[key] = self.ops.get(key, 0) + 1

    @property
    def launches(self) -> int:
        return sum(self.ops.values())

    @property
    def flops(self) -> int:
        return sum(f * n for (f, _, _), n in self.ops.items())

    @property
    def bytes_moved(self) -> int:
        return sum(b * n for (_, b, _), n in self.ops.items())

    def seconds(self, profile: DeviceProfile) -> float:
        """The ops one after another on ``profile`` (each `DeviceProfile.op_seconds`)."""
        return sum(profile.op_seconds(f, b, low) * n for (f, b, low), n in self.ops.items())

    def as_dict(self) -> dict[str, int]:
        return {"launches": self.launches, "flops": self.flops, "bytes_moved": self.bytes_moved,
                "host_syncs": self.host_syncs}


class Tallying(TorchDispatchMode):
    """Counts into ``tally`` every op run under it (on fake tensors, inside the caller's ``FakeTensorMode``)."""

    def __init__(self, tally: OpTally) -> None:
        super().__init__()
        self.tally = tally

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.tally.add(func, args, kwargs or {}, out)
        return out


def tallied(fn: Any) -> OpTally:
    """The ops ``fn()`` runs (on fake tensors, inside the caller's ``FakeTensorMode``), counted."""
    tally = OpTally()
    with Tallying(tally):
        fn()
    return tally


__all__ = ["DeviceProfile", "FUSED_ADAM_BYTES", "HOSTS", "MATMUL_EFFICIENCY", "MEMORY_EFFICIENCY", "OpTally", "PROFILES",
           "Tallying",
           "UNKNOWN_ACCELERATOR", "host_profile", "measure_cpu_profile", "op_counts", "op_seconds", "profile_for",
           "profile_named", "tallied"]
