"""The dashboard's Tinker page in headless Chromium against the real API (uvicorn on Postgres,
tests/dashboard/conftest.py): a session made through the Tinker API shows with its training
client, and shows ended once its client closes it (the page polls), under the page's CSP."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

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

    _tinker(served, f"sessions/{session_id}/finish", {"reason": {"type": "success"}})
    expect(row).to_have_attribute("data-status", "finished")
