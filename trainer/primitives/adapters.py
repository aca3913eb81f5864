"""The LoRA of a training session: which modules it adapts, its peft model, snapshots of its
tensors, and the adapter folder an inference engine loads.

Tinker's ``create_model`` names the parts to adapt (attention, MLP, the unembedding) instead of
module names, so the targets are found by the model's structure: every ``nn.Linear`` under an
attention or MLP block, and the output head. ``trainer.models.lora.apply_lora`` is not reused:
it takes a job's ``LoraSpec`` (module names) and refuses an output head tied to the input
embeddings, because a GRPO job hands merged weights to vLLM and a merged tied head cannot be
expressed; a session hands vLLM the adapter itself, whose head adapter vLLM applies to the
logits (the base head stays tied and frozen).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor, nn

from trainer.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from trainer.primitives.types import PrimitiveError
from trainer.rollout.vllm_weights import saved_adapter_name, write_adapter_folder

__all__ = [
    "LORA_ALPHA",
    "WeightsSnapshot",
    "build_lora",
    "lora_targets",
    "read_adapter",
    "restore",
    "swapped_in",
    "take_snapshot",
    "write_adapter",
]

# Scale numerator (updates are alpha / rank): fixed, as in Tinker, whose API takes no alpha,
# so that a rank change does not silently change the learning rate that works.
LORA_ALPHA = 32
_ATTENTION = frozenset({"self_attn", "attn", "attention", "self_attention", "cross_attn"})
_MLP = frozenset({"mlp", "feed_forward", "ffn", "block_sparse_moe"})


def lora_targets(model: nn.Module, *, attn: bool, mlp: bool, unembed: bool) -> list[str]:
    """peft ``target_modules`` for the parts asked for: module leaf names (``q_proj``,
    ``lm_head``) when they select exactly those modules, else full module names.
    PrimitiveError when nothing would be trained."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    chosen: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        parents = set(name.split(".")[:-1])
        if (
            (attn and parents & _ATTENTION)
            or (mlp and parents & _MLP)
            or (unembed and module is head)
        ):
            chosen.append(name)
    if not chosen:
        raise PrimitiveError(
            "train_attn, train_mlp, train_unembed: no module of this model would be trained"
        )
    leaves = sorted({name.rsplit(".", 1)[-1] for name in chosen})
    reached = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in leaves
    ]
    return leaves if reached == chosen else chosen


def build_lora(
    model: nn.Module, rank: int, targets: list[str], *, seed: int | None, base_name: str
) -> PeftModel:
    """``model`` wrapped with fresh adapters (B = 0: it computes what the base does), its own
    weights frozen. ``seed`` fixes the A matrices' initialisation without moving the global
    random stream; ``base_name`` is what the adapter config records as the base model (a
    name, never a server path)."""
    if rank < 1:
        raise PrimitiveError(f"lora_rank: must be at least 1, got {rank}")
    config = LoraConfig(
        r=rank,
        lora_alpha=LORA_ALPHA,
        lora_dropout=0.0,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        if seed is not None:
            torch.manual_seed(seed)
        # peft warns when a tied head is adapted: that only matters to a merge, see the module
        # docstring.
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
        wrapped = get_peft_model(model, config)  # type: ignore[arg-type]
    wrapped.peft_config["default"].base_model_name_or_path = base_name
    return wrapped


@dataclass(frozen=True)
class WeightsSnapshot:
    """A copy of a session's trainable tensors (by parameter name), to sample with the weights
    of a save while training goes on. Megabytes for LoRA: the base is not copied."""

    tensors: dict[str, Tensor]


def _trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def take_snapshot(model: nn.Module) -> WeightsSnapshot:
    """A detached copy of every trainable tensor of ``model``."""
    with torch.no_grad():
        return WeightsSnapshot({n: p.detach().clone() for n, p in _trainable(model).items()})


def restore(model: nn.Module, snapshot: WeightsSnapshot) -> None:
    """Copy ``snapshot`` into ``model``'s trainable parameters in place (their objects, hence
    the optimizer's state and any gradient, are kept). ValueError, before anything is
    copied, when it does not fit."""
    params = _trainable(model)
    if set(params) != set(snapshot.tensors) or any(
        snapshot.tensors[n].shape != p.shape for n, p in params.items()
    ):
        raise ValueError("the snapshot's tensors are not this model's trainable parameters")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(snapshot.tensors[name])


@contextmanager
def swapped_in(model: nn.Module, snapshot: WeightsSnapshot | None) -> Iterator[None]:
    """A scope in which ``model`` computes with ``snapshot``'s weights (None: its own); its
    own are put back afterwards, bit for bit, even on an error."""
    if snapshot is None:
        yield
        return
    own = take_snapshot(model)
    try:
        restore(model, snapshot)
        yield
    finally:
        restore(model, own)


def write_adapter(model: PeftModel, folder: Path) -> None:
    """The adapter as peft saves it into ``folder`` (``adapter_model.safetensors`` under peft's
    saved names, ``adapter_config.json``), for vLLM or ``PeftModel.from_pretrained``."""
    tensors = ((n, p.detach()) for n, p in _trainable(model).items())
    write_adapter_folder(folder, tensors, model.peft_config["default"])


def read_adapter(model: PeftModel, folder: Path) -> WeightsSnapshot:
    """The adapter saved in ``folder`` as a snapshot of ``model``'s trainable tensors.
    PrimitiveError when the folder holds no adapter or one of another shape (rank, targets)."""
    try:
        saved = load_file(str(folder / ADAPTER_WEIGHTS))
    except (OSError, SafetensorError) as exc:
        raise PrimitiveError(f"path: no readable adapter ({ADAPTER_WEIGHTS}): {exc}") from None
    if not (folder / ADAPTER_CONFIG).is_file():
        raise PrimitiveError(f"path: no {ADAPTER_CONFIG}")
    params = _trainable(model)
    wanted = {saved_adapter_name(n): n for n in params}
    if set(wanted) != set(saved):
        missing = sorted(set(wanted) - set(saved))[:2]
        extra = sorted(set(saved) - set(wanted))[:2]
        raise PrimitiveError(
            f"path: the adapter does not fit this model (missing {missing}, unexpected {extra})"
        )
    tensors: dict[str, Tensor] = {}
    for key, name in wanted.items():
        param, value = params[name], saved[key]
        if value.shape != param.shape:
            raise PrimitiveError(
                f"path: adapter tensor {key} has shape {tuple(value.shape)}, this model's "
                f"{tuple(param.shape)} (another LoRA rank?)"
            )
        tensors[name] = value.to(device=param.device, dtype=param.dtype)
    return WeightsSnapshot(tensors)
