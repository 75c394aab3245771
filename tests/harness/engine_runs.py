"""Training runs for the engine tests: real DeepSpeed engines on CPU ranks (module-level functions so
``xirang_ds.launch.run_ranks`` can start them in fresh processes)."""
from __future__ import annotations

import copy
import os
from typing import Any, Optional

import torch

from xirang_ds.bench import optimizer_step
from xirang_ds.data import batches, load_tokens
from xirang_ds.models import BUILTIN_SPECS, build_model

CORPUS = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data",
                                      "tinyshakespeare.txt"))


def ds_config(stage: int = 0, dtype: str = "bf16", micro: int = 4, gas: int = 1, clip: float = 0.0,
              bucket: float = 1e6, lr: float = 1e-3, xirang: Optional[dict] = None, **extra: Any) -> dict:
    """A small ds_config; ``xirang=None`` leaves the block out."""
    cfg: dict = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "steps_per_print": 10**6,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket},
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01, "torch_adam": True}},
    }
    if stage == 3:
        cfg["zero_optimization"].update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=bucket)
    if clip:
        cfg["gradient_clipping"] = clip
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if xirang is not None:
        cfg["xirang"] = copy.deepcopy(xirang)
    cfg.update(extra)
    return cfg


def fused_adam_stand_in(kernel: bool = False) -> type:
    """A torch AdamW that DeepSpeed's engine takes for its FusedAdam (which needs a GPU to build), patched
    in this process: at stage 0 in bf16/fp16 the engine then wraps it in ``FP16_Optimizer`` as it wraps
    FusedAdam on a GPU, and its state dict keeps each step as an int, as FusedAdam's does. With
    ``kernel`` it runs torch's fused AdamW (no step temporaries, as FusedAdam has none) and the engine
    also builds it from a ds_config ``AdamW`` without ``torch_adam``."""
    import deepspeed.ops.adam
    import deepspeed.runtime.engine as engine

    class FusedAdamStandIn(torch.optim.AdamW):
        def state_dict(self):
            saved = super().state_dict()
            saved["state"] = {k: {**v, "step": int(v["step"])} for k, v in saved["state"].items()}
            return saved

    if kernel:
        class FusedKernelStandIn(FusedAdamStandIn):
            def __init__(self, params, adam_w_mode: bool = True, **kwargs):  # FusedAdam's signature
                super().__init__(params, fused=True, **kwargs)

        FusedAdamStandIn = FusedKernelStandIn
        deepspeed.ops.adam.FusedAdam = FusedAdamStandIn
    engine.FusedAdam = FusedAdamStandIn
    return FusedAdamStandIn


def data_iter(micro: int, seq: int, rank: int, world: int, seed: int = 0):
    path = CORPUS if os.path.isfile(CORPUS) else None
    return batches(load_tokens(path), micro, seq, seed=seed, rank=rank, world_size=world)


def train(rank: int, world: int, config: dict, steps: int, model_name: str = "gpt-tiny",
          use_xirang: bool = True, seed: int = 0, save_dir: Optional[str] = None,
          load_dir: Optional[str] = None, skip: int = 0) -> dict:
    """Train ``steps`` optimizer steps (after loading ``load_dir`` and dropping ``skip`` micro-batches);
    return losses per step and what xirang did."""
    import deepspeed

    import xirang_ds

    spec = BUILTIN_SPECS[model_name]
    model = build_model(spec, seed=seed)
    init = xirang_ds.initialize if use_xirang else deepspeed.initialize
    engine, _, _, _ = init(model=model, model_parameters=model.parameters(), config=config)
    if load_dir is not None:
        engine.load_checkpoint(load_dir)
    data = data_iter(engine.train_micro_batch_size_per_gpu(), spec.seq, rank, world, seed)
    for _ in range(skip):
        next(data)
    losses = [optimizer_step(engine, data) for _ in range(steps)]
    if save_dir is not None:
        engine.save_checkpoint(save_dir)
    session = getattr(engine, "xirang", None)
    return {
        "losses": losses,
        "plugins": [p.section for p in session.plugins] if session else [],
        "global_steps": engine.global_steps,
        "session_state": session.state_dict() if session else None,
    }
