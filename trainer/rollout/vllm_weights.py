"""Weights on their way into the vLLM engine: a module's engine tensors one at a time
(:func:`engine_tensors`), and a LoRA adapter folder vLLM loads, written from the adapter's
tensors as a sharded policy's gathers hand them over (:func:`write_adapter_folder`,
``trainer.rollout.base.StreamedSync``'s "adapter" view): the same files a PeftModel's
``save_pretrained`` writes (``adapter_model.safetensors`` under peft's saved names,
``adapter_config.json``), without a whole module on any rank."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from trainer.models.lora import engine_weights

__all__ = ["ADAPTER_FILE", "engine_tensors", "saved_adapter_name", "write_adapter_folder"]

ADAPTER_FILE = "adapter_model.safetensors"
_ADAPTER_NAME = "default"


def saved_adapter_name(key: str) -> str:
    """A PeftModel state_dict key as peft saves it: the adapter's name dropped
    (``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight``)."""
    return key.replace(f".{_ADAPTER_NAME}.", ".")


def write_adapter_folder(
    folder: Path, tensors: Iterable[tuple[str, torch.Tensor]], config: Any
) -> Path:
    """Write ``tensors`` (the adapter's, under the policy's state_dict names) and ``config``
    (the adapter's ``peft.LoraConfig``) into ``folder``; returns it. Only ``.lora_`` tensors
    are accepted: a frozen base weight here would be a bug upstream (the view gathers none)."""
    folder.mkdir(parents=True, exist_ok=True)
    saved: dict[str, torch.Tensor] = {}
    for key, tensor in tensors:
        if ".lora_" not in key:
            raise ValueError(f"not an adapter tensor: {key!r}")
        saved[saved_adapter_name(key)] = tensor.detach().to("cpu").contiguous()
    if not saved:
        raise ValueError("no adapter tensors were given")
    save_file(saved, str(folder / ADAPTER_FILE))
    config.save_pretrained(str(folder))
    return folder


def engine_tensors(model: nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """``model``'s engine weights (:func:`trainer.models.lora.engine_weights`) cast to the engine's
    ``dtype``, one at a time: each copy (and a LoRA layer's float32 merge) exists only until
    the engine asks for the next, never the whole model's worth at once."""
    with torch.no_grad():
        for name, tensor in engine_weights(model):
            out = tensor.detach().to(dtype).contiguous()
            del tensor  # a merged float32 layer: not kept alive while the engine copies `out`
            yield name, out
            del out
