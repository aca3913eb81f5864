"""The main job on the embedded default, end to end:

start `grpo serve` (API + embedded worker + inference process, SQLite + filesystem broker, CPU),
submit a small GRPO job (tiny model, vLLM-CPU rollouts, a few steps) over HTTP, print its metrics
live from the SSE stream and the job's final state, then ask the model it trained a question
through the OpenAI-compatible /v1/chat/completions and print the answer as it streams.

The job trains LoRA adapters (`--full`: every weight) and the inference process starts the
base model's engine while the job trains (GRPO_INFERENCE_PRELOAD), so the answer comes from
that warm engine with the job's adapters loaded in a fraction of a second; a full fine-tune's
answer waits for an engine of its own to start (a minute or more on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpo_cli.chat import stream_reply  # noqa: E402
from grpo_cli.client import Client  # noqa: E402

QUESTION = "pick a digit"
ANSWER_WAIT_S = 180.0  # a full fine-tune's engine starts on the first request
# The demo's LoRA job: rank-8 adapters on every linear layer of the tiny model learn the recipe's
# task as full fine-tuning does at a 10x larger learning rate (adapters start at zero and are
# scaled by alpha / r): mean reward 0.28 -> 0.95-1.0, held-out accuracy 0.25 -> 1.0 in 10 steps.
DEMO_LORA = {"rank": 8, "alpha": 16, "target_modules": "all-linear"}
DEMO_LORA_LEARNING_RATE = 0.01


def wait_ready(url: str, server: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"grpo serve exited with {server.returncode}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit("the service did not become ready")


def api_key(data_dir: Path) -> str:
    key_file = data_dir / "api-key"
    if key_file.exists():
        return key_file.read_text().strip()
    out = subprocess.run(
        [sys.executable, "-m", "grpo_cli", "keys", "create", "--name", "demo"],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    key = out.stdout.strip()
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    return key


def fmt(values: dict[str, float | None], name: str, spec: str) -> str:
    value = values.get(name)
    return "-" if value is None else format(value, spec)


def ask(client: Client, model: str) -> None:
    """The trained model's streamed answer to one question (the job id names its final
    weights; the first request starts the model's engine, which the API answers with 503 and
    Retry-After until it is up)."""
    print(f"\nasking {model}: {QUESTION!r}\n  ", end="", flush=True)
    started = time.monotonic()
    stream_reply(
        client,
        model,
        [{"role": "user", "content": QUESTION}],
        {"max_tokens": 16, "temperature": 0},
        ANSWER_WAIT_S,
        lambda piece: print(piece, end="", flush=True),
    )
    print(f"\n  (answered {time.monotonic() - started:.1f} s after the job ended)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", default=str(ROOT / "recipes" / "tiny-smoke.yaml"))
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--data-dir", default=str(ROOT / ".grpo"))
    parser.add_argument("--full", action="store_true", help="train every weight, not LoRA")
    args = parser.parse_args()
    data_dir = Path(args.data_dir).resolve()
    spec = yaml.safe_load(Path(args.spec).read_text())
    if not args.full and "lora" not in spec:
        spec["lora"] = DEMO_LORA
        spec.setdefault("grpo", {})["learning_rate"] = DEMO_LORA_LEARNING_RATE
    env = os.environ.copy()
    env["GRPO_DATA_DIR"] = str(data_dir)
    # One torch thread per process: the tiny model's steps are too small to share between
    # threads, and spinning OpenMP threads cost 5-10x when the worker, its vLLM engine and the
    # inference process compete for the cores (recipes/tiny-smoke.yaml).
    env.setdefault("OMP_NUM_THREADS", "1")
    lora = "lora" in spec
    if lora:  # its answer comes from the base model's engine: start it now
        env.setdefault("GRPO_INFERENCE_PRELOAD", spec["model"])
    url = f"http://127.0.0.1:{args.port}"
    print(f"starting grpo serve on {url} (data in {data_dir})", flush=True)
    server = subprocess.Popen(
        [sys.executable, "-m", "grpo_cli", "serve", "--port", str(args.port)], cwd=ROOT, env=env
    )
    try:
        wait_ready(url, server)
        with Client(url, api_key(data_dir)) as client:
            job = client.create_job(spec)
            total = job["progress"]["total_steps"]
            kind = "LoRA" if lora else "full fine-tune"
            print(
                f"submitted {job['id']}: {spec.get('name')} ({kind}) on {job['model']}, "
                f"{total} steps",
                flush=True,
            )
            for message in client.stream(job["id"]):
                data = message.data
                if message.event == "metrics":
                    values = data["values"]
                    print(
                        f"  step {data['step']:>3}/{total}  reward {fmt(values, 'reward/mean', '.3f')}"
                        f"  kl {fmt(values, 'kl', '.5f')}  entropy {fmt(values, 'entropy', '.3f')}"
                        f"  {fmt(values, 'time/step', '.1f')} s/step",
                        flush=True,
                    )
                elif message.event in ("status", "event"):
                    print(f"  [{data['type']}] {data['message']}", flush=True)
            final = client.get_job(job["id"])
            checkpoints = client.checkpoints(job["id"])
            print(f"\njob {final['id']} {final['status']} after {final['progress']['step']} steps")
            if final["error"]:
                print(f"error: {final['error']['code']}: {final['error']['message']}")
            if checkpoints:
                # The API names the folder only; this local service keeps it in its data folder.
                store = Path(env.get("GRPO_CHECKPOINT_DIR") or data_dir / "checkpoints")
                folder = store / job["id"] / checkpoints[-1]["path"]
                what = "PEFT adapters" if lora else "a Hugging Face model"
                print(f"final checkpoint ({what} folder): {folder}")
            if final["status"] != "succeeded":
                return 1
            ask(client, final["id"])
        return 0
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    raise SystemExit(main())
