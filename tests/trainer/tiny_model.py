"""A tiny randomly initialised Llama (transformers) for trainer tests that need a real model
but not SmolLM2's size: checkpoint round trips and resume protocols."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_model(seed: int = 0, vocab: int = 64, hidden: int = 16) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()
