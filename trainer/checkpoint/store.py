"""Atomic, resumable checkpoints.

A checkpoint is a folder ``checkpoint-<step:06d>`` in the run's output dir holding:

- the model (safetensors via ``save_pretrained``) and its tokenizer: a loadable HF model folder;
  for a LoRA job the adapters alone (``adapter_model.safetensors`` and ``adapter_config.json``,
  megabytes: the base never changes), which ``grpo export --merge`` turns into a full folder;
- ``optimizer.pt``: optimizer and learning-rate scheduler state (a multi-rank run keeps its
  optimizer state in ``sharded/`` instead: every rank's shards, ``trainer.checkpoint.sharded``);
- ``rng_state.pt``: python, numpy (when installed) and torch RNG states;
- ``manifest.json``: format version, step, sampler position and small trainer state.

It is written into a hidden temporary folder, every file fsynced, then renamed into place, so a
``checkpoint-*`` folder is always complete; a crash leaves only a temporary folder, which
:func:`sweep_temp_dirs` removes on the next start.

Which checkpoints are kept is the job spec's ``checkpoint`` section (``jobspec.checkpoint``:
the newest N and the best by a metric). :func:`prune_checkpoints` applies that rule to an output
folder, reading each checkpoint's metric value from its manifest (``extra[RETENTION_METRIC]``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from transformers import PreTrainedTokenizerBase

from jobspec.checkpoint import CheckpointSpec
from jobspec.checkpoint_files import (
    CHECKPOINT_PREFIX,
    MANIFEST,
    OPTIMIZER_FILE,
    RNG_FILE,
    SHARDED_DIR,
    TRASH_PREFIX,
    checkpoint_folder_name,
    checkpoint_step,
    remove_folder,
)
from trainer.checkpoint.durable import fsync_dir, fsync_tree
from trainer.checkpoint.sharded import load_sharded
from trainer.models.lora import ADAPTER_WEIGHTS, is_lora, load_adapter_weights

__all__ = [
    "CHECKPOINT_PREFIX",
    "RETENTION_METRIC",
    "TrainState",
    "checkpoint_path",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_checkpoint_weights",
    "prune_checkpoints",
    "save_checkpoint",
    "sweep_temp_dirs",
]

FORMAT_VERSION = 1
_TMP_PREFIX = ".tmp-checkpoint-"
# The key of a checkpoint's ``extra`` that holds ``{"name": metric, "value": float | None}``: the
# value of the spec's ``checkpoint.keep_best_by`` at or before the checkpoint's step.
RETENTION_METRIC = "retention_metric"


@dataclass
class TrainState:
    """What a checkpoint restores besides the tensors: the step and the loop's plain data."""

    step: int
    sampler: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None


# Where a checkpoint's optimizer state is: in optimizer.pt by position (one process), or
# sharded by torch.distributed.checkpoint in SHARDED_DIR (a multi-rank run: one file per
# rank, which DCP reads back at any world size, one process included).
_BY_POSITION, _SHARDED = "position", "sharded"


def new_temp_dir(output_dir: Path, step: int) -> Path:
    """A fresh temporary folder for the checkpoint of ``step`` (swept if never completed)."""
    root = Path(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{_TMP_PREFIX}{step:06d}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def checkpoint_path(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / checkpoint_folder_name(step)


# --------------------------------------------------------------------------- RNG


def _rng_states() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    states: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return states
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    states["numpy"] = [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    return states


def _restore_rng(states: dict[str, Any]) -> None:
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if "numpy" in states:
        try:
            import numpy as np
        except ImportError:
            return
        kind, keys, pos, has_gauss, cached = states["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


# --------------------------------------------------------------------------- listing


def list_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``output_dir`` as (step, path), oldest first."""
    out = []
    root = Path(output_dir)
    if not root.is_dir():
        return []
    for entry in root.iterdir():
        step = checkpoint_step(entry.name)
        if step is not None and entry.is_dir() and (entry / MANIFEST).is_file():
            out.append((step, entry))
    return sorted(out)


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    found = list_checkpoints(output_dir)
    return found[-1][1] if found else None


def sweep_temp_dirs(output_dir: Path) -> list[Path]:
    """Remove temporary and trash folders left by interrupted saves or deletes; returns them."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    swept = []
    for entry in root.iterdir():
        if entry.is_dir() and entry.name.startswith((_TMP_PREFIX, TRASH_PREFIX)):
            shutil.rmtree(entry, ignore_errors=True)
            swept.append(entry)
    return swept


def _retention_value(path: Path, metric: str) -> float | None:
    """The value of ``metric`` a checkpoint's manifest recorded for retention, or None."""
    try:
        entry = _read_manifest(path).get("extra", {}).get(RETENTION_METRIC)
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("name") != metric:
        return None
    value = entry.get("value")
    return float(value) if isinstance(value, int | float) else None


def prune_checkpoints(output_dir: Path, retention: CheckpointSpec) -> list[Path]:
    """Delete the checkpoints ``retention`` does not keep (``CheckpointSpec.kept_steps``, the
    newest always among the kept); returns the deleted paths."""
    found = list_checkpoints(output_dir)
    metric = retention.keep_best_by
    values = [(step, _retention_value(path, metric) if metric else None) for step, path in found]
    kept = retention.kept_steps(values)
    doomed = [path for step, path in found if step not in kept]
    for path in doomed:
        remove_folder(path)
    return doomed


# --------------------------------------------------------------------------- save / load


def save_checkpoint(
    output_dir: Path,
    step: int,
    *,
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase | None,
    optimizer: Optimizer,
    scheduler: LRScheduler | None,
    sampler: dict[str, Any],
    extra: dict[str, Any] | None = None,
    retention: CheckpointSpec | None = None,
    temp_dir: Path | None = None,
) -> Path:
    """Write ``checkpoint-<step>`` atomically, then delete the checkpoints ``retention`` does not
    keep (None: keep all; see :func:`prune_checkpoints`).

    ``temp_dir`` (from :func:`new_temp_dir`) is a multi-rank run's folder in the making, its
    ranks' shards already in ``SHARDED_DIR`` (:func:`save_sharded`): the optimizer state is
    read from there, not written again.

    ``sampler`` and ``extra`` must be JSON-serialisable; they come back in :class:`TrainState`.
    """
    root = Path(output_dir)
    final = checkpoint_path(root, step)
    tmp = temp_dir if temp_dir is not None else new_temp_dir(root, step)
    sharded = (tmp / SHARDED_DIR).is_dir()
    try:
        save_pretrained = getattr(model, "save_pretrained", None)
        if not callable(save_pretrained):
            raise TypeError(f"{type(model).__name__} has no save_pretrained")
        if is_lora(model):
            # Adapters only; the embeddings are never trained, so peft need not check them.
            save_pretrained(str(tmp), safe_serialization=True, save_embedding_layers=False)
        else:
            save_pretrained(str(tmp), safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        torch.save(
            {
                "optimizer": None if sharded else optimizer.state_dict(),
                "optimizer_keys": _SHARDED if sharded else _BY_POSITION,
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
            },
            tmp / OPTIMIZER_FILE,
        )
        torch.save(_rng_states(), tmp / RNG_FILE)
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "created_at": time.time(),
            "sampler": sampler,
            "extra": extra or {},
            "files": [*sorted(p.name for p in tmp.iterdir()), MANIFEST],
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        fsync_tree(tmp)
        if final.exists():
            # Same step saved before (a run resumed and stopped again): replace it.
            remove_folder(final)
        os.rename(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if retention is not None:
        prune_checkpoints(root, retention)
    return final


def _read_manifest(path: Path) -> dict[str, Any]:
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MANIFEST})")
    manifest = json.loads(manifest_file.read_text())
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(f"checkpoint {path} has format {version}, expected {FORMAT_VERSION}")
    return dict(manifest)


def load_model_weights(path: Path, model: nn.Module) -> None:
    """Load a checkpoint's safetensors weights into ``model`` in place.

    Weights that ``save_pretrained`` leaves out because they are tied to another parameter
    (e.g. lm_head tied to the embeddings) may be missing; any other missing or unexpected key
    is an error.
    """
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(str(path / shard)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    full = model.state_dict()
    loaded_storage = {full[k].data_ptr() for k in state if k in full}
    untied = [k for k in missing if full[k].data_ptr() not in loaded_storage]
    if untied or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match the model: missing {untied[:5]}, "
            f"unexpected {list(unexpected)[:5]}"
        )


def load_checkpoint_weights(path: Path, model: nn.Module) -> None:
    """A checkpoint's trained weights into ``model`` in place: the adapters of a LoRA
    checkpoint (into a LoRA model), the full weights otherwise."""
    if (path / ADAPTER_WEIGHTS).is_file():
        load_adapter_weights(path, model)
    else:
        load_model_weights(path, model)


def load_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: Optimizer | None,
    scheduler: LRScheduler | None,
    *,
    restore_rng: bool = True,
    weights: bool = True,
) -> TrainState:
    """Restore model weights, optimizer, scheduler and RNG states in place; returns the rest.

    A multi-rank run's checkpoint loads into one process too (its optimizer state through
    :func:`load_sharded`); a multi-rank run restores with ``optimizer`` None and ``weights``
    False (no whole copy of the weights on any rank) and then calls :func:`load_sharded` on its
    sharded policy, which holds the weights too."""
    path = Path(path)
    manifest = _read_manifest(path)
    if weights:
        load_checkpoint_weights(path, model)
    saved = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
    if optimizer is not None and saved.get("optimizer_keys") == _SHARDED:
        load_sharded(path / SHARDED_DIR, model, optimizer)
    elif optimizer is not None:
        optimizer.load_state_dict(saved["optimizer"])
    if scheduler is not None and saved.get("scheduler") is not None:
        scheduler.load_state_dict(saved["scheduler"])
    if restore_rng:
        _restore_rng(torch.load(path / RNG_FILE, map_location="cpu", weights_only=True))
    return TrainState(
        step=int(manifest["step"]),
        sampler=dict(manifest["sampler"]),
        extra=dict(manifest.get("extra", {})),
        path=path,
    )
