"""Two ranks against one process on this CPU: step time, peak memory per rank, and the share of
the step spent in collectives and in the weight gather.

    python -m bench.distributed_step [--steps 4] [--out bench/results/distributed_step.json]

SmolLM2-135M-Instruct with the vLLM engine learns single-digit addition (8 prompts x 4
completions a step, 32 new tokens). The same job runs twice from one seed: as a 1-device job in
one process with 2 torch threads, and as a 2-device job on 2 gloo ranks of 1 thread each (both
use the machine's 2 cores). Both runs go through torchrun and ``bench.distributed_rank``, which
profiles the run and sums the time spent inside collectives. The first step (engine warm-up)
is left out of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS_DIR, load_snapshot, machine_info
from jobspec import JobSpec


def spec(devices: int, steps: int) -> JobSpec:
    rows = [{"prompt": f"What is {a} + {b}? Answer with the number.", "answer": str(a + b)}
            for a in range(1, 5) for b in range(1, 5)]  # fmt: skip
    return JobSpec.model_validate(
        {
            "model": "smollm2-135m-instruct",
            "dataset": {"rows": rows, "use_chat_template": True},
            "graders": [{"type": "numeric_match", "name": "correct"}],
            "grpo": {
                "steps": steps,
                "prompts_per_step": 8,
                "group_size": 4,
                "max_new_tokens": 32,
                "max_prompt_tokens": 64,
                "learning_rate": 1e-5,
                "micro_batch_size": 8,
            },
            "rollout": {"engine": "vllm", "dtype": "float32"},
            "resources": {"devices": devices},
            "checkpoint_interval": 0,
            "seed": 0,
        }
    )


def run(devices: int, steps: int, work: Path) -> dict[str, Any]:
    work.mkdir(parents=True)
    spec_file = work / "spec.json"
    spec_file.write_text(spec(devices, steps).model_dump_json())
    env = {**os.environ, "OMP_NUM_THREADS": str(2 // devices), "BENCH_THREADS": str(2 // devices)}
    started = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc-per-node", str(devices), "-m", "bench.distributed_rank",
         str(spec_file), str(work)],
        env=env, check=True, capture_output=True, text=True,
    )  # fmt: skip
    wall = time.monotonic() - started
    ranks = [json.loads((work / f"rank{r}.json").read_text()) for r in range(devices)]
    steps_seen = ranks[0]["steps"]
    later = [steps_seen[k] for k in sorted(steps_seen, key=int)[1:]]
    step_s = statistics.median(m["time/step"] for m in later)
    sync_s = statistics.median(m.get("time/weight_sync", 0.0) for m in later)
    total_step_s = sum(m["time/step"] for m in steps_seen.values())
    out: dict[str, Any] = {
        "devices": devices,
        "wall_s": wall,
        "median_step_s": step_s,
        "median_rollout_s": statistics.median(m["time/rollout"] for m in later),
        "median_update_s": statistics.median(m["time/update"] for m in later),
        "median_weight_sync_s": sync_s,
        "weight_sync_share": sync_s / step_s,
        "collective_share_rank0": ranks[0]["collective_seconds"] / total_step_s,
        "reward_mean": [steps_seen[k]["reward/mean"] for k in sorted(steps_seen, key=int)],
    }
    out["peak_rss_gib_per_rank"] = [r["peak_rss_gib"] for r in ranks]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "distributed_step.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        one = run(1, args.steps, Path(tmp) / "one")
        two = run(2, args.steps, Path(tmp) / "two")
    result = {
        "machine": machine_info(),
        "load": load_snapshot(),
        "one_process": one,
        "two_ranks": two,
        "step_time_ratio_two_over_one": two["median_step_s"] / one["median_step_s"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
