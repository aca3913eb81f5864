"""``GRPO_DIST_TIMEOUT_S``, read in one place: the ranks (``world``) and the process that
launches them (``trainer.run.launch``, which must not load torch) both call
:func:`dist_timeout_s`; and the longer bound of a checkpoint's reads and writes
(:func:`checkpoint_timeout_s`). Torch-free."""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = [
    "CHECKPOINT_DISK_BYTES_PER_S",
    "CHECKPOINT_MARGIN",
    "DEFAULT_TIMEOUT_S",
    "TIMEOUT_ENV",
    "checkpoint_timeout_s",
    "dist_timeout_s",
]

TIMEOUT_ENV = "GRPO_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0
# A conservative sustained speed of the disk a checkpoint goes to (a network file system, or a
# local disk every rank of a node writes to at once), and the headroom over the time it gives.
CHECKPOINT_DISK_BYTES_PER_S = 200e6
CHECKPOINT_MARGIN = 2.0


def dist_timeout_s(environ: Mapping[str, str] | None = None) -> float:
    """How long a collective, rank 0's connection or its wait for an answer may take."""
    env = os.environ if environ is None else environ
    timeout = float(env.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    if timeout <= 0:
        raise ValueError(f"{TIMEOUT_ENV} must be > 0, got {timeout}")
    return timeout


def checkpoint_timeout_s(
    world_timeout_s: float,
    checkpoint_bytes: float,
    *,
    disk_bytes_per_s: float = CHECKPOINT_DISK_BYTES_PER_S,
    margin: float = CHECKPOINT_MARGIN,
) -> float:
    """How long a rank may wait for its peers while a checkpoint of ``checkpoint_bytes`` is
    written or read: the transfer at a conservative disk speed, ``margin`` times over, and never
    less than the world's timeout. The world's timeout bounds a step's collectives, but rank 0
    alone writes a full fine-tune's weights (28 GB in float32 at 7B, 56 GB at 14B) while the
    others wait at its barrier: at 200 MB/s that alone is 140 s and 280 s, and the ranks' shards
    of the weights and Adam's moments come on top (about 84 GB at 7B: 840 s with the margin,
    past the 600 s default)."""
    if checkpoint_bytes < 0 or disk_bytes_per_s <= 0 or margin <= 0:
        raise ValueError(
            f"checkpoint_timeout_s needs bytes >= 0 and a positive speed and margin, got "
            f"{checkpoint_bytes}, {disk_bytes_per_s}, {margin}"
        )
    return max(world_timeout_s, checkpoint_bytes / disk_bytes_per_s * margin)
