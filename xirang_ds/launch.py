"""Run a function on N CPU ranks over gloo: for the bench, the examples and the tests.

DeepSpeed needs RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (else it tries MPI
discovery), and its ``deepspeed_shm_comm`` op JIT-builds for 30-40 s on first use, which
`prepare_cpu_process` switches off (notes/cpu-runtime.md).
"""
from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_cpu_process(rank: int = 0, world_size: int = 1, port: int | None = None,
                        threads: int | None = None) -> None:
    """Environment for one DeepSpeed rank on CPU without a launcher."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port or os.environ.get("MASTER_PORT") or free_port()))
    if threads:
        import torch

        torch.set_num_threads(threads)
    disable_shm_build()


def disable_shm_build() -> None:
    """Skip DeepSpeed's ``deepspeed_shm_comm`` JIT build (gloo is used instead)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out_dir: str,
            threads: int | None) -> None:
    prepare_cpu_process(rank, world_size, port, threads)
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        result = fn(rank, world_size, *args)
        payload = ("ok", result)
    except BaseException as e:  # report to the parent, which raises
        payload = ("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    finally:
        try:
            import deepspeed.comm as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
    with open(path, "wb") as f:
        pickle.dump(payload, f)


PRELOAD = ("torch", "deepspeed", "xirang_ds", "megatron.core", "transformers")
"""Modules the rank processes start with when the caller has them imported (see `_context`)."""


def _context() -> Any:
    """Where rank processes come from: a fork server that imported torch, DeepSpeed and what else
    of `PRELOAD` the caller had imported, once per calling process; forked from it, a rank starts
    in milliseconds instead of importing torch and DeepSpeed again (about 3 s of CPU each). The
    server imports nothing else and runs no torch op before forking (no thread pools exist yet), and
    ranks get the function and arguments by pickle, as with ``spawn``. ``spawn`` where the platform
    has no fork server (Windows)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__", *(name for name in PRELOAD if name in sys.modules)])
    return ctx


def run_ranks(fn: Callable[..., Any], world_size: int = 2, *args: Any, threads: int | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes; return each result.

    Results travel through per-rank files (more reliable than interleaved stdout). A rank that
    raises makes this raise with that rank's traceback. ``fn`` must be importable (module level).
    """
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="xirang-ranks-") as out_dir:
        ctx = _context()
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, out_dir, threads))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        results, errors = [], []
        for r, p in enumerate(procs):
            path = os.path.join(out_dir, f"rank{r}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {r} exited with code {p.exitcode} and no result")
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            (results if status == "ok" else errors).append(value)
        if errors:
            raise RuntimeError("distributed run failed:\n" + "\n".join(errors))
        return results
