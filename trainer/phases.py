"""Kept importable under its old name: ``trainer.phases.compute_advantages(shaped, penalty,
spec)`` is the documented place where the task reward and the reward-side KL penalty are
combined (issue 23), and outside checks call it by that path. The phases live in
:mod:`trainer.update.inputs`."""

from __future__ import annotations

from trainer.update.inputs import *  # noqa: F403  (the same names, declared there once)
from trainer.update.inputs import __all__ as __all__
