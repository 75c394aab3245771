"""Mixed precision with editable op lists and on-demand 16-bit weight copies (section ``precision``).

Importing this package registers `PrecisionPlugin`; it imports torch but not deepspeed. Layout:
``op_lists`` (defaults, names, composition), ``kernels`` (the policy at the autocast dispatch key),
``recast`` (casting and saving a cast's source instead of the cast), ``modules`` (fp32 modules,
Megatron layers), ``ds_config`` (what DeepSpeed gets), ``grad_scaling`` (fp16 loss scale and
overflow checks), ``apex_lists`` (Apex AMP registrations), ``plugin`` (the seams).
"""
from xirang_ds.plugins.precision.plugin import PrecisionPlugin

__all__ = ["PrecisionPlugin"]
