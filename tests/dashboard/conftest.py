"""Dashboard fixtures: a real API server (uvicorn in a thread) on the session's Postgres + Redis,
and headless Chromium driven by the Python playwright package (the system browser, never a
downloaded build)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from app.core.settings import Settings, build_settings
from tests.conftest import REDIS_URL, new_project_key
from tests.live_server import serve
from tests.worker.conftest import start_worker  # noqa: F401  (fixture used by the tests here)

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@dataclass
class Served:
    url: str
    settings: Settings
    key: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@pytest.fixture
def served(pg_url: str, queue_name: str, tmp_path: Path) -> Iterator[Served]:
    """The real app on a free port; signal handlers stay with pytest (uvicorn skips them off the
    main thread)."""
    # A queue of its own: no message left behind by another test's killed worker reaches ours.
    settings = build_settings(
        data_dir=tmp_path / "data",
        database_url=pg_url,
        broker_url=REDIS_URL,
        queue_name=f"{queue_name}-dashboard",
    )
    key, _ = new_project_key(settings)
    with serve(settings) as server:
        yield Served(server.url, settings, key)


@pytest.fixture
def browser_page() -> Iterator[object]:
    """A fresh page in headless system Chromium; skips when the browser or playwright is absent."""
    if not CHROMIUM.exists() and shutil.which("chromium") is None:
        pytest.skip("/usr/bin/chromium is not installed (apt-get install -y chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the playwright Python package is not installed (pip install playwright)")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        context = browser.new_context(viewport={"width": 1440, "height": 900})
        page = context.new_page()
        try:
            yield page
        finally:
            context.close()
            browser.close()
