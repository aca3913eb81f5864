"""Real checkpoints of the tiny packaged model, written by the trainer's own checkpoint store
the way a job writes them (``<checkpoint_dir>/<job_id>/checkpoint-<step>``): LoRA adapters
with non-zero B matrices (fresh adapters would answer exactly like the base), a full
checkpoint with perturbed weights, and a full checkpoint that answers with a tool call."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from jobspec import LoraSpec
from trainer.checkpoint.store import save_checkpoint
from trainer.models.loading import build_tiny_tokenizer, load_policy, resolve_model
from trainer.models.lora import apply_lora

TINY = "tiny-random-llama"


def _save(model: torch.nn.Module, tokenizer: object, output_dir: Path, step: int) -> Path:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    return save_checkpoint(
        output_dir,
        step,
        model=model,
        tokenizer=tokenizer,  # type: ignore[arg-type]
        optimizer=optimizer,
        scheduler=None,
        sampler={},
    )


def write_lora_checkpoint(
    store: Path, job_id: str, *, seed: int, step: int = 1, rank: int = 4
) -> Path:
    model, tokenizer = load_policy(resolve_model(TINY))
    lora = apply_lora(model, LoraSpec(rank=rank), base_name=TINY)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return _save(lora, tokenizer, store / job_id, step)


def write_full_checkpoint(store: Path, job_id: str, *, seed: int, step: int = 1) -> Path:
    model, tokenizer = load_policy(resolve_model(TINY))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return _save(model, tokenizer, store / job_id, step)


def write_tool_caller_checkpoint(store: Path, job_id: str, call: str, *, step: int = 1) -> Path:
    """A full checkpoint whose greedy answer to any chat of the tiny template is ``call``, a
    Hermes ``<tool_call>...</tool_call>`` (so a real engine writes a tool call), and whose
    other log-probabilities depend on the whole prompt (so two prompts tell apart).

    The tiny tokenizer, with the call's parts added as three tokens (its characters repeat, so
    a chain over characters could not spell it); one-hot embeddings, and an output head that
    maps each token of the chain ``<|assistant|>`` -> the three parts -> ``<|end|>`` to the
    next by a margin the small random layer cannot overturn; that layer (attention over the
    prompt) moves every other logit."""
    open_tag, close_tag = "<tool_call>", "</tool_call>"
    assert call.startswith(open_tag) and call.endswith(close_tag), call
    parts = [open_tag, call[len(open_tag) : -len(close_tag)], close_tag]
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_tokens(parts)
    ids = [tokenizer.convert_tokens_to_ids(p) for p in ("<|assistant|>", *parts, "<|end|>")]
    hidden = 64
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,  # vLLM's CPU attention wants 32 or more
        max_position_embeddings=1024,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        model = LlamaForCausalLM(config)
        head = torch.randn(len(tokenizer), hidden) * 0.05
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(len(tokenizer), hidden))
        [layer] = model.model.layers
        layer.self_attn.o_proj.weight.mul_(0.05)  # the prompt's small say in every logit
        layer.mlp.down_proj.weight.zero_()
        for current, following in itertools.pairwise(ids):
            head[following, current] += 10.0
        model.lm_head.weight.copy_(head)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return _save(model, tokenizer, store / job_id, step)
