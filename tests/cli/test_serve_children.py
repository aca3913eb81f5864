"""`grpo serve`'s children on the embedded default (SQLite, filesystem broker): the embedded
worker and the embedded inference process end with it however it ends (SIGTERM, what docker,
systemd and supervisors send, and SIGINT stop them before it exits; after a SIGKILL the kernel's
parent-death signal ends them), and the inference process's control API answers only the API,
which holds the token `grpo serve` made for the two."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.core.settings import build_settings
from app.gateway.protocol import ENSURE_PATH, TOKEN_HEADER
from tests.cli.conftest import ServerProcess
from tests.conftest import free_port, wait_until
from tests.inference.test_embedded import _fresh_rows as registered_servers
from tests.processes import descendants, running

pytestmark = [pytest.mark.process]

# How long the children may take to start (the worker to consume, the inference process to
# answer) and to end (an idle worker's warm shutdown, an inference process with no engine
# stopping): seconds each on a quiet machine, stretched on a loaded 2-core one.
START_S = 90
STOP_S = 90


def _inference_answers(database_url: str) -> bool:
    """Whether the embedded inference process has registered and its control API answers."""
    for control_url in registered_servers(database_url).values():
        try:
            return httpx.get(f"{control_url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False
    return False


@pytest.fixture
def embedded(tmp_path: Path) -> Iterator[tuple[ServerProcess, set[int]]]:
    """`grpo serve` with its worker consuming and its inference process registered, and the
    pids of every process below it."""
    settings = build_settings(data_dir=tmp_path / "data")
    server = ServerProcess(settings, free_port(), tmp_path / "serve.log", ("serve",))
    server.start()
    family: set[int] = set()
    try:
        worker_log = settings.data_dir / "worker.log"
        wait_until(
            lambda: " ready." in worker_log.read_text(errors="replace"),
            START_S,
            "the embedded worker to consume",
        )
        wait_until(
            lambda: _inference_answers(settings.resolved_database_url),
            START_S,
            "the embedded inference process to register and answer",
        )
        assert server.proc is not None
        family = descendants(server.proc.pid)
        assert len(family) >= 2, family  # the worker and the inference process, at least
        yield server, family
    finally:
        if server.proc is not None and server.proc.poll() is None:
            family |= descendants(server.proc.pid)  # and those started since
        server.kill()
        for pid in running(family):  # what outlived the test (a failed one) ends here
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_ends_every_child_before_grpo_serve_exits(
    embedded: tuple[ServerProcess, set[int]], stop: signal.Signals
) -> None:
    server, family = embedded
    assert server.proc is not None
    server.proc.send_signal(stop)
    code = server.proc.wait(timeout=STOP_S)
    # It waited for its children: none is left once it has exited.
    assert running(family) == set(), (code, server.log())
    if stop == signal.SIGTERM:
        assert code == -signal.SIGTERM, server.log()  # and it ended as SIGTERM asked


def test_a_killed_grpo_serve_takes_every_child_with_it(
    embedded: tuple[ServerProcess, set[int]],
) -> None:
    server, family = embedded
    server.kill()  # SIGKILL: no handler of its own runs
    wait_until(lambda: not running(family), STOP_S, f"the children {sorted(family)} to end")


def test_the_inference_control_api_answers_only_the_api_that_holds_its_token(
    embedded: tuple[ServerProcess, set[int]],
) -> None:
    """No GRPO_INFERENCE_TOKEN set (the default): another local process reaches neither the
    control API nor, through it, the engines and any project's checkpoint."""
    server, _ = embedded
    [control_url] = registered_servers(server.settings.resolved_database_url).values()
    ensure = {"base_model": "tiny-random-llama"}
    for headers in ({}, {TOKEN_HEADER: "guessed-token-of-16+chars"}):
        listed = httpx.get(f"{control_url}/engines", headers=headers, timeout=10)
        assert listed.status_code == 401, listed.text
        ensured = httpx.post(f"{control_url}{ENSURE_PATH}", json=ensure, headers=headers)
        assert ensured.status_code == 401, ensured.text
    # The API holds the token: its ensure is accepted and starts the engine (503 while it
    # starts; a refused ensure would be `inference_unavailable`).
    key = (server.settings.data_dir / "api-key").read_text().strip()
    chat = {"model": "tiny-random-llama", "messages": [{"role": "user", "content": "hi"}]}
    answer = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={**chat, "max_tokens": 1},
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "engine_starting", answer.text
