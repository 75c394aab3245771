"""Integrations with training frameworks (DeepSpeed; Megatron-core)."""
