"""Asynchronous GRPO against the synchronous step: one recipe, same seed, trained with
``grpo.async.max_staleness`` K for each K of ``--ks`` (0 = synchronous), one after the other, each
configuration in a fresh subprocess (its own memory and threads).

    .venv/bin/python -m bench.async_grpo                      # smollm2-arithmetic, K = 0,1,2
    .venv/bin/python -m bench.async_grpo --recipe recipes/tiny-smoke.yaml --steps 8

The recipe file is not edited: steps, eval interval, max_staleness, the mismatch bound (high, so
no run pauses), the server's threads and ``checkpoint_interval: 0`` are set on the loaded spec;
``--set grpo.prompts_per_step=4`` changes any other field. An async run's trainer gets
``--threads`` torch threads and its rollout server ``--server-threads``; the synchronous run,
whose engine is in-process and takes turns with the update, gets their sum (``--sync-threads``).
The callbacks record every step's metrics and wall clock and every held-out eval with its time;
the driver samples /proc/loadavg and the CPU each configuration used.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.common import RESULTS_DIR, CpuWindow, load_snapshot, machine_info, median, write_json

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RECIPE = Path("recipes/smollm2-arithmetic.yaml")
PHASES = ("rollout", "reward", "logprobs", "update", "weight_sync", "step", "wait_for_rollouts")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", type=Path, default=DEFAULT_RECIPE)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--ks", default="0,1,2", help="max_staleness values; 0 = synchronous")
    p.add_argument("--eval-interval", type=int, default=4)
    p.add_argument("--threshold", type=float, default=0.9, help="held-out accuracy to reach")
    p.add_argument("--threads", type=int, default=1, help="trainer torch threads (async)")
    p.add_argument("--server-threads", type=int, default=1, help="rollout server threads")
    p.add_argument("--sync-threads", type=int, default=None, help="default: the two summed")
    p.add_argument("--max-mismatch", type=float, default=100.0, help="grpo.async.max_mismatch")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="spec field")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sync_threads = args.sync_threads or args.threads + args.server_threads
    return args


def overrides_for(args: argparse.Namespace, k: int) -> dict[str, Any]:
    import yaml

    out: dict[str, Any] = {
        "grpo.steps": args.steps,
        "eval.interval": args.eval_interval,
        "checkpoint_interval": 0,
        "grpo.async.max_staleness": k,
        "grpo.async.max_mismatch": args.max_mismatch,
        "grpo.async.max_capped_frac": 1.0,  # measured, not guarded: no run pauses
    }
    if k:
        out["grpo.async.server_threads"] = args.server_threads
    for item in args.set:
        key, _, value = item.partition("=")
        out[key] = yaml.safe_load(value)
    return out


def build_spec(recipe: Path, overrides: dict[str, Any]) -> Any:
    import yaml

    from jobspec import JobSpec

    data = yaml.safe_load(recipe.read_text())
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return JobSpec.model_validate(data)


def run_child(args: argparse.Namespace) -> None:
    """One configuration: ``train`` with a recording Callbacks, the record to --child-out."""
    k = int(args.child)
    threads = args.threads if k else args.sync_threads
    os.environ["OMP_NUM_THREADS"] = str(threads)  # before torch and vLLM load
    born = time.perf_counter()
    import torch
    import vllm

    torch.set_num_threads(threads)
    from trainer.run.callbacks import Callbacks
    from trainer.run.loop import train

    overrides = overrides_for(args, k)
    spec = build_spec(args.recipe, overrides)
    steps: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    events: list[str] = []
    clock: dict[str, float] = {}

    class Recorder(Callbacks):
        def on_start(self, info: Any) -> None:
            clock["start"] = clock["last"] = time.perf_counter()

        def on_step(self, step: int, metrics: dict[str, float]) -> None:
            now = time.perf_counter()
            t, wall = now - clock["start"], now - clock["last"]
            clock["last"] = now
            load = os.getloadavg()[0]
            steps.append({"step": step, "t": t, "wall": wall, "loadavg_1m": load, **metrics})
            wait = metrics.get("time/wait_for_rollouts", 0.0)
            print(
                f"[K={k}] step {step}: at {t:.0f} s, wall {wall:.1f} s, wait {wait:.1f} s, "
                f"reward {metrics.get('reward/mean', float('nan')):.3f}, load {load:.1f}",
                flush=True,
            )

        def on_event(self, kind: str, message: str, level: str = "info", data: Any = None) -> None:
            if kind == "eval" and data is not None:
                t = time.perf_counter() - clock.get("start", born)
                evals.append({"step": data["step"], "accuracy": data["accuracy"], "t": t})
                print(f"[K={k}] {message} at {t:.0f} s", flush=True)
            if (level != "info" or kind in {"eval", "paused"}) and len(events) < 100:
                events.append(f"{level} {kind}: {message}")

    out_dir = Path(tempfile.mkdtemp(prefix="async-grpo-bench-"))
    result: dict[str, Any] = {"k": k, "trainer_threads": threads, "overrides": overrides}
    result["server_threads"] = args.server_threads if k else None
    try:
        res = train(spec, Recorder(), output_dir=out_dir)
        result.update(stopped_early=res.stopped_early, pause_reason=res.pause_reason, error=None)
    except Exception as exc:  # recorded, so the other configurations still run
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    result.update(setup_s=clock.get("start", born) - born, process_s=time.perf_counter() - born)
    result.update(steps=steps, evals=evals, events=events)
    result["versions"] = {"torch": torch.__version__, "vllm": vllm.__version__}
    write_json(args.child_out, result)


class LoadSampler(threading.Thread):
    """/proc/loadavg every ``interval`` seconds, tagged with the configuration running."""

    def __init__(self, interval: float = 5.0) -> None:
        super().__init__(daemon=True)
        self.interval, self.label, self.t0 = interval, "", time.perf_counter()
        self.samples: list[dict[str, Any]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            one, five = (float(x) for x in Path("/proc/loadavg").read_text().split()[:2])
            t = round(time.perf_counter() - self.t0, 1)
            self.samples.append({"t": t, "config": self.label, "1m": one, "5m": five})
            self.done.wait(self.interval)

    def summary(self, label: str) -> dict[str, Any]:
        ones = [s["1m"] for s in self.samples if s["config"] == label]
        if not ones:
            return {}
        return {
            "samples": len(ones),
            "min_1m": min(ones),
            "mean_1m": statistics.fmean(ones),
            "max_1m": max(ones),
        }


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summarize(run: dict[str, Any], threshold: float) -> dict[str, Any]:
    """The figures of one configuration; per-step ones over the steps after the first."""
    steps, k = run.get("steps", []), run["k"]
    later, evals = steps[1:], run.get("evals", [])

    def col(key: str, rows: list[dict[str, Any]] = later) -> list[float]:
        return [r[key] for r in rows if key in r]

    walls, mismatch = col("wall"), col("mismatch/token_mult_prob_error", steps)
    if k:
        rollout_busy, update_busy = col("async/rollout_busy_frac"), col("async/update_busy_frac")
    else:  # the same fractions of the synchronous step: its phases over its wall time
        rollout_busy = [(r["time/rollout"] + r["time/reward"]) / r["wall"] for r in later]
        update_busy = [(r["time/logprobs"] + r["time/update"]) / r["wall"] for r in later]
    reached = next((e for e in evals if e["accuracy"] >= threshold), None)
    return {
        "k": k,
        "error": run.get("error"),
        "steps_done": len(steps),
        "pause_reason": run.get("pause_reason"),
        "wall_per_step_mean_s": _mean(walls),
        "wall_per_step_median_s": median(walls) if walls else None,
        "first_step_wall_s": steps[0]["wall"] if steps else None,
        "train_wall_s": steps[-1]["t"] if steps else None,
        "setup_s": run.get("setup_s"),
        "process_wall_s": run.get("process_s"),
        "threshold_reached_at_step": None if reached is None else reached["step"],
        "threshold_reached_at_s": None if reached is None else reached["t"],
        "evals_step_accuracy_s": [(e["step"], e["accuracy"], round(e["t"], 1)) for e in evals],
        "final_accuracy": evals[-1]["accuracy"] if evals else None,
        "rollout_busy_frac_mean": _mean(rollout_busy),
        "update_busy_frac_mean": _mean(update_busy),
        "phase_means_s": {p: _mean(col(f"time/{p}")) for p in PHASES},
        "staleness_max": max(col("async/staleness_max", steps), default=None),
        "staleness_mean": _mean(col("async/staleness_mean", steps)),
        "dropped_stale": sum(col("async/dropped_stale", steps)),
        "server_restarts": max(col("rollout/server_restarts", steps), default=None),
        "token_mult_prob_error_range": [min(mismatch), max(mismatch)] if mismatch else None,
        "reward_mean_by_step": [r.get("reward/mean") for r in steps],
    }


def run_config(argv: list[str], k: int, load: LoadSampler, tmp: Path) -> dict[str, Any]:
    """Configuration ``k`` in a fresh subprocess (the driver's options, plus --child K)."""
    child_out, load.label = tmp / f"k{k}.json", f"K={k}"
    cmd = [sys.executable, "-m", "bench.async_grpo", *argv, "--child", str(k)]
    print(f"== K={k}", flush=True)
    window, cpu0 = CpuWindow(), resource.getrusage(resource.RUSAGE_CHILDREN)
    code = subprocess.run([*cmd, "--child-out", str(child_out)], cwd=ROOT, check=False).returncode
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # trainer + server (the trainer reaps it)
    run: dict[str, Any] = {"k": k, "error": f"child exited {code} without a result"}
    if child_out.is_file():
        run = json.loads(child_out.read_text())
    run.update(exit_code=code, machine_cpu=window.close(), loadavg=load.summary(f"K={k}"))
    run["config_cpu_s"] = cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime
    return run


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child is not None:
        run_child(args)
        return
    ks = [int(x) for x in args.ks.split(",")]
    default = args.recipe.stem == DEFAULT_RECIPE.stem
    out = args.out or RESULTS_DIR / (
        "async_grpo.json" if default else f"async_grpo_{args.recipe.stem}.json"
    )
    load = LoadSampler()
    load.start()
    argv_shown = argv if argv is not None else sys.argv[1:]
    result: dict[str, Any] = {
        "command": " ".join(["python -m bench.async_grpo", *argv_shown]),
        "recipe": str(args.recipe),
        "threshold": args.threshold,
        "threads": {
            "async_trainer": args.threads,
            "async_server": args.server_threads,
            "sync": args.sync_threads,
        },
        "machine": machine_info(),
        "load_before": load_snapshot(),
        "summary": [],
        "runs": [],
    }
    tmp = Path(tempfile.mkdtemp(prefix="async-grpo-driver-"))
    try:
        for k in ks:
            run = run_config(argv_shown, k, load, tmp)
            result["runs"].append(run)
            s = summarize(run, args.threshold)
            s.update(loadavg=run["loadavg"], machine_busy=run["machine_cpu"]["machine_busy"])
            s["config_cores_used"] = run["config_cpu_s"] / max(run["machine_cpu"]["wall_s"], 1e-9)
            result["summary"].append(s)
    finally:
        load.done.set()
        shutil.rmtree(tmp, ignore_errors=True)
    sync = next((s for s in result["summary"] if s["k"] == 0), None)
    for s in result["summary"]:
        for stat in ("mean", "median"):
            ours, ref = s[f"wall_per_step_{stat}_s"], sync and sync[f"wall_per_step_{stat}_s"]
            s[f"step_time_vs_sync_{stat}"] = ours / ref if ours and ref else None
    result["load_after"], result["loadavg_samples"] = load_snapshot(), load.samples
    write_json(out, result)
    print_table(result["summary"])
    print(f"wrote {out}")


COLUMNS = (  # (header, summary key, format)
    ("K", "k", "{}"),
    ("s/step mean", "wall_per_step_mean_s", "{:.1f}"),
    ("median", "wall_per_step_median_s", "{:.1f}"),
    ("vs sync (mean)", "step_time_vs_sync_mean", "{:.2f}"),
    ("train s", "train_wall_s", "{:.0f}"),
    ("threshold at step", "threshold_reached_at_step", "{}"),
    ("at s", "threshold_reached_at_s", "{:.0f}"),
    ("final acc", "final_accuracy", "{:.2f}"),
    ("rollout busy", "rollout_busy_frac_mean", "{:.2f}"),
    ("update busy", "update_busy_frac_mean", "{:.2f}"),
    ("staleness max", "staleness_max", "{:.0f}"),
    ("mult_prob_err", "token_mult_prob_error_range", "{0[0]:.3f}-{0[1]:.3f}"),
    ("load 1m", "loadavg", "{0[0]:.1f}-{0[1]:.1f}"),
    ("error", "error", "{}"),
)


def print_table(summary: list[dict[str, Any]]) -> None:
    print(" | ".join(header for header, _, _ in COLUMNS))
    for s in summary:
        s = {**s, "loadavg": s["loadavg"] and [s["loadavg"]["min_1m"], s["loadavg"]["max_1m"]]}
        print(" | ".join("-" if s[key] is None else fmt.format(s[key]) for _, key, fmt in COLUMNS))


if __name__ == "__main__":
    main()
