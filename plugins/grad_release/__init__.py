"""Per-layer gradient release: the optimizer step fused into backward (section ``grad_release``).

Importing this package registers the plugin; deepspeed is imported only when the plugin runs.
Design, config keys, measured figures and limits: ``docs/grad_release.md``.
"""
from xirang_ds.plugins.grad_release import checkpoint  # noqa: F401  (registers its checkpoint files)
from xirang_ds.plugins.grad_release.plugin import GradReleasePlugin

__all__ = ["GradReleasePlugin"]
