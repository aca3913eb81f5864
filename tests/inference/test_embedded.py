"""`grpo serve` starts an inference process beside its API (and worker), which registers
itself, and stops it on exit: the row vanishes."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from app.core.db import make_engine, make_session_factory, session_scope
from app.core.settings import build_settings
from app.gateway import servers_repository
from tests.cli.conftest import ServerProcess
from tests.conftest import free_port, wait_until

pytestmark = [pytest.mark.process]


def _fresh_rows(database_url: str) -> dict[str, str]:
    engine = make_engine(database_url)
    try:
        with session_scope(make_session_factory(engine)) as session:
            return {r.id: r.control_url for r in servers_repository.fresh_servers(session)}
    finally:
        engine.dispose()


def test_grpo_serve_runs_an_inference_process_and_stops_it(pg_url: str, tmp_path: Path) -> None:
    settings = build_settings(data_dir=tmp_path / "data", database_url=pg_url)
    before = set(_fresh_rows(pg_url))
    server = ServerProcess(settings, free_port(), tmp_path / "serve.log", ("serve", "--no-worker"))
    server.start()
    try:

        def new_row() -> dict[str, str]:
            return {k: v for k, v in _fresh_rows(pg_url).items() if k not in before}

        rows = wait_until(new_row, 60, "the embedded inference process's row")
        assert isinstance(rows, dict) and len(rows) == 1
        [(server_id, control_url)] = rows.items()
        assert httpx.get(f"{control_url}/health", timeout=5).status_code == 200
        assert (settings.data_dir / "inference.log").is_file()
    finally:
        server.stop()
    wait_until(
        lambda: server_id not in _fresh_rows(pg_url), 60, "the row to vanish with grpo serve"
    )
