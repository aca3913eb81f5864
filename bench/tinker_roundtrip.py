"""The Tinker API's price: a ``forward_backward`` + ``optim_step`` round trip through
the service (the official SDK -> API -> database -> worker -> back) against the same work done
in one process by :class:`trainer.primitives.ResidentModel`, on the same batch and seed.

    .venv/bin/python -m bench.tinker_roundtrip                 # smollm2-135m-instruct, 4 x 128
    .venv/bin/python -m bench.tinker_roundtrip --model tiny-random-llama --iterations 1

Runs (``--modes``) of ``--warmup`` + ``--iterations`` iterations each, interleaved (one
iteration of each in turn, the order rotating every round, so a change of load hits them all):

- ``in_process``: a ResidentModel (LoRA rank 8, seed 0) in this process: forward_backward(
  batch, "cross_entropy") + optim_step(learning_rate), the service's processes stopped
  (SIGSTOP) meanwhile: the primitive's price on the machine alone;
- ``in_process_beside_idle_service``: the same on a session of its own, the service running
  idle beside it (the worker polls its models' queues, the SDK heartbeats);
- ``sequential`` (and ``pipelined``): ``grpo serve --no-inference`` (the embedded default:
  SQLite and the filesystem broker under a temporary GRPO_DATA_DIR, its embedded worker), a
  key from ``grpo keys create --tinker``, and ``bench/tinker_roundtrip_client.py`` run by
  ``.venv-tinker/bin/python``: an SDK training client per run (same seed) that waits on each
  call (or submits both calls before waiting). Timed client-side.

The request rows' created_at/finished_at (the API stored the call / the worker finished it)
split a service round trip into the server's part and the client's. Each iteration records
the cores this process, the service's processes and the others used. Losses are compared step
by step (same seed and batch: the same math gives the same ``loss:sum``). Results:
bench/results/tinker_roundtrip.json.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import psutil

from bench.async_grpo import LoadSampler
from bench.common import RESULTS_DIR, load_snapshot, machine_info, median, system_cpu_ticks
from bench.common import write_json as write_result

ROOT = Path(__file__).resolve().parent.parent
SDK_PYTHON = ROOT / ".venv-tinker" / "bin" / "python"
CLIENT = Path(__file__).with_name("tinker_roundtrip_client.py")
MODES = ("in_process", "in_process_beside_idle_service", "sequential", "pipelined")
SDK_MODES = ("sequential", "pipelined")
TIMES = ("round_trip_s", "forward_backward_s", "optim_step_s")
SERVER = ("server_forward_backward_s", "server_optim_step_s", "server_both_s", "client_side_s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--datums", type=int, default=4, help="sequences in the batch")
    p.add_argument("--tokens", type=int, default=128, help="model-input tokens per sequence")
    p.add_argument("--iterations", type=int, default=10, help="timed iterations of each run")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations before them")
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--modes", default=",".join(MODES[:3]), help=f"runs, of {','.join(MODES)}")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "tinker_roundtrip.json")
    args = p.parse_args(argv)
    args.modes = ["in_process", *(m for m in MODES[1:] if m in args.modes.split(","))]
    return args


def make_batch(vocab_size: int, datums: int, tokens: int, seed: int) -> list[list[int]]:
    """``datums`` sequences of ``tokens + 1`` token ids (the input and the shifted targets)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab_size) for _ in range(tokens + 1)] for _ in range(datums)]


class CoresWindow:
    """Over a window, in cores (CPU seconds per second): ``service_cores``, what this process's
    descendants (grpo serve, its worker, the SDK client) used; ``others_cores``, what processes
    outside our tree used (the machine's busy cores from /proc/stat, less our whole tree)."""

    def __init__(self) -> None:
        self.wall, self.ticks, self.cpu = time.perf_counter(), system_cpu_ticks(), tree_cpu()

    def close(self) -> dict[str, float]:
        wall, cpu = time.perf_counter() - self.wall, tree_cpu()
        now = system_cpu_ticks()
        delta = {k: now.get(k, 0) - self.ticks.get(k, 0) for k in now}
        idle = (delta.get("idle", 0) + delta.get("iowait", 0)) / (sum(delta.values()) or 1)
        busy_cores = (1.0 - idle) * (os.cpu_count() or 1)
        mine, children = (cpu[0] - self.cpu[0]) / wall, (cpu[1] - self.cpu[1]) / wall
        others = busy_cores - mine - children
        return {"driver_cores": mine, "service_cores": children, "others_cores": others}


def descendants() -> list[psutil.Process]:
    return list(psutil.Process().children(recursive=True))


def tree_cpu() -> tuple[float, float]:
    """CPU seconds of this process, and of its live descendants."""

    def cpu(proc: psutil.Process) -> float:
        with contextlib.suppress(psutil.Error):
            return float(sum(proc.cpu_times()[:2]))
        return 0.0

    return cpu(psutil.Process()), sum(cpu(proc) for proc in descendants())


@contextmanager
def frozen() -> Iterator[None]:
    """The service's processes stopped (SIGSTOP) while an in-process iteration runs; the lease
    (60 s) and the session (120 s) outlast it."""
    stopped = descendants()
    try:
        for proc in stopped:
            proc.suspend()
        yield
    finally:
        for proc in stopped:
            with contextlib.suppress(Exception):
                proc.resume()


# ---------------------------------------------------------------------- in process


def in_process_runner(args: argparse.Namespace) -> tuple[Callable[[], dict[str, Any]], Any]:
    """One-iteration function of a ResidentModel in this process, and its facts."""
    import torch

    from trainer.models.loading import resolve_model
    from trainer.primitives import Datum, ResidentModel

    start = time.perf_counter()
    session = ResidentModel(resolve_model(args.model), lora_rank=args.rank, seed=args.seed)
    facts: dict[str, Any] = {"setup_s": time.perf_counter() - start, "torch": torch.__version__}
    facts.update(torch_threads=torch.get_num_threads(), vocab_size=session.vocab_size)
    batch = make_batch(session.vocab_size, args.datums, args.tokens, args.seed)
    data = [
        Datum(tokens=t[:-1], inputs={"target_tokens": t[1:], "weights": [1.0] * (len(t) - 1)})
        for t in batch
    ]

    def step() -> dict[str, Any]:
        t0 = time.perf_counter()
        result = session.forward_backward(data, "cross_entropy")
        t1 = time.perf_counter()
        optim = session.optim_step(learning_rate=args.learning_rate)
        t2 = time.perf_counter()
        row = {"forward_backward_s": t1 - t0, "optim_step_s": t2 - t1, "round_trip_s": t2 - t0}
        row.update(loss_sum=result.metrics["loss:sum"], grad_norm=optim["optim/grad_norm:mean"])
        return row

    return step, {**facts, "batch": batch}


# ---------------------------------------------------------------------- through the service


class Client:
    """The SDK client process: one line in (a mode), one ``@@ {json}`` line out."""

    def __init__(self, proc: subprocess.Popen[str], stderr: Path) -> None:
        self.proc, self.stderr = proc, stderr
        self.info = self.read()

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                return dict(json.loads(line[3:]))
        tail = self.stderr.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"the client ended ({self.proc.wait()}):\n{tail}")

    def step(self, mode: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(mode + "\n")
        self.proc.stdin.flush()
        return self.read()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 180) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"grpo serve did not answer /healthz (exit status {proc.poll()})")


@contextmanager
def service(args: argparse.Namespace, batch: list[list[int]]) -> Iterator[tuple[Client, Path]]:
    """`grpo serve --no-inference` on a fresh data folder, a Tinker key, and the SDK client
    with its two training clients made; yields the client and the data folder."""
    data_dir = Path(tempfile.mkdtemp(prefix="tinker-roundtrip-"))
    url = f"http://127.0.0.1:{_free_port()}"
    env = {**os.environ, "GRPO_DATA_DIR": str(data_dir), "HF_HUB_OFFLINE": "1"}
    cli = [sys.executable, "-m", "grpo_cli"]
    log_path = data_dir / "serve.log"
    with open(log_path, "ab") as log:
        serve = subprocess.Popen(
            [*cli, "serve", "--no-inference", "--port", url.rsplit(":", 1)[1]],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    client: subprocess.Popen[str] | None = None
    try:
        _wait_healthy(url, serve)
        made = subprocess.run(
            [*cli, "keys", "create", "--tinker", "--project", "bench"],
            cwd=ROOT, env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        config = {"base_model": args.model, "rank": args.rank, "seed": args.seed}
        config.update(learning_rate=args.learning_rate, batch=batch)
        config["clients"] = [m for m in SDK_MODES if m in args.modes]
        (data_dir / "client.json").write_text(json.dumps(config))
        client_env = {**os.environ, "TINKER_API_KEY": made.stdout.strip().splitlines()[-1]}
        client_env.update(TINKER_TELEMETRY="0", HF_HUB_OFFLINE="1", PYTHONPATH="")
        stderr = data_dir / "client.err"
        with open(stderr, "w") as err:
            client = subprocess.Popen(
                [str(SDK_PYTHON), str(CLIENT), url, str(data_dir / "client.json")],
                env=client_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                text=True,
            )  # fmt: skip
        yield Client(client, stderr), data_dir
    except Exception:
        print(log_path.read_text(errors="replace")[-4000:], file=sys.stderr)
        raise
    finally:
        if client is not None and client.poll() is None:
            assert client.stdin is not None
            client.stdin.write("quit\n")
            client.stdin.close()
            client.wait(timeout=60)
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(timeout=90)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()
        shutil.rmtree(data_dir, ignore_errors=True)


def attach_spans(data_dir: Path, model_id: str, rows: list[dict[str, Any]]) -> None:
    """The server's part of each iteration, from the model's request rows (forward_backward,
    optim_step, in order): each call's stored -> finished seconds; ``server_both_s``, the union
    of the two intervals (their sum when sequential; first stored to last finished when
    pipelined); ``client_side_s``, the rest of the round trip (SDK, HTTP, the polls)."""
    from sqlalchemy import select

    from app.core.db import make_engine, make_session_factory, session_scope
    from app.core.settings import Settings
    from app.core.tinker_tables import TinkerRequest as Req

    engine = make_engine(Settings(data_dir=data_dir).resolved_database_url)
    try:
        with session_scope(make_session_factory(engine)) as db:
            spans = db.execute(
                select(Req.kind, Req.created_at, Req.finished_at)
                .where(Req.model_id == model_id, Req.kind.in_(("forward_backward", "optim_step")))
                .order_by(Req.position)
            ).all()
    finally:
        engine.dispose()
    fbs = [(c.timestamp(), f.timestamp()) for k, c, f in spans if k == "forward_backward"]
    steps = [(c.timestamp(), f.timestamp()) for k, c, f in spans if k == "optim_step"]
    for row, fb, step in zip(rows, fbs, steps, strict=True):
        fb_s, step_s = fb[1] - fb[0], step[1] - step[0]
        overlap = max(0.0, min(fb[1], step[1]) - max(fb[0], step[0]))
        row.update(server_forward_backward_s=fb_s, server_optim_step_s=step_s)
        row["server_both_s"] = fb_s + step_s - overlap
        row["client_side_s"] = row["round_trip_s"] - row["server_both_s"]


# ---------------------------------------------------------------------- summary


def stats(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, float]:
    out: dict[str, float] = {"n": len(rows)}
    for key in keys:
        values = [r[key] for r in rows if r.get(key) is not None]
        if values:
            out[key.removesuffix("_s") + "_median_ms"] = median(values) * 1000
            out[key.removesuffix("_s") + "_mean_ms"] = statistics.fmean(values) * 1000
    for key in ("driver_cores", "service_cores", "others_cores"):
        out[f"{key}_median"] = median([r[key] for r in rows])
    return out


def summarize(runs: dict[str, list[dict[str, Any]]], warmup: int) -> dict[str, Any]:
    """Each run's figures; against ``in_process``: the ratio and the difference of the medians
    (and means), the median of the per-round differences and ratios, the losses' largest
    difference over every iteration (warm-ups included)."""
    base = runs["in_process"]
    summary: dict[str, Any] = {"in_process": stats(base[warmup:], TIMES)}
    ref = summary["in_process"]
    for mode, rows in list(runs.items())[1:]:
        s = stats(rows[warmup:], TIMES + SERVER)
        for stat in ("median", "mean"):
            ours, theirs = s[f"round_trip_{stat}_ms"], ref[f"round_trip_{stat}_ms"]
            s[f"ratio_{stat}"], s[f"overhead_{stat}_ms"] = ours / theirs, ours - theirs
        pairs = [(a["round_trip_s"], b["round_trip_s"]) for a, b in zip(base, rows, strict=True)]
        s["paired_overhead_median_ms"] = 1000 * median([b - a for a, b in pairs[warmup:]])
        s["paired_ratio_median"] = median([b / a for a, b in pairs[warmup:]])
        losses = [(a["loss_sum"], b["loss_sum"]) for a, b in zip(base, rows, strict=True)]
        s["loss_max_abs_diff"] = max(abs(a - b) for a, b in losses)
        s["loss_max_rel_diff"] = max(abs(a - b) / abs(a) for a, b in losses)
        summary[mode] = s
    return summary


def print_table(summary: dict[str, Any]) -> None:
    """The main figures of each run (ms; ratios and cores as they are)."""
    keys = ("round_trip_median_ms", "round_trip_mean_ms", "forward_backward_median_ms",
            "optim_step_median_ms", "server_both_median_ms", "client_side_median_ms",
            "ratio_median", "overhead_median_ms", "paired_overhead_median_ms",
            "loss_max_abs_diff", "service_cores_median", "others_cores_median")  # fmt: skip
    print("run | " + " | ".join(keys))
    for mode, s in summary.items():
        print(f"{mode} | " + " | ".join(f"{s[k]:.4g}" if k in s else "-" for k in keys))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:  # before torch loads; grpo serve's worker inherits it
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    if not SDK_PYTHON.exists():
        raise SystemExit(".venv-tinker is missing: run make setup")
    argv_shown = argv if argv is not None else sys.argv[1:]
    load = LoadSampler(interval=2.0)
    load.start()
    result: dict[str, Any] = {
        "command": " ".join(["python -m bench.tinker_roundtrip", *argv_shown]),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "service_setup": "grpo serve --no-inference: SQLite + filesystem broker, embedded worker",
        "machine": machine_info(),
        "load_before": load_snapshot(),
    }
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in args.modes}
    try:
        load.label = "setup"
        local_step, facts = in_process_runner(args)
        beside = MODES[1] in args.modes and in_process_runner(args)[0]  # a session of its own
        batch = facts.pop("batch")
        result.update(in_process_setup=facts, batch_lengths=[len(t) - 1 for t in batch])
        with service(args, batch) as (client, data_dir):
            result["client"] = client.info
            steps: dict[str, Callable[[], dict[str, Any]]] = {"in_process": local_step}
            if beside:
                steps[MODES[1]] = beside
            steps.update({m: functools.partial(client.step, m) for m in SDK_MODES})
            load.label = "iterations"
            for i in range(args.warmup + args.iterations):
                k = i % len(args.modes)
                for mode in args.modes[k:] + args.modes[:k]:
                    with frozen() if mode == "in_process" else contextlib.nullcontext():
                        window = CoresWindow()
                        row = steps[mode]()
                        row.update(window.close(), round=i)
                    runs[mode].append(row)
                print(f"round {i}: " + ", ".join(
                    f"{m} {runs[m][-1]['round_trip_s']:.2f} s" for m in runs), flush=True)  # fmt: skip
            for mode in set(SDK_MODES) & set(runs):
                attach_spans(data_dir, client.info["model_ids"][mode], runs[mode])
    finally:
        load.done.set()
    result.update(loadavg=load.summary("iterations"), summary=summarize(runs, args.warmup))
    result.update(runs=runs, load_after=load_snapshot(), loadavg_samples=load.samples)
    write_result(args.out, result)
    print_table(result["summary"])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
