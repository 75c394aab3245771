"""``xirang-ds tune --gpu NAME``: the search for a GPU run, before launch, on the estimate alone.

The measured search (`xirang_ds.tune.tune`) profiles and measures candidates on this machine, so its times
are this machine's. For a GPU run that has not started, every candidate of the same joint space
(`xirang_ds.tune.space`) is instead priced by the estimator with the named GPU's profile
(`xirang_ds.memory.device_profile`), the cost model of ``xirang-ds estimate``: the peak per rank with the
activation plan made for that budget, whether it fits (the plan meets the budget and the peak is within
it), and the step time from counted kernels, bytes and launches (`xirang_ds.planning.step_time`). The
fastest candidate that fits wins (``largest_micro_batch``: each candidate's micro-batch doubles while its
estimate fits, then the largest, fastest per sample). Nothing runs; candidates that trace the same share
one trace (`xirang_ds.planning.trace_cache`). The figures are predictions: the report says so and
``xirang-ds bench`` on the GPU measures them.
"""
from __future__ import annotations

import copy
import time
from typing import Any, Optional

from xirang_ds.config.loader import BLOCK_KEY, deep_merge
from xirang_ds.config.validate import XirangConfigError
from xirang_ds.memory.device_profile import DeviceProfile
from xirang_ds.planning.estimator import EstimateError
from xirang_ds.planning.spec import estimate_spec
from xirang_ds.planning.trace_cache import reuse_traces
from xirang_ds.tune.cost import rank_key
from xirang_ds.tune.space import Candidate, candidates, search_space

MAX_DOUBLINGS = 8
"""``largest_micro_batch``: doublings of a candidate's micro-batch at most (each one estimate)."""


def tune_predicted(model: Any, ds_config: dict, budget: int, profile: DeviceProfile, world_size: int = 1,
                   objective: str = "fastest", lossless_only: bool = False,
                   micro_batches: Optional[list[int]] = None, progress: Any = None) -> Any:
    """Price every candidate with ``profile`` (module docstring); the `TuneResult` whose winner is the best
    predicted to fit (``None`` when none is)."""
    from xirang_ds.tune import Progress, TuneResult

    progress = progress or Progress(None)
    start = time.perf_counter()
    user = copy.deepcopy(ds_config)
    user[BLOCK_KEY] = dict(user.get(BLOCK_KEY, {}) or {}, memory_budget=int(budget))
    pool = candidates(user, search_space(ds_config, world_size, lossless_only, micro_batches))
    grow = objective == "largest_micro_batch" and not micro_batches
    fits: dict[int, bool] = {}

    def price(c: Candidate, cfg: dict) -> bool:
        est = estimate_spec(model, cfg, world_size, "cuda", device_profile=profile)
        c.ds_config, c.micro_batch = cfg, int(cfg.get("train_micro_batch_size_per_gpu", 1) or 1)
        c.predicted_peak = est.predicted_peak_bytes
        c.predicted_time_s = est.step_time.seconds if est.step_time else None
        fits[id(c)] = est.fits is True  # the plan meets the budget and the peak is within it
        return fits[id(c)]

    with reuse_traces() as reuse:
        for i, c in enumerate(pool):
            progress.update(i, len(pool), "estimate", c.name)
            try:
                ok = price(c, c.ds_config)
                while grow and not ok and c.micro_batch > 1:  # as the measured search: halve until it fits
                    ok = price(c, deep_merge(c.ds_config, {"train_micro_batch_size_per_gpu": c.micro_batch // 2}))
                for _ in range(MAX_DOUBLINGS if grow and ok else 0):
                    last = (copy.deepcopy(c.ds_config), c.micro_batch, c.predicted_peak, c.predicted_time_s)
                    if not price(c, deep_merge(c.ds_config, {"train_micro_batch_size_per_gpu": 2 * c.micro_batch})):
                        c.ds_config, c.micro_batch, c.predicted_peak, c.predicted_time_s = last
                        fits[id(c)] = True
                        break
            except (XirangConfigError, EstimateError, ValueError) as e:
                c.rejected = " ".join(str(e).split())[:300]
        progress.update(len(pool), len(pool), "estimate")
    fitting = [c for c in pool if c.rejected is None and fits.get(id(c)) and c.predicted_time_s is not None]

    fitting.sort(key=lambda c: rank_key(objective, c.predicted_time_s, c.micro_batch))
    live = sum(c.rejected is None for c in pool)
    notes = [f"{len(pool)} candidates, {len(pool) - live} rejected by the plugins, {len(fitting)} predicted to fit "
             f"on {profile.name} ({reuse.traces} fake traces, {reuse.reused} estimates on a shared one); nothing was "
             "run: the peaks and times are the estimate's (xirang-ds bench on the GPU measures them)"]
    seconds = {"estimate": time.perf_counter() - start, "profile": 0.0, "measure": 0.0}
    seconds["total"] = seconds["estimate"]
    return TuneResult(budget, objective, world_size, model, pool, {}, {}, fitting[0] if fitting else None, seconds,
                      notes, device_profile=profile.name, ranked=fitting)


__all__ = ["MAX_DOUBLINGS", "tune_predicted"]
