"""optimizer_states under DeepSpeed: the ds_config it refuses, and the basic optimizer swapped in its wrappers.

* DeepSpeed's wrappers hold the basic optimizer as ``.optimizer`` (ZeRO 1/2/3, the bf16 and the fp16
  optimizers), besides ``engine.basic_optimizer``, or ``engine.optimizer`` without a wrapper; it is
  swapped when the plugin is removed (`swap_basic_optimizer`).
* ZeRO 1/2 and the bf16 optimizer keep views of every optimizer-state tensor shaped like the fp32
  partition for ``safe_get_full_optimizer_state``. After a tensor's states change format those views
  would keep the old fp32 buffers alive, so the links are rebuilt (`relink_state_views`, through
  `xirang_ds.compat.deepspeed.relink_hp_params`; quantized buffers have another shape and are not
  linked, and DeepSpeed's per-parameter state getters then report no state for them).

``tests/test_optimizer_states_engine.py`` fails when a DeepSpeed release moves these.
"""
from __future__ import annotations

from typing import Any

from xirang_ds.compat.deepspeed import relink_hp_params
from xirang_ds.config.validate import XirangConfigError

SECTION = "xirang.optimizer_states"


def check_ds_config(ds_config: dict) -> None:
    """Refuse ds_config settings this plugin cannot work with, before DeepSpeed starts.

    Raises:
        XirangConfigError: every problem of `ds_config_problems`.
    """
    problems = ds_config_problems(ds_config)
    if problems:
        raise XirangConfigError(problems)


def ds_config_problems(ds_config: dict) -> list[tuple[str, str]]:
    """The ds_config settings this plugin cannot work with: optimizer offload (DeepSpeed then steps
    its own CPU Adam on host memory)."""
    zero = ds_config.get("zero_optimization") or {}
    problems = []
    offload = zero.get("offload_optimizer") or {}
    if isinstance(offload, dict) and offload.get("device") not in (None, "none"):
        problems.append((f"{SECTION}.enabled",
                         f"zero_optimization.offload_optimizer.device is {offload.get('device')!r}: DeepSpeed then "
                         f"keeps the optimizer states in host memory and steps its own CPU Adam, so there are no "
                         f"device states to shrink. Fix: remove offload_optimizer or disable optimizer_states"))
    return problems


def relink_state_views(engine: Any) -> None:
    """Rebuild DeepSpeed's views of the optimizer states (see the module docstring)."""
    wrapper = getattr(engine, "optimizer", None)
    if not getattr(wrapper, "cpu_offload", False):
        relink_hp_params(wrapper)


def swap_basic_optimizer(engine: Any, old: Any, new: Any) -> None:
    """Put ``new`` wherever the engine and its wrapper hold ``old``.

    Raises:
        RuntimeError: ``old`` is not found (a DeepSpeed release moved the attribute).
    """
    found = False
    if getattr(engine, "basic_optimizer", None) is old:
        engine.basic_optimizer = new
        found = True
    wrapper = getattr(engine, "optimizer", None)
    if wrapper is old:
        engine.optimizer = new
        found = True
    elif getattr(wrapper, "optimizer", None) is old:
        wrapper.optimizer = new
        found = True
    if not found:
        raise RuntimeError(f"xirang optimizer_states: cannot find the basic optimizer in {type(wrapper).__name__}; "
                           "this DeepSpeed version is not supported")
