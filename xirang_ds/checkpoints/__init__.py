"""Optimizer state that moves between owners at resume: plain DeepSpeed's ZeRO files, grad_release's
shards and DynamicAdamW's codes are each read into one neutral form, per parameter and whole
(`param_states.ParamStates`), and written from it into whatever optimizer this run steps
(docs/checkpoints.md)."""
