"""The main job on the embedded default, end to end:

start `grpo serve` (API + embedded worker + inference process, SQLite + filesystem broker, CPU;
its log in <data dir>/serve.log), submit a small GRPO job (tiny model, vLLM-CPU rollouts, a few
steps) over HTTP, print its metrics live from the SSE stream and the job's final state, then ask
the base model and the model the job trained the same prompt (one the job held out of training)
through the OpenAI-compatible /v1/chat/completions, print both answers as they stream, and score
each with the job's graders (/v1/graders/run): what the training changed.

The job trains LoRA adapters (`--full`: every weight) and the inference process starts the
base model's engine while the job trains (GRPO_INFERENCE_PRELOAD), so the base model answers at
once and the trained one from that warm engine with the job's adapters loaded in a fraction of a
second; a full fine-tune's answer waits for an engine of its own to start (a minute or more on 2
cores).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpo_cli.chat import stream_reply  # noqa: E402
from grpo_cli.client import Client  # noqa: E402

QUESTION = "pick a digit"  # for a spec without inline rows
ANSWER_WAIT_S = 180.0  # a full fine-tune's engine starts on the first request
# The demo's LoRA job: rank-8 adapters on every linear layer of the tiny model learn the recipe's
# task as full fine-tuning does at a 10x larger learning rate (adapters start at zero and are
# scaled by alpha / r): mean reward 0.28 -> 0.95-1.0, held-out accuracy 0.25 -> 1.0 in 10 steps.
DEMO_LORA = {"rank": 8, "alpha": 16, "target_modules": "all-linear"}
DEMO_LORA_LEARNING_RATE = 0.01


def wait_ready(
    url: str, server: subprocess.Popen[bytes], log_path: Path, timeout: float = 120
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise SystemExit(f"grpo serve exited with {server.returncode}:\n{tail}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the service did not become ready (its log: {log_path})")


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


def demo_row(spec: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The row whose prompt both models answer, and whether the job held it out of training:
    the first held-out row (`dataset.holdout` takes them from the end), else the first row."""
    dataset = spec.get("dataset") or {}
    rows = [row for row in dataset.get("rows") or [] if isinstance(row.get("prompt"), str)]
    holdout = int(dataset.get("holdout") or 0)
    if rows and 0 < holdout <= len(rows):
        return rows[-holdout], True
    return (rows[0] if rows else {"prompt": QUESTION}), False


def answer(client: Client, label: str, model: str, prompt: str) -> tuple[str, float]:
    """``model``'s greedy answer to ``prompt``, streamed onto a line of its own as a JSON string
    (an answer may hold newlines and quotes), and the seconds it took. A model whose engine is
    not up yet answers 503 and Retry-After until it is: stream_reply waits, saying so on stderr
    before the line begins."""
    line = f'  {label:<6}  {model}: "'
    begun: list[bool] = []

    def show(piece: str) -> None:
        if not begun:
            print(line, end="")
            begun.append(True)
        print(json.dumps(piece)[1:-1], end="", flush=True)

    started = time.monotonic()
    text = stream_reply(
        client,
        model,
        [{"role": "user", "content": prompt}],
        {"max_tokens": 16, "temperature": 0},
        ANSWER_WAIT_S,
        show,
    )
    if not begun:  # an empty answer
        print(line, end="")
    return text, time.monotonic() - started


def grade(url: str, key: str, spec: dict[str, Any], row: dict[str, Any], text: str) -> str:
    """Each of the job's graders on ``text`` as the worker scores a completion: `name reward`."""
    scores = []
    for grader in spec.get("graders") or []:
        body = {"grader": grader, "model_sample": text, "item": row}
        response = httpx.post(
            f"{url}/v1/graders/run", json=body, headers={"Authorization": f"Bearer {key}"}
        )
        response.raise_for_status()
        result = response.json()
        scores.append(f"{result['metadata']['name']} {result['reward']:.2f}")
    return "  ".join(scores)


def before_and_after(
    client: Client, url: str, key: str, spec: dict[str, Any], trained: str
) -> None:
    """The base model's and the trained model's answers to one prompt, each scored by the job's
    graders, one line each: `  before  MODEL: "ANSWER"  GRADER REWARD ...  (SECONDS s)`."""
    row, held_out = demo_row(spec)
    note = "held out of training" if held_out else "a training prompt"
    print(f"\nthe same prompt before and after training ({note}): {json.dumps(row['prompt'])}")
    for label, model in (("before", spec["model"]), ("after", trained)):
        text, seconds = answer(client, label, model, row["prompt"])
        print(f'"  {grade(url, key, spec, row, text)}  ({seconds:.1f} s)', flush=True)


def follow(client: Client, job: dict[str, Any]) -> None:
    """The job's steps and events as they happen, from its event stream, to its end."""
    total = job["progress"]["total_steps"]
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", default=str(ROOT / "recipes" / "tiny-smoke.yaml"))
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--data-dir", default=str(ROOT / ".grpo"))
    parser.add_argument("--full", action="store_true", help="train every weight, not LoRA")
    args = parser.parse_args()
    data_dir = Path(args.data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
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
    # The base model answers first, and a LoRA job's answer comes from its engine: start it now.
    env.setdefault("GRPO_INFERENCE_PRELOAD", spec["model"])
    lora = "lora" in spec
    url = f"http://127.0.0.1:{args.port}"
    log_path = data_dir / "serve.log"
    print(f"starting grpo serve on {url} (data in {data_dir}, its log in {log_path})", flush=True)
    with open(log_path, "ab") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "grpo_cli", "serve", "--port", str(args.port)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_ready(url, server, log_path)
        key = api_key(data_dir)
        with Client(url, key) as client:
            job = client.create_job(spec)
            kind = "LoRA" if lora else "full fine-tune"
            print(
                f"submitted {job['id']}: {spec.get('name')} ({kind}) on {job['model']}, "
                f"{job['progress']['total_steps']} steps",
                flush=True,
            )
            follow(client, job)
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
            before_and_after(client, url, key, spec, final["id"])
        return 0
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    raise SystemExit(main())
