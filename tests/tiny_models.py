"""Tiny random-weights models for the tests:

* ``tiny_model``: a Llama in memory, for trainer tests that need a real model but not SmolLM2's
  size (checkpoint round trips, resume protocols, data-parallel sums);
* ``build_tiny_qwen2``: a user's own model on disk, a Qwen2 (not the bundled SmolLM2's Llama
  architecture) saved with ``save_pretrained`` next to the bundled SmolLM2 tokenizer (so it has a
  chat template), with eos ``<|endoftext|>`` (id 0, not SmolLM2's ``<|im_end|>``) and no pad token
  (so pad falls back to eos)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rollstream.policy.model import ensure_model_cache

TINY_EOS = "<|endoftext|>"
TINY_EOS_ID = 0
TINY_HIDDEN = 32


def tiny_model(seed: int = 0, vocab: int = 64, hidden: int = 16) -> LlamaForCausalLM:
    """A one-layer Llama of ``vocab`` tokens and width ``hidden``, tied embeddings, seeded, in eval
    mode (no dropout)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


def build_tiny_qwen2(folder: Path, weights: str = "safetensors", eos_prob: float = 0.5) -> Path:
    """Save the tiny Qwen2 into ``folder`` (``weights``: ``"safetensors"`` or ``"bin"`` for a
    ``pytorch_model.bin``) and return it.

    The weights are random except that every token embeds close to the all-ones vector and the
    LM head is zero but for the eos row: the final hidden state is then ~ones, so each step
    samples eos with probability ~``eos_prob`` (temperature 1) and otherwise a uniformly random
    token -- short responses that stop on the model's own eos, or run to the length limit.
    """
    tokenizer = AutoTokenizer.from_pretrained(ensure_model_cache())
    tokenizer.eos_token = TINY_EOS
    tokenizer.pad_token = None
    vocab = len(tokenizer)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=TINY_HIDDEN, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=False, eos_token_id=TINY_EOS_ID, bos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(1.0, 0.01)
        for layer in model.model.layers:  # keep the residual stream ~ones: layers add little
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
        model.lm_head.weight.zero_()
        # logit(eos) ~= sum(hidden) * w = log(odds * (vocab - 1)); every other logit is 0
        model.lm_head.weight[TINY_EOS_ID].fill_(math.log(eos_prob / (1 - eos_prob) * (vocab - 1)) / TINY_HIDDEN)
    model.generation_config.eos_token_id = TINY_EOS_ID
    folder.mkdir(parents=True, exist_ok=True)
    if weights == "bin":  # the older layout; transformers 5 only ever writes safetensors
        model.config.save_pretrained(folder)
        model.generation_config.save_pretrained(folder)
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    else:
        model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
