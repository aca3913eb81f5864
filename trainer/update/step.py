"""Kept importable under its old name: the :class:`~trainer.update.batch.Batch` record and its
packing were declared here (outside checks import ``Batch`` from this path). They live in
:mod:`trainer.update.batch`."""

from __future__ import annotations

from trainer.update.batch import *  # noqa: F403  (the same names, declared there once)
from trainer.update.batch import __all__ as __all__
