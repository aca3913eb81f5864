"""A multi-rank run's weights and optimizer state as torch.distributed.checkpoint writes them:
one file per rank in the checkpoint's ``sharded`` folder, plus DCP's metadata, which DCP reads
back at any world size (one process included) and reshards on the way."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer

__all__ = ["load_sharded", "save_sharded"]


def save_sharded(folder: Path, model: nn.Module, optimizer: Optimizer) -> None:
    """Every rank writes its shards of the weights and optimizer state into ``folder`` (a
    collective: every rank calls it)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(folder))


def load_sharded(folder: Path, model: nn.Module, optimizer: Optimizer) -> None:
    """Read a multi-rank checkpoint's weights and optimizer state into ``model`` and
    ``optimizer``, sharded or not (every rank of a distributed run calls it)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    # dcp.load fills the dicts' tensors in place (each rank its shards).
    single = not dist.is_initialized()
    with warnings.catch_warnings():
        # One process reading a multi-rank checkpoint is what DCP warns about, and intended.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(
            {"model": model_state, "optimizer": optimizer_state},
            checkpoint_id=str(folder),
            no_dist=single,
        )
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
