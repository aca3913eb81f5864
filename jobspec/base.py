"""The bounds every section of the job spec shares: how many rows, steps, tokens and characters
a job may hold. Each section is a :class:`specbase.StrictModel` (re-exported by ``jobspec``):
unknown fields refused, floats finite, text storable."""

from __future__ import annotations

__all__ = [
    "MAX_HOLDOUT_ROWS",
    "MAX_INLINE_ROWS",
    "MAX_SEED",
    "MAX_STEPS",
    "MAX_TEXT_CHARS",
    "MAX_TOKENS",
]

MAX_INLINE_ROWS = 100_000
MAX_HOLDOUT_ROWS = 10_000  # rows held out for evaluation (dataset.holdout, a validation file)
MAX_TEXT_CHARS = 20_000
MAX_SEED = 2**31 - 1
MAX_STEPS = 100_000
MAX_TOKENS = 32_768
