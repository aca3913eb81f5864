"""The dashboard in headless Chromium against the real service: a uvicorn API on Postgres, a real
`grpo worker` process training tiny jobs through Redis. The list shows the running job, the job
page's charts gain points as steps arrive, the compare page overlays two jobs, and the cancel
button stops the job. Screenshots of the live service go to docs/screenshots/."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import tiny_spec
from tests.dashboard.conftest import Served
from tests.worker.conftest import WorkerProcess

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
# Screenshots go to a temporary folder, so the test suite leaves the tree clean; run with
# GRPO_SCREENSHOT_DIR=docs/screenshots to refresh the ones the README shows.
MAIN_STEPS = 2000
SHOTS = Path(os.environ.get("GRPO_SCREENSHOT_DIR") or tempfile.mkdtemp(prefix="grpo-shots-"))
TIMEOUT_MS = 90_000


def _spec(name: str, steps: int, estimator: str, beta: float, seed: int = 0) -> dict[str, Any]:
    """A tiny job with two graders and an active KL term, so every chart has something to draw."""
    spec = tiny_spec(
        steps=steps,
        prompts_per_step=2,
        group_size=4,
        max_new_tokens=12,
        kl={"estimator": estimator, "beta": beta},
        num_iterations=2,  # the second pass over a batch can clip: the clip chart has values
    )
    spec["name"] = name
    spec["graders"] = [
        {"type": "numeric_match", "name": "correct"},
        {"type": "regex", "name": "format", "pattern": r"^\s*-?\d+", "weight": 0.2},
    ]
    spec["checkpoint_interval"] = 3
    spec["seed"] = seed
    return spec


def _create(served: Served, spec: dict[str, Any]) -> str:
    response = httpx.post(f"{served.url}/v1/jobs", json=spec, headers=served.headers, timeout=30)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def _job(served: Served, job_id: str) -> dict[str, Any]:
    response = httpx.get(f"{served.url}/v1/jobs/{job_id}", headers=served.headers, timeout=30)
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


def _sign_in(page: Any, url: str, key: str) -> None:
    page.goto(f"{url}/#/")
    page.fill("#api-key", key)
    page.click("form.key-form button")


def _points(page: Any, chart: str) -> int:
    return int(page.get_attribute(f'[data-chart="{chart}"]', "data-points") or 0)


def test_dashboard_follows_a_live_job_and_cancels_it(
    served: Served, start_worker: Callable[..., WorkerProcess], browser_page: Any
) -> None:
    from playwright.sync_api import expect

    page = browser_page
    page.set_default_timeout(TIMEOUT_MS)
    expect.set_options(timeout=TIMEOUT_MS)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))

    worker = start_worker(served.settings)
    # The worker runs one job at a time, oldest first: the short job finishes, the long one runs
    # while we look at it, the last one waits in the queue.
    short = _create(served, _spec("baseline-k3", 3, "k3", 0.1, seed=1))
    # Long enough that it is still running when the test cancels it, however fast the machine.
    main = _create(served, _spec("arith-k3-unbiased", MAIN_STEPS, "k3_unbiased", 0.04))
    queued = _create(served, _spec("queued-k2", 5, "k2", 0.02))

    try:
        # ---- jobs list: the key is typed into the sign-in form, exchanged for a cookie.
        _sign_in(page, served.url, served.key)
        main_row = page.locator(f'tr[data-job-id="{main}"]')
        expect(main_row).to_have_attribute("data-status", "running", timeout=150_000)
        expect(page.locator(f'tr[data-job-id="{short}"]')).to_have_attribute(
            "data-status", "succeeded"
        )
        expect(page.locator(f'tr[data-job-id="{queued}"]')).to_have_attribute(
            "data-status", "queued"
        )
        expect(main_row).to_contain_text("k3_unbiased · β 0.04")
        # The row updates itself (2 s polling): its step counter moves without a reload.
        row_step = (
            f"parseInt(document.querySelector('tr[data-job-id=\"{main}\"] .step').textContent)"
        )
        page.wait_for_function(f"() => {row_step} >= 1")
        before = int(page.evaluate(row_step))
        page.wait_for_function(f"() => {row_step} > Math.max({before}, 2)")
        assert main_row.locator("td.num").inner_text() != "–"  # latest reward
        page.screenshot(path=str(SHOTS / "jobs-list.png"))

        page.select_option("#status-filter", "running")
        expect(page.locator("#jobs-table tbody tr")).to_have_count(1)
        expect(page.locator("#jobs-table tbody tr")).to_have_attribute("data-job-id", main)
        page.select_option("#status-filter", "")
        expect(page.locator("#jobs-table tbody tr")).to_have_count(3)

        # ---- job page: charts gain points as the worker reports steps (over the SSE stream).
        main_row.locator("a").first.click()
        assert page.url.endswith(f"#/jobs/{main}")
        expect(page.locator("#job-status .badge")).to_have_text("running")
        page.wait_for_function(
            "() => document.querySelector('[data-chart=reward]').dataset.points >= 3"
        )
        seen = _points(page, "reward")
        page.wait_for_function(
            f"() => document.querySelector('[data-chart=reward]').dataset.points > {seen}"
        )
        assert _points(page, "reward") > seen
        for chart in (
            "grader_errors",
            "kl",
            "entropy",
            "mismatch",
            "clip",
            "length",
            "truncated",
            "time",
        ):
            assert _points(page, chart) >= seen, chart
        # The legend names every grader next to the total.
        legend = page.locator('[data-chart="reward"] .u-legend').inner_text()
        assert "total" in legend and "correct" in legend and "format" in legend
        expect(page.locator("#events tbody tr").first).to_be_visible()
        expect(page.locator("#events")).to_contain_text("started")
        expect(page.locator("#checkpoints")).to_contain_text("3")
        expect(page.locator("#samples .group").first).to_be_visible()
        expect(page.locator("#samples .completions tbody tr")).to_have_count(8)  # 2 groups x 4
        expect(page.locator("#spec")).to_contain_text("k3_unbiased")
        expect(page.locator("#spec tr.is-default").first).to_be_visible()
        page.wait_for_function(
            "() => document.querySelector('[data-chart=reward]').dataset.points >= 6"
        )
        page.screenshot(path=str(SHOTS / "job-page.png"), full_page=True)

        # The rollout viewer steps back to an earlier step.
        page.fill("#sample-step", "1")
        page.dispatch_event("#sample-step", "change")
        expect(page.locator("#samples .group-head").first).to_contain_text("step 1")

        # ---- compare: one metric of two jobs on one chart.
        page.goto(f"{served.url}/#/compare?jobs={short},{main}&metric=reward/mean")
        page.wait_for_function(
            "() => document.querySelector('[data-chart=compare]').dataset.points >= 3"
        )
        compare_legend = page.locator('[data-chart="compare"] .u-legend').inner_text()
        assert "baseline-k3" in compare_legend and "arith-k3-unbiased" in compare_legend
        page.screenshot(path=str(SHOTS / "compare.png"))

        # ---- cancel from the job page: cancelling, then cancelled within a step.
        httpx.post(f"{served.url}/v1/jobs/{queued}/cancel", headers=served.headers, timeout=30)
        page.goto(f"{served.url}/#/jobs/{main}")
        expect(page.locator("#job-status .badge")).to_have_text("running")
        page.once("dialog", lambda dialog: dialog.accept())
        page.click("#cancel-job")
        expect(page.locator("#job-status .badge")).to_have_text(re.compile("cancelling|cancelled"))
        expect(page.locator("#job-status .badge")).to_have_text("cancelled")
        expect(page.locator("#cancel-job")).to_be_disabled()
        final = _job(served, main)
        assert final["status"] == "cancelled"
        assert final["progress"]["step"] < MAIN_STEPS
    except Exception:
        print(worker.log_tail())
        raise
    assert not errors, errors


def test_a_bad_key_gets_the_key_form(served: Served, browser_page: Any) -> None:
    from playwright.sync_api import expect

    page = browser_page
    _sign_in(page, served.url, "not-a-key")
    expect(page.locator("form.key-form .error")).to_contain_text("rejected")
    assert "grpo_session" not in {c["name"] for c in page.context.cookies()}
    page.fill("#api-key", served.key)
    page.click("form.key-form button")
    expect(page.locator("#jobs-table")).to_be_visible()
    expect(page.locator("#conn")).to_have_text("live")
    # Signed in by the session cookie; the page keeps no key.
    assert page.evaluate("localStorage.getItem('grpo.apiKey')") is None
    assert "grpo_session" in {c["name"] for c in page.context.cookies()}


def test_a_key_in_the_url_is_never_used(served: Served, browser_page: Any) -> None:
    """A key in an address leaks into history, logs and Referer headers: an old `?key=` link
    signs nobody in, and the key is scrubbed from the address bar."""
    from playwright.sync_api import expect

    page = browser_page
    page.goto(f"{served.url}/?key={served.key}#/")
    expect(page.locator("form.key-form .error")).to_contain_text("not accepted")
    assert "key=" not in page.url
    assert page.evaluate("localStorage.getItem('grpo.apiKey')") is None
    expect(page.locator("#jobs-table")).to_have_count(0)
