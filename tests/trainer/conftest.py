"""Shared helpers of the trainer tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(vocab_size: int) -> LlamaForCausalLM:
    """A seeded 2-layer random Llama in float32 and eval mode (no hub, no tokenizer)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        # A wider init than the default 0.02 so that the logits are far from uniform and a
        # wrong position, token or row would show up well above the tolerance.
        initializer_range=0.3,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).float()
    model.eval()  # no dropout in Llama, but make it explicit
    return model
