"""The GPU check's first step: the machine, and every plugin imported from the installed package.

    python tools/gpu_check/imports.py RESULTS.jsonl SITE

Writes one record: versions (read from package metadata: deepspeed is not imported here) and, per
module, the file it was imported from. A module that fails to import, or that comes from anywhere
but SITE (the private folder run.sh installed into: the checkout must never stand in for the
package), fails the step. This is what lost the 2026-12-04 run's tests and bench sides.
"""
from __future__ import annotations

import importlib
import os
import sys
from importlib.metadata import PackageNotFoundError, version

from xirang_ds.bench import append_jsonl

MODULES = ("xirang_ds", "xirang_ds.registry", "xirang_ds.session", "xirang_ds.bench", "xirang_ds.cli",
           "xirang_ds.integration.deepspeed", "xirang_ds.integration.megatron", "xirang_ds.step_counts")


def main(path: str, site: str) -> int:
    import torch

    info: dict = {"kind": "env", "python": sys.version.split()[0], "torch": torch.__version__,
                  "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_memory_bytes=p.total_memory, capability=f"{p.major}.{p.minor}")
    for name in ("deepspeed", "megatron-core", "xirang_ds", "pydantic", "torchao", "bitsandbytes", "transformers"):
        try:
            info[name] = version(name)
        except PackageNotFoundError:
            info[name] = None
    from xirang_ds.plugins import BUILTIN

    site = os.path.realpath(site)
    modules, problems = {}, []
    for name in (*MODULES, *BUILTIN.values()):
        try:
            where = os.path.realpath(importlib.import_module(name).__file__ or "")
        except Exception as e:  # recorded, and every other module is still tried
            modules[name] = f"import failed: {type(e).__name__}: {e}"
            problems.append(modules[name])
            continue
        modules[name] = where
        if not where.startswith(site + os.sep):
            problems.append(f"{name} imported from {where}, not from the installed package in {site}")
    info.update(modules=modules, problems=problems)
    append_jsonl(path, info)
    for k in ("python", "torch", "cuda", "gpu", "deepspeed", "megatron-core", "xirang_ds"):
        print(f"{k}: {info.get(k)}")
    print(f"{len(modules) - len(problems)} of {len(modules)} modules imported from {site}")
    for problem in problems:
        print(f"problem: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
