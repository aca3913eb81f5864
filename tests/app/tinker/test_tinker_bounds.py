"""What one Tinker tenant may hold of what all share (issue 44), over real HTTP (uvicorn) on
Postgres and on the embedded SQLite, without a worker:

- a refused call stores nothing: 60 refused 4 MB calls leave the database where it was;
- the bytes a project's calls hold are counted (/v1/usage) and bounded (429 naming the
  limit, Retry-After), another project unaffected;
- the session and client quotas hold under a burst (counted and inserted under the project's
  lock);
- the polls one project holds open are bounded (429 naming the limit).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from app.core.db import make_engine
from app.core.settings import Settings
from app.tinker.wire import FwdBwdRequest, WireDatum, encode_forward_backward
from tests.conftest import new_project_key
from tests.live_server import Server, serve


class Client:
    """One project's raw Tinker calls (as the SDK sends them) over real HTTP."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.project_key = new_project_key(server.settings)[0]
        self.headers = {"X-API-Key": "tml-" + self.project_key}

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        url = f"{self.server.url}/api/v1/{path}"
        return httpx.post(url, json=body, headers=self.headers, timeout=60)

    def post_raw(self, path: str, body: bytes) -> httpx.Response:
        headers = {**self.headers, "Content-Type": "application/x-protobuf"}
        url = f"{self.server.url}/api/v1/{path}"
        return httpx.post(url, content=body, headers=headers, timeout=60)

    def session(self) -> str:
        answer = self.post("create_session", {"tags": [], "sdk_version": "0.38.0"})
        assert answer.status_code == 200, answer.text
        return str(answer.json()["session_id"])

    def model(self, session_id: str, n: int = 0) -> httpx.Response:
        return self.post(
            "create_model",
            {"session_id": session_id, "model_seq_id": n, "base_model": "tiny-random-llama",
             "lora_config": {"rank": 4}},
        )  # fmt: skip

    def usage(self) -> dict[str, Any]:
        answer = httpx.get(
            f"{self.server.url}/v1/usage",
            headers={"Authorization": f"Bearer {self.project_key}"},
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        return dict(answer.json()["tinker"])


@contextmanager
def start(settings: Settings, **tuned: Any) -> Iterator[Server]:
    # The API's own body limit as deployed (the fixture's is small), the Tinker limits as set.
    tuned = {"max_body_bytes": 16 * 1024 * 1024, **tuned}
    with serve(settings.model_copy(update=tuned)) as server:
        yield server


@pytest.fixture
def server(settings: Settings) -> Iterator[Server]:
    with start(settings, tinker_max_body_bytes=5_000_000) as server:
        yield server


def big_call(model_id: str, seq_id: int, *, bad: str) -> bytes:
    """A forward_backward body of 64 datums of 1000 tokens, refused for ``bad``: ``keys``
    (4 MB of loss_fn_inputs the loss does not read) or ``tokens`` (1 MB, its last datum's last
    token id past the vocabulary)."""
    tokens = [1 + (i % 50) for i in range(1000)]
    data = []
    for d in range(64):
        inputs: dict[str, list[float] | list[int]] = {
            "target_tokens": tokens,
            "weights": [1.0] * 1000,
        }
        if bad == "keys":
            inputs.update({f"extra_{k}": [0.5] * 1000 for k in range(12)})
        elif d == 63:
            data.append(WireDatum(tokens=[*tokens[:-1], 9999], inputs=inputs))
            continue
        data.append(WireDatum(tokens=tokens, inputs=inputs))
    request = FwdBwdRequest(model_id, seq_id, "cross_entropy", False, {}, data)
    return encode_forward_backward(request)


def database_bytes(settings: Settings) -> int:
    """The bytes of the Tinker calls' table (its heap, TOAST and indexes) or, on SQLite, of
    the database file."""
    if settings.resolved_database_url.startswith("sqlite"):
        return (settings.data_dir / "grpo.db").stat().st_size
    engine = make_engine(settings.resolved_database_url)
    try:
        with engine.connect() as connection:
            size = connection.execute(text("SELECT pg_total_relation_size('tinker_requests')"))
            return int(size.scalar_one())
    finally:
        engine.dispose()


def test_refused_calls_store_nothing(server: Server) -> None:
    client = Client(server)
    answer = client.model(client.session())
    model_id = answer.json()["model_id"]
    before, stored = database_bytes(server.settings), client.usage()["stored_bytes"]
    assert 0 < stored < 1000  # create_model's body, until a worker applies it
    for n in range(60):
        bad = "keys" if n % 2 else "tokens"
        body = big_call(model_id, n + 1, bad=bad)
        # 4 MB of unknown inputs; the most a call's valid inputs can carry (1 MB) past the vocab.
        assert len(body) > (3_500_000 if bad == "keys" else 1_000_000)
        refused = client.post_raw("forward_backward", body)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"].startswith("data[")  # names the datum and field at fault
    assert database_bytes(server.settings) - before < 3_000_000  # 150 MB were sent
    assert client.usage()["stored_bytes"] == stored


def fifty_thousand_tokens(model_id: str, seq_id: int) -> bytes:
    """A valid forward_backward body of about 600 KB (100 datums of 500 tokens)."""
    tokens = list(range(1, 51)) * 10
    datum = WireDatum(tokens=tokens, inputs={"target_tokens": tokens})
    return encode_forward_backward(
        FwdBwdRequest(model_id, seq_id, "cross_entropy", False, {}, [datum] * 100)
    )


def test_a_projects_stored_calls_are_counted_and_bounded(settings: Settings) -> None:
    with start(settings, tinker_max_stored_bytes_per_project=1_000_000) as server:
        client, other = Client(server), Client(server)
        model_id = client.model(client.session()).json()["model_id"]
        first = fifty_thousand_tokens(model_id, 1)
        assert client.post_raw("forward_backward", first).status_code == 200
        held = client.usage()["stored_bytes"]
        assert len(first) < held < len(first) + 1000  # the call, and create_model's body
        # No worker applies them: the next one would pass the limit.
        refused = client.post_raw("forward_backward", fifty_thousand_tokens(model_id, 2))
        assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
        error = refused.json()["error"]
        assert error["param"] == "GRPO_TINKER_MAX_STORED_BYTES_PER_PROJECT"
        assert f"hold {held} bytes" in error["message"] and "(1000000)" in error["message"]
        usage = client.usage()
        assert (usage["stored_bytes"], usage["limit_stored_bytes"]) == (held, 1_000_000)
        # Another project stores its own calls.
        theirs = other.model(other.session())
        assert theirs.status_code == 200, theirs.text
        call = fifty_thousand_tokens(theirs.json()["model_id"], 1)
        assert other.post_raw("forward_backward", call).status_code == 200


def burst(n: int, call: Callable[[int], httpx.Response]) -> list[int]:
    """``call(i)`` for i < n, all at once (released together by a barrier); the statuses."""
    barrier = threading.Barrier(n)

    def one(i: int) -> int:
        barrier.wait()
        return call(i).status_code

    with ThreadPoolExecutor(n) as pool:
        return sorted(pool.map(one, range(n)))


def test_the_session_and_client_quotas_hold_under_a_burst(settings: Settings) -> None:
    tuned = {"tinker_max_sessions_per_project": 8, "tinker_max_models_per_project": 4}
    with start(settings, **tuned) as server:
        client = Client(server)
        sessions = burst(
            16, lambda _: client.post("create_session", {"tags": [], "sdk_version": "0.38.0"})
        )
        assert sessions == [200] * 8 + [429] * 8
        other = Client(server)
        session_id = other.session()
        models = burst(10, lambda i: other.model(session_id, i))
        assert models == [200] * 4 + [429] * 6


def test_the_polls_a_project_holds_open_are_bounded(settings: Settings) -> None:
    with start(settings, tinker_max_polls_per_project=2, tinker_poll_wait_s=3) as server:
        client = Client(server)
        session_id = client.session()
        model_id = client.model(session_id).json()["model_id"]
        request_id = client.post(
            "optim_step",
            {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-4}},
        ).json()["request_id"]
        statuses = burst(3, lambda _: client.post("retrieve_future", {"request_id": request_id}))
        assert statuses == [200, 200, 429]  # no worker: the two held polls answer try_again
        # Another project's poll is not refused for it.
        other = Client(server)
        other_model = other.model(other.session()).json()["model_id"]
        other_request = other.post(
            "optim_step",
            {"model_id": other_model, "seq_id": 1, "adam_params": {"learning_rate": 1e-4}},
        ).json()["request_id"]
        both = burst(
            3,
            lambda i: (client if i < 2 else other).post(
                "retrieve_future", {"request_id": request_id if i < 2 else other_request}
            ),
        )
        assert both == [200, 200, 200]
