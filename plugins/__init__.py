"""Built-in plugins of xirang_ds, one folder per section of the ``"xirang"`` block.

Installed as ``xirang_ds.plugins`` (setup.py ``package_dir``). Each folder holds the whole plugin: its
section (``config.py``), the plugin class, its DeepSpeed and Megatron-core paths, its estimate and its
checkpoint parts, and a README with its current figure. Importing a plugin's module registers it and what
it contributes (`xirang_ds.registry`); the core asks the registry and names no plugin. No module here
imports deepspeed at import time.
"""

BUILTIN = {
    "optimizer_states": "xirang_ds.plugins.optimizer_states.plugin",
    "grad_release": "xirang_ds.plugins.grad_release",
    "precision": "xirang_ds.plugins.precision",
    "activations": "xirang_ds.plugins.activations",
    "comm_buffers": "xirang_ds.plugins.comm_buffers",
    "memory_pool": "xirang_ds.plugins.memory_pool",
    "monitor": "xirang_ds.plugins.monitor",
    "profiler": "xirang_ds.plugins.profiler",
}
"""Section → the module whose import registers its plugin, in the order the block documents the sections
(docs/config.md's reference, `xirang_ds.config.sections.section_names`)."""
