"""Python grader throughput: the sandbox pool against the same function called in-process.

    python -m bench.python_grader [--samples 64] [--rounds 5] [--processes 2]

The grader is a realistic small one (parse the last number, compare with item["answer"]). One
pool is started first (its start-up is reported apart: it happens once per job), then each
round grades ``--samples`` completions; the median round is compared with calling ``grade``
directly in this process, and with a SmolLM2-135M CPU step (BENCHMARKS.md section 2: 63.8 s
for 64 completions with the vLLM engine), the issue's yardstick: under 10% of a step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from grading.sandbox import SandboxPool, build_sandbox_settings

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_STEP_S = 63.8  # BENCHMARKS.md section 2, ours with the vLLM engine, 64 completions
SOURCE = """
import re

def grade(sample, item):
    numbers = re.findall(r"-?\\\\d+", sample["output_text"])
    return 1.0 if numbers and numbers[-1] == item["answer"] else 0.0
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "python_grader.json"
    )
    args = parser.parse_args(argv)
    samples = [{"output_text": f"2 + {i} = {i + 2}"} for i in range(args.samples)]
    items = [{"answer": str(i + 2 if i % 3 else i)} for i in range(args.samples)]

    namespace: dict[str, object] = {}
    exec(SOURCE, namespace)
    grade = namespace["grade"]
    started = time.perf_counter()
    for _ in range(args.rounds):
        expected = [grade(s, i) for s, i in zip(samples, items, strict=True)]  # type: ignore[operator]
    in_process = (time.perf_counter() - started) / args.rounds

    settings = build_sandbox_settings(processes=args.processes)
    started = time.perf_counter()
    pool = SandboxPool(SOURCE, settings)
    pool.grade(samples[:1], items[:1])  # start the sandboxes (one per process)
    pool.grade(samples[: args.processes], items[: args.processes])
    startup = time.perf_counter() - started
    rounds = []
    try:
        for _ in range(args.rounds):
            started = time.perf_counter()
            verdicts = pool.grade(samples, items)
            rounds.append(time.perf_counter() - started)
            assert [v.score for v in verdicts] == expected
    finally:
        pool.close()
    median = statistics.median(rounds)
    result = {
        "samples": args.samples,
        "processes": args.processes,
        "startup_s": startup,
        "sandbox_round_s": rounds,
        "sandbox_median_s": median,
        "sandbox_samples_per_s": args.samples / median,
        "in_process_s": in_process,
        "overhead_s": median - in_process,
        "share_of_smollm2_step": median / SMOLLM2_STEP_S,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(
        f"{args.samples} samples: sandbox {median * 1000:.1f} ms ({args.samples / median:.0f}/s, "
        f"{args.processes} processes), in-process {in_process * 1000:.2f} ms; start-up "
        f"{startup:.2f} s once; {100 * median / SMOLLM2_STEP_S:.2f}% of a SmolLM2 CPU step"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
