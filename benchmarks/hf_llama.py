"""HF ``LlamaForCausalLM`` built from a config, as a bench model factory: the model code and the
loss users run (``loss_function``: ``ForCausalLMLoss``), no weights downloaded.

    --model benchmarks.hf_llama:llama_32k   (vocab 32,000, hidden 512, 8 layers, sequence 256)
"""
from __future__ import annotations

import torch.nn as nn


class CausalLM(nn.Module):
    """``forward(input_ids, labels)`` returns the HF model's own loss (what the bench trains on)."""

    def __init__(self, model: nn.Module, seq: int):
        super().__init__()
        self.model = model
        self.seq = seq
        self.vocab = model.config.vocab_size

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels).loss


def llama_32k_config():
    """The issue's shape: vocab 32,000, hidden 512, 8 layers, sequence 256."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256,
                       attn_implementation="sdpa")


def llama_32k() -> CausalLM:
    from transformers import LlamaForCausalLM

    return CausalLM(LlamaForCausalLM(llama_32k_config()), seq=256)
