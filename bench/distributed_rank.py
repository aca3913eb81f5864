"""One rank of the distributed-step benchmark (``bench.distributed_step`` starts it through
torchrun): trains the spec under torch's profiler and writes rank 0's step metrics and each
rank's seconds inside collectives (gloo/nccl all-gather, reduce-scatter, all-reduce,
broadcast) to ``OUT/rank<r>.json``."""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from jobspec import JobSpec
from trainer.run.callbacks import Callbacks
from trainer.run.loop import train

COLLECTIVE_MARKS = ("all_gather", "allgather", "reduce_scatter", "all_reduce", "allreduce",
                    "broadcast", "gloo:", "nccl:")  # fmt: skip


class _Steps(Callbacks):
    def __init__(self) -> None:
        self.steps: dict[int, dict[str, float]] = {}

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        self.steps[step] = metrics


def main() -> None:
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    spec = JobSpec.model_validate_json(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    seen = _Steps()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train(spec, seen, output_dir=out / "run")
    collective = sum(
        e.self_cpu_time_total
        for e in prof.key_averages()
        if any(mark in e.key.lower() for mark in COLLECTIVE_MARKS)
    )
    rank = int(os.environ.get("RANK", "0"))
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "steps": seen.steps,
                "collective_seconds": collective / 1e6,
                "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            }
        )
    )


if __name__ == "__main__":
    main()
