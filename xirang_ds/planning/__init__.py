"""Planning: what a run will be before it runs, above the session.

`preset.resolve` turns a block with a preset (``"auto"`` included) into the concrete block a run uses,
once, for DeepSpeed and Megatron-core; `auto` decides ``"auto"`` with the `estimator`; `fit` fits a block
to the user's ds_config through the plugins' checks; `spec` estimates a ``--model`` spec.
"""
