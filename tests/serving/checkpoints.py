"""Real checkpoints of the tiny packaged model, written by the trainer's own checkpoint store
the way a job writes them (``<checkpoint_dir>/<job_id>/checkpoint-<step>``): LoRA adapters
with non-zero B matrices (fresh adapters would answer exactly like the base), and a full
checkpoint with perturbed weights."""

from __future__ import annotations

from pathlib import Path

import torch

from trainer.checkpoint.store import save_checkpoint
from trainer.models.loading import load_policy, resolve_model
from trainer.models.lora import apply_lora
from trainer.spec import LoraSpec

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
