"""Dynamic-precision optimizer states (section ``optimizer_states``).

Layout: `qmaps` (quantization maps), `formats` (fp32 / bf16 / int8 / int4 storage of one moment),
`update` (the Adam math), `schedule` (precision policies), `optimizer` (`DynamicAdamW`, the
bookkeeping), `build` (the optimizer from ds_config's block or a client optimizer, param groups
split by the keep-fp32 rules), `deepspeed` (its DeepSpeed attach path; the internals it touches are in `xirang_ds.compat.deepspeed`),
`plugin` (the seams). See docs/optimizer_states.md.
"""
from xirang_ds.plugins.optimizer_states.optimizer import DynamicAdamW, StateLoadError

__all__ = ["DynamicAdamW", "StateLoadError"]
