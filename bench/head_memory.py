"""The output head's cost on CPU: peak memory and time of one float32 GRPO update of a random
model of Qwen2.5-0.5B's shapes (its full 151,936-word vocabulary, fewer decoder layers: see
``--layers``) with the plain checkpointed head and with the fused one
(``trainer.update.fused_head``), side by side from one run.

    python -m bench.head_memory             # writes bench/results/head_memory.json

Each head runs in its own subprocess, one after the other, so that each has its own peak
resident set (Linux's high-water mark ``VmHWM``, weights, gradients and AdamW state included),
over the updates (``peak``) and over their forward and backward passes alone, up to the
optimizer step (``forward_backward_peak``: :class:`PhasePeaks`). ``static`` is the resident set
once the model is built, before any update; a peak less ``static`` is what the update adds.
Time: the median of the timed updates after one warm-up (which also allocates AdamW's state).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from bench.update_parts import (
    HEADS,
    Shape,
    build_policy,
    fixed_batch,
    grpo_spec,
    head_name,
    qwen25_05b_config,
    timed_updates,
)

RESULTS = Path(__file__).resolve().parent / "results" / "head_memory.json"
GIB = 2**30


def _rss_bytes() -> int:
    """The current resident set (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


class PhasePeaks:
    """The resident set's high-water mark per phase: reset (``/proc/self/clear_refs``, 5)
    before each update and read (``VmHWM``) when the optimizer step begins, so the forward
    and backward passes' peak is told apart from AdamW's step (whose temporaries of the
    whole parameter size set the process's overall peak on this small a model)."""

    def __init__(self) -> None:
        self.forward_backward = 0
        self.updates = 0  # the high-water mark of the updates (model building left out)
        self.started = False

    def __call__(self, phase: str) -> None:
        if phase == "update":
            if self.started:
                self.updates = max(self.updates, _hwm_bytes())
            self.started = True
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        else:
            self.forward_backward = max(self.forward_backward, _hwm_bytes())

    def overall(self) -> int:
        return max(self.updates, _hwm_bytes())


def _hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One head's measurement, in this process."""
    torch.set_num_threads(args.threads)
    config = qwen25_05b_config()
    config.num_hidden_layers = args.layers
    shape = Shape(args.rows, args.prompt_tokens, args.completion_tokens, args.micro_batch_size)
    model = build_policy(config, torch.device("cpu"), None)
    batch, advantages = fixed_batch(config, shape, torch.device("cpu"))
    static = _rss_bytes()
    spec = grpo_spec(shape, dtype="float32")
    peaks = PhasePeaks()
    times, losses = timed_updates(model, spec, batch, advantages, args.steps, args.child, peaks)
    peak = peaks.overall()
    return {
        "head": args.child,
        "step_s": statistics.median(times),
        "steps_s": times,
        "static_rss_gib": static / GIB,
        "peak_rss_gib": peak / GIB,
        "update_gib": (peak - static) / GIB,
        "forward_backward_peak_gib": peaks.forward_backward / GIB,
        "forward_backward_adds_gib": (peaks.forward_backward - static) / GIB,
        "policy_loss": losses,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def _run_child(head: str, argv: list[str]) -> dict[str, Any]:
    command = [sys.executable, "-m", "bench.head_memory", "--child", head, *argv]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--layers", type=int, default=2, help="decoder layers (Qwen2.5-0.5B has 24)"
    )
    parser.add_argument("--rows", type=int, default=8, help="completions in the batch")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--completion-tokens", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1, help="timed updates after a warm-up")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--heads", default="plain,fused", help="run in this order")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return parser


def _forwarded(args: argparse.Namespace) -> list[str]:
    """The measurement's options, for a child."""
    names = ("layers", "rows", "prompt_tokens", "completion_tokens", "micro_batch_size")
    pairs = [(f"--{n.replace('_', '-')}", str(getattr(args, n))) for n in names]
    pairs += [("--steps", str(args.steps)), ("--threads", str(args.threads))]
    return [item for pair in pairs for item in pair]


def _ratios(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    fused, plain = results["fused"], results["plain"]
    keys = ["peak_rss_gib", "update_gib", "forward_backward_peak_gib"]
    keys += ["forward_backward_adds_gib", "step_s"]
    return {key: fused[key] / plain[key] for key in keys}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.child is not None:
        args.child = head_name(args.child)
        print(json.dumps(child(args)), flush=True)
        return 0
    heads = [head_name(h.strip()) for h in args.heads.split(",") if h.strip()]
    shape = Shape(args.rows, args.prompt_tokens, args.completion_tokens, args.micro_batch_size)
    print(
        f"float32 update on CPU ({args.threads} threads), Qwen2.5-0.5B shapes with "
        f"{args.layers} layers, {shape.rows} x ({shape.prompt_tokens} + "
        f"{shape.completion_tokens}) tokens, micro-batches of {shape.micro_batch_size}"
    )
    started = time.time()
    results: dict[str, dict[str, Any]] = {}
    for head in heads:
        results[head] = _run_child(head, _forwarded(args))
        r = results[head]
        print(
            f"{head:>6} head: step {r['step_s']:.1f} s, peak RSS {r['peak_rss_gib']:.2f} GiB "
            f"(static {r['static_rss_gib']:.2f}); forward + backward peak "
            f"{r['forward_backward_peak_gib']:.2f} GiB (adds {r['forward_backward_adds_gib']:.2f})",
            flush=True,
        )
    ratios = _ratios(results) if set(HEADS) <= set(results) else {}
    if ratios:
        print(
            f"fused/plain: peak RSS {ratios['peak_rss_gib']:.2f}x, forward + backward peak "
            f"{ratios['forward_backward_peak_gib']:.2f}x (what it adds "
            f"{ratios['forward_backward_adds_gib']:.2f}x), step {ratios['step_s']:.2f}x"
        )
    record = {
        "benchmark": "head_memory",
        "machine": {"cpus": len(__import__("os").sched_getaffinity(0)), **_machine()},
        "torch": torch.__version__,
        "layers": args.layers,
        "shape": asdict(shape),
        "wall_s": time.time() - started,
        "results": results,
        "fused_over_plain": ratios,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


def _machine() -> dict[str, Any]:
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    return {"platform": platform.platform(), "processor": platform.processor(), "load": load}


if __name__ == "__main__":
    sys.exit(main())
