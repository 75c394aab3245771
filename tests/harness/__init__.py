"""What the tests share: real-engine runs (`engine_runs`), Megatron-core runs (`megatron_runs`, on CPU
through `megatron_shim`) and the removal and resume checks every plugin section uses (`checks`)."""
