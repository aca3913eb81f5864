"""LoRA through peft: wrap the policy, reuse its frozen base as the KL reference, hand the
rollout engine merged weights, and save or load the adapters alone.

Why merged weights are computed, never merged in place: ``merge_adapter()`` then
``unmerge_adapter()`` adds and subtracts ``B @ A * scale`` in the weights' own dtype; in
bfloat16 each round trip leaves rounding error in the base, and it accumulates step after
step. :func:`engine_state_dict` instead builds ``W + B @ A * scale`` in float32 in new tensors
and leaves the base untouched, so the base is bit-identical after any number of steps.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any, cast

import torch
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file
from torch import nn

from jobspec import LoraSpec
from trainer.errors import LoraTargetNotSupported

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "adapters_disabled",
    "apply_lora",
    "engine_state_dict",
    "engine_weights",
    "is_lora",
    "load_adapter_weights",
    "merged_model",
    "refuse_unsynced_targets",
    "trainable_parameters",
]

ADAPTER = "default"  # peft's adapter name; a job trains exactly one
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def apply_lora(model: nn.Module, spec: LoraSpec, *, base_name: str | None = None) -> PeftModel:
    """``model`` wrapped with fresh adapters (B = 0, so it computes exactly what the base
    does); every base weight frozen. ``base_name`` is what the adapter's config records as its
    base model (the job's ``model`` as the user wrote it, never a server path)."""
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=spec.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )
    refuse_unsynced_targets(model, spec.target_modules)
    wrapped = get_peft_model(model, config)  # type: ignore[arg-type]
    if base_name is not None:
        wrapped.peft_config[ADAPTER].base_model_name_or_path = base_name
    return wrapped


def refuse_unsynced_targets(model: nn.Module, targets: list[str] | str) -> None:
    """LoraTargetNotSupported naming the first module that ``targets`` (peft's rule: a module
    whose name is an entry or ends with ``.entry``) reaches in ``model`` and whose adapter
    :func:`engine_weights` cannot carry: an embedding (peft adapts it with ``lora_embedding_*``
    tensors, which the merge leaves out), or an output head whose weight is tied to the input
    embeddings (merged, it would no longer be the embeddings' weight, and a tied model
    re-ties them on load). all-linear never reaches either."""
    if isinstance(targets, str):
        return
    get_head = getattr(model, "get_output_embeddings", None)
    get_input = getattr(model, "get_input_embeddings", None)
    head = get_head() if callable(get_head) else None
    inputs = get_input() if callable(get_input) else None
    tied = (
        head is not None
        and inputs is not None
        and getattr(head, "weight", None) is getattr(inputs, "weight", False)
    )
    for name, module in model.named_modules():
        entry = next((t for t in targets if name == t or name.endswith("." + t)), None)
        if entry is None:
            continue
        if isinstance(module, nn.Embedding):
            what = "an embedding"
        elif module is head and tied:
            what = "the output head, whose weight is tied to the input embeddings"
        else:
            continue
        raise LoraTargetNotSupported(
            f"lora.target_modules entry {entry!r} reaches {name!r}, {what}: its adapter would be "
            "trained but never reach the rollout engine or a merged export; adapt the "
            "decoder's linear layers (all-linear)"
        )


def is_lora(model: nn.Module) -> bool:
    return isinstance(model, PeftModel)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the optimizer updates: all of a full fine-tune, the adapters of LoRA."""
    return [p for p in model.parameters() if p.requires_grad]


def adapters_disabled(model: nn.Module) -> Any:
    """A context in which a LoRA model computes its base (the KL reference); a no-op
    context for any other model."""
    if isinstance(model, PeftModel):
        return model.disable_adapter()
    return nullcontext()


def _lora_layers(base: nn.Module) -> dict[str, LoraLayer]:
    return {name: module for name, module in base.named_modules() if isinstance(module, LoraLayer)}


def engine_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights an inference engine loads, under the base model's Hugging Face names, one
    tensor at a time (a weight sync never needs them all at once).

    A plain model: its ``state_dict()`` entries (the tensors themselves, no copies). A LoRA
    model: each adapted layer's weight is ``W + B @ A * scale`` computed in float32 when it is
    reached (a new tensor; the model is not modified), every other tensor the base's own;
    adapter tensors are left out. Tied weights appear under both names, as ``state_dict()``
    gives them (vLLM needs ``lm_head.*`` even when tied).
    """
    if not isinstance(model, PeftModel):
        yield from model.state_dict().items()
        return
    base = model.get_base_model()
    # Only this job's adapter counts: a layer peft wrapped for another adapter is left as is.
    deltas = {
        f"{name}.weight": layer
        for name, layer in _lora_layers(base).items()
        if ADAPTER in layer.lora_A
    }
    with torch.no_grad():
        for key, tensor in base.state_dict().items():
            if ".lora_" in key:
                continue
            name = key.replace(".base_layer.", ".")
            layer = deltas.get(name)
            if layer is None:
                yield name, tensor
            else:
                yield name, tensor.float() + cast(Any, layer).get_delta_weight(ADAPTER).float()


def engine_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """All of :func:`engine_weights` at once (an export or a test; never the weight sync)."""
    return dict(engine_weights(model))


def load_adapter_weights(folder: Path, model: nn.Module) -> None:
    """Load a checkpoint's adapters into a LoRA model in place; every adapter tensor must be
    present (a checkpoint of another rank or other target modules is an error)."""
    if not isinstance(model, PeftModel):
        raise TypeError("adapter checkpoints load into a LoRA model only")
    state = load_file(str(folder / ADAPTER_WEIGHTS))
    result: Any = set_peft_model_state_dict(model, state, adapter_name=ADAPTER)
    missing = [k for k in result.missing_keys if ".lora_" in k]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"checkpoint {folder.name} does not match this job's adapters: missing "
            f"{missing[:3]}, unexpected {list(result.unexpected_keys)[:3]}"
        )


def merged_model(model: nn.Module) -> nn.Module:
    """A plain Hugging Face model whose weights are the LoRA model's merged ones (float32
    merge, see :func:`engine_state_dict`), in the base's dtype; a plain model is returned as
    it is. The LoRA model is not modified."""
    if not isinstance(model, PeftModel):
        return model
    base = model.get_base_model()
    dtype = next(p.dtype for p in base.parameters())
    merged_weights = engine_state_dict(model)
    plain = copy.deepcopy(base)
    # Turn the deep copy into a plain model: each LoRA layer becomes its base layer.
    for name, layer in _lora_layers(plain).items():
        parent_name, _, child = name.rpartition(".")
        parent = plain.get_submodule(parent_name) if parent_name else plain
        setattr(parent, child, layer.get_base_layer())
    with torch.no_grad():
        plain.load_state_dict({k: v.to(dtype) for k, v in merged_weights.items()}, strict=True)
    return plain


def adapter_config(folder: Path) -> dict[str, Any]:
    """The adapter config a LoRA checkpoint holds (rank, alpha, targets, base model name)."""
    return dict(json.loads((folder / ADAPTER_CONFIG).read_text()))
