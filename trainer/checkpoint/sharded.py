"""A multi-rank run's trained weights and optimizer state as torch.distributed.checkpoint writes
them: one file per rank in the checkpoint's ``sharded`` folder, plus DCP's metadata, which DCP
reads back at any world size (one process included) and reshards on the way.

Only the trainable parameters (``requires_grad``) and their optimizer state are written: a
frozen parameter never changes, so the model a resume builds from the base model already holds
it. For a full fine-tune that is every parameter; for LoRA the adapters alone (about 63 MB at
7B instead of the whole 30 GB base). Checkpoints written before, with the frozen base in them,
still load: DCP reads the keys asked for and leaves the others on disk."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.optim import Optimizer

__all__ = ["frozen_parameter_names", "load_sharded", "save_sharded"]


def frozen_parameter_names(model: nn.Module) -> set[str]:
    """The names (as ``model.state_dict()`` spells them) of the parameters no optimizer
    updates: a LoRA model's base; none for a full fine-tune. Tied names count each (a tied
    output head is listed beside the embeddings it shares), which torch's own
    ``ignore_frozen_params`` misses: it walks the deduplicated parameters and would still
    write a frozen tied head."""
    return {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def _trained_state(model: nn.Module, optimizer: Optimizer) -> tuple[dict[str, Any], Any]:
    """DCP's state dicts of ``model`` and ``optimizer`` without the frozen parameters: the
    trainable ones (DTensor shards when sharded), the persistent buffers, the optimizer's
    state by parameter name."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    frozen = frozen_parameter_names(model)
    return {k: v for k, v in model_state.items() if k not in frozen}, optimizer_state


def save_sharded(folder: Path, model: nn.Module, optimizer: Optimizer, group: Any = None) -> None:
    """Every rank writes its shards of the trainable weights and their optimizer state into
    ``folder`` (a collective: every rank calls it, in ``group``, the default one when None)."""
    model_state, optimizer_state = _trained_state(model, optimizer)
    dcp.save(
        {"model": model_state, "optimizer": optimizer_state},
        checkpoint_id=str(folder),
        process_group=group,
    )


def load_sharded(folder: Path, model: nn.Module, optimizer: Optimizer, group: Any = None) -> None:
    """Read a multi-rank checkpoint's trained weights and optimizer state into ``model`` and
    ``optimizer``, sharded or not (every rank of a distributed run calls it, in ``group``); the
    frozen parameters stay as the model was built."""
    model_state, optimizer_state = _trained_state(model, optimizer)
    # dcp.load fills the dicts' tensors in place (each rank its shards).
    single = not dist.is_initialized()
    with warnings.catch_warnings():
        # One process reading a multi-rank checkpoint is what DCP warns about, and intended.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(
            {"model": model_state, "optimizer": optimizer_state},
            checkpoint_id=str(folder),
            process_group=None if single else group,
            no_dist=single,
        )
    set_state_dict(
        model,
        optimizer,
        model_state_dict=model_state,
        optim_state_dict=optimizer_state,
        # The frozen parameters are absent by design; a trainable one cannot be: dcp.load
        # refuses a checkpoint that lacks a key asked for ("Missing key in checkpoint").
        options=StateDictOptions(strict=False),
    )
