"""A rank of a test job: ``torchrun ... rank_job.py SPEC_JSON OUTPUT_DIR [RESUME_FROM]``.

Trains the spec with ``trainer.run.loop.train`` in the world torchrun describes, on one torch
thread (two ranks share the 2-core machine); rank 0 writes what its callbacks saw to
``OUTPUT_DIR/rank0-steps.json``."""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

import torch

from jobspec import JobSpec
from trainer.run.callbacks import Callbacks
from trainer.run.loop import train


class _Steps(Callbacks):
    def __init__(self) -> None:
        self.steps: dict[int, dict[str, float]] = {}

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        self.steps[step] = metrics


def main() -> None:
    faulthandler.enable()  # a native crash of a rank prints its Python stack
    torch.set_num_threads(1)
    spec = JobSpec.model_validate_json(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    resume = Path(sys.argv[3]) if len(sys.argv) > 3 else None
    seen = _Steps()
    train(spec, seen, output_dir=out, resume_from=resume)
    if os.environ.get("RANK", "0") == "0":  # the other ranks' callbacks are never called
        (out / "rank0-steps.json").write_text(json.dumps(seen.steps))


if __name__ == "__main__":
    main()
