"""``GRPO_DIST_TIMEOUT_S``, read in one place: the ranks (``world``) and the process that
launches them (``trainer.run.launch``, which must not load torch) both call
:func:`dist_timeout_s`. Torch-free."""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["DEFAULT_TIMEOUT_S", "TIMEOUT_ENV", "dist_timeout_s"]

TIMEOUT_ENV = "GRPO_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0


def dist_timeout_s(environ: Mapping[str, str] | None = None) -> float:
    """How long a collective, rank 0's connection or its wait for an answer may take."""
    env = os.environ if environ is None else environ
    timeout = float(env.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    if timeout <= 0:
        raise ValueError(f"{TIMEOUT_ENV} must be > 0, got {timeout}")
    return timeout
