"""The stack bench.inference serves through: the API (`grpo api`, one process), one
`grpo worker` and one `grpo inference` on the tiny packaged model, all on free ports, started
in that order; and the base engine, ensured straight at the inference process's control API.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Any

import httpx

from bench.services import Process, free_port, start_api, wait_for

TINY = "tiny-random-llama"
MIB = 1024**2
GIB = 1024**3
ENGINE_START_S = 900  # a tiny engine: 53 s measured, up to 290 s seen under load


def worker_env(env: dict[str, str]) -> dict[str, str]:
    """The worker's environment: quick heartbeats and maintenance, two torch threads."""
    return {
        **env,
        "GRPO_HEARTBEAT_SECONDS": "1",
        "GRPO_MAINTENANCE_SECONDS": "2",
        "OMP_NUM_THREADS": "2",
    }


def inference_env(env: dict[str, str], store: Path, kv_cache_mib: int) -> dict[str, str]:
    """The inference process's environment: the checkpoint store, an 8 GiB memory budget shared
    with the other processes' devices, a KV cache of `kv_cache_mib`, LoRA up to rank 8."""
    return {
        **env,
        "GRPO_CHECKPOINT_DIR": str(store),
        "GRPO_INFERENCE_SERVER_ID": f"bench-{secrets.token_hex(3)}",
        "GRPO_INFERENCE_SHARE_DEVICES": "1",
        "GRPO_INFERENCE_MEMORY_BUDGET_BYTES": str(8 * GIB),
        "GRPO_INFERENCE_KV_CACHE_BYTES": str(kv_cache_mib * MIB),
        "GRPO_INFERENCE_MAX_LORA_RANK": "8",
        "GRPO_INFERENCE_ENGINE_START_TIMEOUT_S": str(ENGINE_START_S),
    }


def wait_inference_healthy(inference: Process, control: str) -> None:
    """Wait for the inference process's /health (an error, with its log, if it exits)."""

    def healthy() -> bool:
        if not inference.alive():
            raise RuntimeError(f"grpo inference exited:\n{inference.log_tail()}")
        try:
            return httpx.get(f"{control}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_for(healthy, 120, "grpo inference's /health")


def start_stack(
    env: dict[str, str], work: Path, store: Path, kv_cache_mib: int, processes: list[Process]
) -> tuple[str, str]:
    """Start the API, the worker and the inference process (logs in `work`), each appended to
    `processes` once started so that the caller stops it; returns the API's URL and the
    inference control API's once the latter answers /health."""
    api_port = free_port()
    api = start_api(env, api_port, 1, work / "api.log")
    processes.append(api)
    worker = Process(["worker"], worker_env(env), work / "worker.log")
    worker.start()
    processes.append(worker)
    control_port = free_port()
    inference = Process(
        ["inference", "--port", str(control_port), "--bases", TINY],
        inference_env(env, store, kv_cache_mib),
        work / "inference.log",
    )
    inference.start()
    processes.append(inference)
    control = f"http://127.0.0.1:{control_port}"
    wait_inference_healthy(inference, control)
    return f"http://127.0.0.1:{api_port}", control


def ensure_base_engine(control: str) -> dict[str, Any]:
    """POST /engines/ensure for the tiny base until it answers 200 (503 while it starts; one
    try a second); returns that answer (its `base_url`, `served_model`)."""
    ready: dict[str, Any] = {}

    def ensured() -> bool:
        response = httpx.post(f"{control}/engines/ensure", json={"base_model": TINY}, timeout=60)
        if response.status_code == 200:
            ready.update(response.json())
            return True
        if response.status_code != 503:
            raise RuntimeError(f"ensure: {response.status_code} {response.text}")
        time.sleep(1)
        return False

    wait_for(ensured, ENGINE_START_S, "the base engine")
    return ready
