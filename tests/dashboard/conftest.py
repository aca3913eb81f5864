"""Dashboard fixtures: a real API server (uvicorn in a thread) on the session's Postgres + Redis,
headless Chromium driven by the Python playwright package (the system browser, never a
downloaded build), and a writer of a job's progress as the worker writes it."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from app.core.clock import utcnow
from app.core.db import make_engine, make_session_factory, session_scope
from app.core.job_status import JobStatus
from app.core.settings import Settings, build_settings
from app.jobs import repository as jobs_repo
from app.jobs import transitions
from app.progress import repository as progress_repo
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


TIMEOUT_MS = 30_000
# Every CSP violation the page meets is recorded where the test can read it.
RECORD_CSP = """
window.__csp = [];
document.addEventListener("securitypolicyviolation",
  (e) => window.__csp.push(`${e.violatedDirective} ${e.blockedURI}`));
"""


class JobWriter:
    """Writes a job's progress the way the worker's callbacks do."""

    def __init__(self, served: Served, job_id: str) -> None:
        self.job_id = job_id
        self.engine = make_engine(served.settings.resolved_database_url)
        self.sessions = make_session_factory(self.engine)

    def checkpoint(self, step: int) -> None:
        """A checkpoint saved after the step: its row and its event (no step moves)."""
        with session_scope(self.sessions) as session:
            progress_repo.add_checkpoint_once(
                session,
                job_id=self.job_id,
                step=step,
                attempt=0,
                path=Path(f"/nonexistent/checkpoint-{step:06d}"),
                now=utcnow(),
            )
            transitions.add_event(session, self.job_id, "checkpoint", f"checkpoint {step} saved")

    def samples(self, step: int, groups: list[dict[str, Any]]) -> None:
        """The step's rollout samples, as the worker's on_samples stores them."""
        with session_scope(self.sessions) as session:
            progress_repo.add_samples_once(
                session, job_id=self.job_id, step=step, attempt=0, data=groups, now=utcnow()
            )

    def status(self, target: JobStatus) -> None:
        with session_scope(self.sessions) as session:
            transitions.transition(session, self.job_id, target, attempt=None)

    def step(self, step: int) -> None:
        """One finished step: the job row's progress (fenced by the attempt, as the worker's
        update is) and the step's metrics, in one transaction."""
        values = {"reward/mean": step / 10, "kl": 0.01 * step, "entropy": 1.0}
        now = utcnow()
        with session_scope(self.sessions) as session:
            progress = {"current_step": step, "last_metrics": values, "heartbeat_at": now}
            assert jobs_repo.update_progress(
                session, job_id=self.job_id, attempt=0, values={**progress, "updated_at": now}
            )
            progress_repo.add_metrics_once(
                session, job_id=self.job_id, step=step, attempt=0, values=values, now=now
            )


@pytest.fixture
def page(browser_page: Any) -> Iterator[Any]:
    from playwright.sync_api import expect

    browser_page.set_default_timeout(TIMEOUT_MS)
    expect.set_options(timeout=TIMEOUT_MS)
    browser_page.add_init_script(RECORD_CSP)
    errors: list[str] = []
    browser_page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield browser_page
    assert not errors, errors
    assert browser_page.evaluate("window.__csp") == []
