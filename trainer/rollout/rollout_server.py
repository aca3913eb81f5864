"""A rollout server: ONE rollout engine in a process of its own, served over HTTP on 127.0.0.1.

Why a process: asynchronous GRPO (docs/trainer.md) generates the next steps' rollouts while the
trainer updates, so the engine must not share the trainer's interpreter, threads or device;
the same protocol later lets rollouts run on other machines. The client is
:class:`trainer.rollout.remote_engine.RemoteEngine`, which starts this module as
``python -m trainer.rollout.rollout_server CONFIG.json``.

Protocol (JSON bodies). Every request carries the server's secret in :data:`SECRET_HEADER`
(401 otherwise; the client makes a new random one for each server it starts and hands it over
in the 0600 config file); a body above ``max_body_bytes`` is refused with 413 unread.

- ``POST /generate`` ``{prompts, n, max_new_tokens, temperature, seed, greedy, version,
  cache_block}`` -> ``{completions: [len(prompts)][n] of {token_ids, logprobs, text,
  finish_reason, loss_mask, policy_version}, policy_version, prefill}``. The server first
  loads ``version`` when it holds another, inside the same lock as the generation, so callers
  interleaving versions each get the one they name. ``prefill``: the call's prompt and cached
  tokens when the engine counts them (vLLM), else null. ``cache_block``: calls with one id
  keep the engine's prefix cache between them (:func:`trainer.rollout.base.prefix_cache_kept`).
- ``POST /load`` ``{version}`` -> ``{version}``: load a version ahead of the calls naming it.
- ``GET /health`` -> ``{version, pid, max_model_len, stop_token_ids, prefill, threads, cpus,
  in_flight, generate_calls}`` (answered while a generation runs: it takes no engine lock).

400: a malformed call (the message says what; a prompt that does not fit the context), 409: a
version that was never published or was deleted, 500: the engine failed (traceback on stderr).

Weights travel as files (:mod:`trainer.rollout.weight_versions`), never through the socket;
which version a call gets is :mod:`trainer.rollout.rollout_service`'s rule.

Ready: once the engine is built and the socket listens, the server writes ``ready_file``
(``{port, pid}``, renamed into place) and prints the port. It exits when its parent does,
so no server outlives the trainer that started it, even one killed with -9.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainer.errors import TrainerError
from trainer.rollout.rollout_service import (
    DEFAULT_MAX_BODY_BYTES,
    RolloutServerConfig,
    RolloutService,
    VersionUnavailable,
    build_engine,
)

if TYPE_CHECKING:
    from jobspec import JobSpec

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "SECRET_HEADER",
    "RolloutServerConfig",
    "RolloutServerError",
    "RolloutServerKilled",
    "ServerProcess",
    "config_for_run",
    "launch",
    "main",
]

SECRET_HEADER = "X-Rollout-Secret"
_PARENT_POLL_S = 1.0
_TAIL_CHARS = 4000


def config_for_run(
    spec: JobSpec,
    model_path: Path,
    *,
    tokenizer_path: Path | None = None,
    device: torch.device,
    max_model_len: int,
    kv_cache_bytes: int | None = None,
    kv_block_tokens: int | None = None,
    threads: int | None = None,
    cpus: Sequence[int] | None = None,
) -> RolloutServerConfig:
    """The server config of a job's ``rollout`` section (``trainer.rollout.startup`` sizes the
    context and the KV cache): its engine, dtype on ``device``, LoRA adapters when
    ``lora_sync`` is "adapter" on an engine that serves them, and its vLLM options (on CUDA its
    share of the device, ``rollout.gpu_memory_utilization`` of the run's spec). Called right
    before the server starts."""
    from jobspec.traits import ROLLOUT_ENGINE_TRAITS
    from trainer.rollout.startup import engine_dtype

    rollout = spec.rollout
    adapters = (
        spec.lora is not None
        and rollout.lora_sync == "adapter"
        and ROLLOUT_ENGINE_TRAITS[rollout.engine].serves_lora_adapters
    )
    options: dict[str, Any] = {}
    if rollout.enforce_eager is not None:
        options["enforce_eager"] = rollout.enforce_eager
    if rollout.gpu_memory_utilization is not None:
        # On CUDA the run's spec carries the share trainer.run.setup derived once the trainer
        # was placed (trainer.rollout.startup.plan_server_share), or the job's own.
        options["gpu_memory_utilization"] = rollout.gpu_memory_utilization
    if device.type == "cuda":
        # vLLM refuses to start unless its share of the device is free; blocks the trainer
        # freed since (a checkpoint's restore) sit in PyTorch's cache, counted as used.
        torch.cuda.empty_cache()
    return RolloutServerConfig(
        engine=rollout.engine,
        model_path=str(model_path),
        tokenizer_path=str(tokenizer_path or model_path),
        dtype=engine_dtype(spec, device),
        max_model_len=max_model_len,
        kv_cache_bytes=kv_cache_bytes,
        kv_block_tokens=kv_block_tokens,
        lora_rank=spec.lora.rank if adapters and spec.lora is not None else None,
        engine_options=options,
        device=str(device),
        threads=threads,
        cpus=list(cpus) if cpus is not None else None,
    )


# --------------------------------------------------------------------------- HTTP


class RolloutHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, service: RolloutService) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.service = service


class _Handler(BaseHTTPRequestHandler):
    server: RolloutHTTPServer

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per call would drown the engine's own log

    def do_GET(self) -> None:
        if not self._authorised():
            return
        if self.path != "/health":
            self._reply(404, {"error": f"no route {self.path}"})
            return
        self._reply(200, self.server.service.health())

    def do_POST(self) -> None:
        if not self._authorised():
            return
        service = self.server.service
        routes = {"/generate": service.generate, "/load": service.load}
        route = routes.get(self.path)
        if route is None:
            self._reply(404, {"error": f"no route {self.path}"})
            return
        body = self._body()
        if body is None:
            return
        counted = service.counting() if self.path == "/generate" else contextlib.nullcontext()
        with counted:
            self._answer(route, body)

    def _answer(self, route: Callable[[dict[str, Any]], dict[str, Any]], body: Any) -> None:
        try:
            result = route(body)
        except VersionUnavailable as exc:
            self._reply(409, {"error": str(exc)})
        except (ValueError, TypeError, KeyError) as exc:
            self._reply(400, {"error": f"{type(exc).__name__}: {exc}"})
        except Exception as exc:
            traceback.print_exc()
            self._reply(500, {"error": f"{type(exc).__name__}: {exc}"})
        else:
            self._reply(200, result)

    def _authorised(self) -> bool:
        given = self.headers.get(SECRET_HEADER, "")
        if hmac.compare_digest(given.encode(), self.server.service.config.secret.encode()):
            return True
        self._reply(401, {"error": "wrong or missing secret"})
        return False

    def _body(self) -> dict[str, Any] | None:
        """The JSON object sent, or None once an error was answered (411, 413, 400)."""
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            length = -1
        if length < 0:  # a negative length would read until the client hangs up
            self._reply(411, {"error": "Content-Length required"})
            return None
        limit = self.server.service.config.max_body_bytes
        if length > limit:
            self._reply(413, {"error": f"body of {length} bytes is over {limit}"})
            return None
        try:
            body = json.loads(self.rfile.read(length))
        except ValueError as exc:
            self._reply(400, {"error": f"not JSON: {exc}"})
            return None
        if not isinstance(body, dict):
            self._reply(400, {"error": "the body must be a JSON object"})
            return None
        return body

    def _reply(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.close_connection = True
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


# --------------------------------------------------------------------------- starting one


class RolloutServerError(TrainerError):
    """The rollout server could not start, died again during a retried call, or failed a call
    (the message carries its answer or the tail of its output)."""

    reason = "rollout_server_failed"


class RolloutServerKilled(RolloutServerError):
    """The rollout server was killed by a signal (kill -9, the kernel's OOM killer) while it
    started or while the client's retries lasted: nothing says the job is at fault, so the
    worker tries the job again from its last checkpoint (``worker.stop_reasons``)."""

    reason = "rollout_server_killed"


@dataclass
class ServerProcess:
    """One started server (the client's handle): its process, port, secret and log."""

    popen: subprocess.Popen[bytes]
    port: int
    secret: str
    log: Path

    def tail(self) -> str:
        """The end of the server's output, for an error message."""
        try:
            return self.log.read_text(errors="replace")[-_TAIL_CHARS:]
        except OSError:
            return "(no output)"

    def stop(self, timeout: float) -> None:
        """Terminate, then kill once ``timeout`` has passed; reaps the process."""
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def launch(config: RolloutServerConfig, folder: Path, *, timeout_s: float) -> ServerProcess:
    """Start a server of ``config`` with a new secret, its files in ``folder`` (the config,
    0600: it holds the secret; the ready file; the log, appended) and return once it is
    ready. RolloutServerError, with its output's tail, when it exits first or is not ready
    within ``timeout_s`` (it is stopped then)."""
    ready, path, log = folder / "ready.json", folder / "config.json", folder / "server.log"
    secret = secrets.token_urlsafe(32)
    ready.unlink(missing_ok=True)
    path.unlink(missing_ok=True)
    config = replace(config, ready_file=str(ready), secret=secret, parent_pid=os.getpid())
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(config.to_json())
    env = dict(os.environ)
    if config.threads:
        env["OMP_NUM_THREADS"] = str(config.threads)
    with open(log, "ab") as out:
        popen = subprocess.Popen(
            [sys.executable, "-m", "trainer.rollout.rollout_server", str(path)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    server = ServerProcess(popen, 0, secret, log)
    try:
        server.port = _wait_ready(server, ready, timeout_s)
    except BaseException:
        server.stop(timeout=5.0)
        raise
    return server


def _wait_ready(server: ServerProcess, ready: Path, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while not ready.is_file():
        code = server.popen.poll()
        if code is not None:
            killed = code < 0  # a signal, not the server's own exit
            raise (RolloutServerKilled if killed else RolloutServerError)(
                f"the rollout server exited with code {code} before it was ready; "
                f"its output ends:\n{server.tail()}"
            )
        if time.monotonic() > deadline:
            raise RolloutServerError(
                f"the rollout server was not ready within {timeout_s:.0f}s; "
                f"its output ends:\n{server.tail()}"
            )
        time.sleep(0.05)
    return int(json.loads(ready.read_text())["port"])


# --------------------------------------------------------------------------- the process


def _limit_cpu(config: RolloutServerConfig) -> None:
    """The server's own cores and threads, set before the engine is built (vLLM on CPU runs
    in this process and takes torch's thread count; the client sets OMP_NUM_THREADS too)."""
    if config.cpus:
        os.sched_setaffinity(0, config.cpus)
    if config.threads:
        os.environ["OMP_NUM_THREADS"] = str(config.threads)
        torch.set_num_threads(config.threads)


def _watch_parent(parent_pid: int | None, client_folder: Path) -> None:
    """Exit when the process that started the server is gone (its trainer was killed),
    removing the client's folder first: its published weight versions (K + 2 copies of the
    model) would otherwise stay on the worker's disk, since the dead client cannot clean up."""
    if parent_pid is None:
        return

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        shutil.rmtree(client_folder, ignore_errors=True)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _write_ready(path: Path, port: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"port": port, "pid": os.getpid()}))
    os.replace(tmp, path)


def _terminate(_signum: int, _frame: object) -> None:
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m trainer.rollout.rollout_server CONFIG.json", file=sys.stderr)
        return 2
    config = RolloutServerConfig.from_json(Path(args[0]).read_text())
    _watch_parent(config.parent_pid, Path(args[0]).parent)  # the config is in the client's folder
    _limit_cpu(config)
    service = RolloutService(config, build_engine(config))
    httpd = RolloutHTTPServer(service)
    port = int(httpd.server_address[1])
    signal.signal(signal.SIGTERM, _terminate)
    _write_ready(Path(config.ready_file), port)
    print(f"rollout server {os.getpid()}: {config.engine} on 127.0.0.1:{port}", flush=True)
    try:
        httpd.serve_forever()
    finally:
        httpd.server_close()
        service.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
