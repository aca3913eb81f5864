"""A training session's saved state: everything a load needs to continue exactly.

A state folder holds:

- the adapter (``adapter_model.safetensors``, ``adapter_config.json``): a state is also a
  sampler-weights folder an inference engine can load;
- ``optimizer.pt``: AdamW's state (both moments and each tensor's step count);
- ``session.json``: the format version, the session's settings (LoRA rank and parts, dtype,
  base model name) and how many optimizer steps it has taken.

Gradients accumulated since the last ``optim_step`` are not saved: a state is taken between
steps. Folders are written beside their final name, fsynced, then renamed into place, so a
folder either is complete or does not exist.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint.durable import write_atomically
from trainer.primitives.types import PrimitiveError

__all__ = [
    "OPTIMIZER_FILE",
    "SESSION_FILE",
    "SessionSettings",
    "read_optimizer",
    "read_settings",
    "write_atomically",
    "write_state_files",
]

FORMAT_VERSION = 1
SESSION_FILE = "session.json"
OPTIMIZER_FILE = "optimizer.pt"
_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class SessionSettings:
    """How a session's model was made: enough to make it again around a saved state. (The
    server's limits on calls are not part of it: they are the loading server's.)"""

    lora_rank: int
    train_attn: bool
    train_mlp: bool
    train_unembed: bool
    dtype: str
    base_model: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """The name :class:`SessionSettings` records for ``dtype``; ValueError for one it cannot."""
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"dtype {dtype} is not one of {', '.join(_DTYPES)}")


def write_state_files(
    folder: Path, settings: SessionSettings, steps: int, optimizer_state: dict[str, Any]
) -> None:
    """``session.json`` and ``optimizer.pt`` into ``folder`` (the adapter is written apart)."""
    record = {"format": FORMAT_VERSION, "steps": steps, "settings": asdict(settings)}
    (folder / SESSION_FILE).write_text(json.dumps(record, indent=1))
    torch.save(optimizer_state, folder / OPTIMIZER_FILE)


def read_settings(folder: Path) -> tuple[SessionSettings, int]:
    """A state folder's settings and step count; PrimitiveError when it is not a state this
    version can read."""
    path = Path(folder) / SESSION_FILE
    try:
        record = json.loads(path.read_text())
        if record["format"] != FORMAT_VERSION:
            raise PrimitiveError(
                f"path: state format {record['format']}, this server reads {FORMAT_VERSION}"
            )
        settings = SessionSettings(**record["settings"])
        steps = int(record["steps"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if isinstance(exc, PrimitiveError):
            raise
        raise PrimitiveError(f"path: not a saved training state ({SESSION_FILE}: {exc})") from None
    if settings.dtype not in _DTYPES:
        raise PrimitiveError(f"path: unknown dtype {settings.dtype!r} in {SESSION_FILE}")
    return settings, steps


def read_optimizer(folder: Path, device: torch.device | str) -> dict[str, Any]:
    """The optimizer state saved in ``folder`` (tensors only: nothing executable is
    unpickled)."""
    try:
        state = torch.load(Path(folder) / OPTIMIZER_FILE, map_location=device, weights_only=True)
    except (OSError, RuntimeError) as exc:
        raise PrimitiveError(
            f"path: no readable optimizer state ({OPTIMIZER_FILE}): {exc}"
        ) from None
    if not isinstance(state, dict):
        raise PrimitiveError(f"path: {OPTIMIZER_FILE} holds no optimizer state")
    return state
