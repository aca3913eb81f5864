"""The dashboard's Tinker page in headless Chromium against the real API (uvicorn on Postgres,
tests/dashboard/conftest.py): a session made through the Tinker API shows with its training
client, and shows ended once its client closes it (the page polls), under the page's CSP; its
chat panel offers the client's sampler weights saves once one is recorded (the answer itself,
through a real inference process, is tests/inference/test_tinker_served.py)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from app.core.clock import utcnow
from app.core.db import make_engine, make_session_factory, session_scope
from app.core.tinker_tables import TinkerModel
from app.tinker import worker_repository
from tests.dashboard.conftest import Served, browser_page, page, served  # noqa: F401

pytestmark = pytest.mark.browser


def _tinker(app: Served, path: str, body: dict[str, Any]) -> dict[str, Any]:
    answer = httpx.post(
        f"{app.url}/api/v1/{path}",
        json=body,
        headers={"X-API-Key": "tml-" + app.key},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    result: dict[str, Any] = answer.json()
    return result


def _record_sampler_save(app: Served, model_id: str, name: str) -> None:
    """The row a worker records once it wrote a sampler save (worker/tinker_saves.py)."""
    engine = make_engine(app.settings.resolved_database_url)
    try:
        with session_scope(make_session_factory(engine)) as db:
            model = db.get(TinkerModel, model_id)
            assert model is not None
            project_id = model.project_id
            worker_repository.record_checkpoint(
                db, model_id=model_id, project_id=project_id, kind="sampler_weights", name=name,
                folder="/unused", size_bytes=1, user_metadata=None, now=utcnow(), expires_at=None,
            )  # fmt: skip
    finally:
        engine.dispose()


def test_the_tinker_page_lists_sessions_and_their_training_clients(
    served: Served,  # noqa: F811
    page: Any,  # noqa: F811
) -> None:
    from playwright.sync_api import expect

    session_id = _tinker(
        served,
        "create_session",
        {"tags": ["rl"], "sdk_version": "0.38.0", "display_name": "rl-loop"},
    )["session_id"]
    model_id = _tinker(
        served,
        "create_model",
        {"session_id": session_id, "model_seq_id": 0, "base_model": "tiny-random-llama",
         "lora_config": {"rank": 8}},
    )["model_id"]  # fmt: skip

    page.goto(f"{served.url}/#/tinker")
    page.fill("#api-key", served.key)
    page.click("form.key-form button")
    row = page.locator(f'#tinker-table tr[data-session-id="{session_id}"]')
    expect(row).to_have_attribute("data-status", "live")
    expect(row).to_contain_text("rl-loop")
    model = row.locator(f'tr[data-model-id="{model_id}"]')
    expect(model).to_contain_text("tiny-random-llama")
    expect(model.locator("td.num").first).to_have_text("8")
    expect(page.locator('[data-nav="tinker"]')).to_have_class("active")
    expect(page.locator("#tinker-summary")).to_have_text("1 session, 1 live")
    expect(page.locator("#tinker-pager")).to_have_text("")  # one page: no links

    chat = page.locator("#chat-model")
    expect(page.locator("#chat-status")).to_contain_text("No sampler weights yet")
    expect(page.locator("#chat-send")).to_be_disabled()
    _record_sampler_save(served, model_id, "served")
    expect(chat.locator("option")).to_have_count(1)
    expect(chat).to_have_value(f"ft:tiny-random-llama:served:{model_id}")
    expect(chat.locator("option")).to_contain_text(f"tinker://{model_id}/sampler_weights/served")
    expect(page.locator("#chat-status")).to_have_text("")

    _tinker(served, f"sessions/{session_id}/finish", {"reason": {"type": "success"}})
    expect(row).to_have_attribute("data-status", "finished")
