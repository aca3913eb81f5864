"""The file names of a checkpoint folder that are the trainer's own resume state, torch-free.

A checkpoint folder (``trainer.checkpoint``) holds a loadable model (or LoRA adapters) and
tokenizer, plus these files, which only the trainer reads back. Everything that hands a
checkpoint's model to someone else leaves them out: ``grpo export`` (``trainer.export``) and the
API's checkpoint download (``app.services.checkpoint_download``), which must not import torch.
"""

from __future__ import annotations

__all__ = ["MANIFEST", "OPTIMIZER_FILE", "RNG_FILE", "TRAINER_FILES", "is_model_file"]

MANIFEST = "manifest.json"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng_state.pt"
TRAINER_FILES = frozenset({MANIFEST, OPTIMIZER_FILE, RNG_FILE})


def is_model_file(name: str) -> bool:
    """Whether a file of a checkpoint folder belongs to the model export (not resume state)."""
    return name not in TRAINER_FILES
