"""The dashboard's sign-in, stream and page hardening in headless Chromium against the real API:
the job page's charts grow from the job's SSE stream alone (every metrics request after the
first load is refused), a job name that is HTML renders as text, the key ends up in no URL and
no web storage while the session cookie is HttpOnly, and nothing the page does trips its
Content-Security-Policy.

The job's progress is written as a worker writes it (a status transition, then one metrics row
per step through the same repository: conftest.JobWriter) so the test controls when each step
appears."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from app.core.job_status import JobStatus
from tests.conftest import tiny_spec
from tests.dashboard.conftest import JobWriter, Served

pytestmark = pytest.mark.browser


@pytest.fixture
def writer(served: Served) -> Iterator[JobWriter]:
    spec = {**tiny_spec(steps=50), "name": "streamed"}
    response = httpx.post(f"{served.url}/v1/jobs", json=spec, headers=served.headers, timeout=30)
    assert response.status_code == 201, response.text
    job = JobWriter(served, response.json()["id"])
    yield job
    job.engine.dispose()


def _sign_in(page: Any, url: str, key: str) -> None:
    from playwright.sync_api import expect

    page.goto(f"{url}/#/")
    page.fill("#api-key", key)
    page.click("form.key-form button")
    expect(page.locator("#jobs-table")).to_be_visible()


def _points(chart: str) -> str:
    return f"Number(document.querySelector('[data-chart={chart}]').dataset.points)"


def test_the_job_chart_grows_from_the_stream_alone(
    served: Served, page: Any, writer: JobWriter
) -> None:
    from playwright.sync_api import Route, expect

    writer.status(JobStatus.RUNNING)
    writer.step(1)
    writer.step(2)
    metrics_calls: list[str] = []

    def first_metrics_load_only(route: Route) -> None:
        metrics_calls.append(route.request.url)
        if len(metrics_calls) == 1:
            route.continue_()
        else:
            route.abort()

    page.route(re.compile(r"/v1/jobs/[^/]+/metrics"), first_metrics_load_only)
    streams: list[str] = []
    page.on(
        "request",
        lambda r: streams.append(r.url) if "/v1/jobs/" in r.url and "/stream" in r.url else None,
    )

    _sign_in(page, served.url, served.key)
    page.goto(f"{served.url}/#/jobs/{writer.job_id}")
    page.wait_for_function(f"() => {_points('reward')} === 2")
    page.wait_for_function("() => document.getElementById('conn').title.includes('event stream')")
    for step in range(3, 6):
        writer.step(step)
        page.wait_for_function(f"() => {_points('reward')} === {step}")
    # Step 6 also brings the page's follow-up load of that step's checkpoints and rollouts.
    with page.expect_response(lambda r: "/samples?" in r.url and "step=6" in r.url):
        writer.step(6)
    page.wait_for_function(f"() => {_points('reward')} === 6")
    assert page.evaluate(_points("kl")) == 6
    expect(page.locator('[data-chart="reward"] .latest')).to_have_text("0.6 at step 6")
    expect(page.locator("#job-step")).to_have_text("step 6 of 50")
    # A job event on the stream (a checkpoint saved at the same step) refreshes the checkpoints.
    writer.checkpoint(6)
    expect(page.locator("#events")).to_contain_text("checkpoint 6 saved")
    expect(page.locator("#checkpoints tbody tr")).to_have_count(1)
    expect(page.locator("#checkpoints tbody td.path")).to_have_text("checkpoint-000006")

    # A status change arrives on the stream too.
    writer.status(JobStatus.CANCELLING)
    expect(page.locator("#job-status .badge")).to_have_text("cancelling")
    writer.status(JobStatus.CANCELLED)
    expect(page.locator("#job-status .badge")).to_have_text("cancelled")

    assert len(metrics_calls) == 1, metrics_calls  # the first load; never a poll
    assert "max_points" in metrics_calls[0]
    assert len(streams) == 1 and f"/v1/jobs/{writer.job_id}/stream" in streams[0]


def test_a_job_name_that_is_html_renders_as_text(served: Served, page: Any) -> None:
    from playwright.sync_api import expect

    name = "<img src=x onerror=alert(1)>"
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    response = httpx.post(
        f"{served.url}/v1/jobs",
        json={**tiny_spec(), "name": name},
        headers=served.headers,
        timeout=30,
    )
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]

    _sign_in(page, served.url, served.key)
    link = page.locator(f'tr[data-job-id="{job_id}"] a')
    expect(link).to_have_text(name)
    assert page.locator("#jobs-table img").count() == 0

    link.click()
    expect(page.locator("#job-title")).to_have_text(name)
    assert page.locator("#view img").count() == 0
    assert page.title() == f"{name} · grpo-service"
    assert dialogs == []


def test_the_key_stays_out_of_urls_and_storage(served: Served, page: Any) -> None:
    from playwright.sync_api import expect

    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    # An earlier version kept the key in localStorage: it is removed on the next visit.
    page.goto(f"{served.url}/#/")
    page.evaluate("(k) => localStorage.setItem('grpo.apiKey', k)", served.key)
    page.reload()
    page.fill("#api-key", served.key)
    page.click("form.key-form button")
    expect(page.locator("#project")).not_to_be_empty()
    expect(page.locator("#conn")).to_have_text("live")
    storage = page.evaluate(
        "JSON.stringify([Object.entries(localStorage), Object.entries(sessionStorage)])"
    )
    assert storage == "[[],[]]"
    assert served.key not in page.url
    assert not [url for url in requests if served.key in url]
    assert served.key not in page.content()  # the form field was cleared

    cookies = {c["name"]: c for c in page.context.cookies()}
    session = cookies["grpo_session"]
    assert session["httpOnly"] is True and session["sameSite"] == "Strict"
    assert session["path"] == "/v1"
    assert served.key not in session["value"]
    assert "grpo_session" not in page.evaluate("document.cookie")

    # A reload keeps the session (the cookie), with still nothing in storage.
    page.reload()
    expect(page.locator("#jobs-table")).to_be_visible()
    # Signing out clears the cookie and shows the form again.
    page.click("#sign-out")
    expect(page.locator("form.key-form")).to_be_visible()
    assert "grpo_session" not in {c["name"] for c in page.context.cookies()}
    page.reload()
    expect(page.locator("form.key-form")).to_be_visible()


def test_the_job_page_polls_while_the_stream_is_down_and_goes_back_to_it(
    served: Served, page: Any, writer: JobWriter
) -> None:
    from playwright.sync_api import Route

    writer.status(JobStatus.RUNNING)
    writer.step(1)
    refused: list[str] = []

    def refuse(route: Route) -> None:
        refused.append(route.request.url)
        route.abort()

    stream_url = re.compile(r"/v1/jobs/[^/]+/stream")
    page.route(stream_url, refuse)
    _sign_in(page, served.url, served.key)
    page.goto(f"{served.url}/#/jobs/{writer.job_id}")
    page.wait_for_function(f"() => {_points('reward')} === 1")
    page.wait_for_function("() => document.getElementById('conn').title.startsWith('Polling')")
    # The stream is down: the page polls, and the chart still grows.
    writer.step(2)
    page.wait_for_function(f"() => {_points('reward')} === 2")
    assert refused

    # The stream comes back: the page follows it again (it retries every 10 s).
    page.unroute(stream_url, refuse)
    page.wait_for_function(
        "() => document.getElementById('conn').title.includes('event stream')", timeout=25_000
    )
    writer.step(3)
    page.wait_for_function(f"() => {_points('reward')} === 3")


def test_the_job_list_reloads_when_the_project_stream_says_so(
    served: Served, page: Any, writer: JobWriter
) -> None:
    """The list reads /v1/jobs once, then again only when /v1/stream reports a change: no
    polling while nothing happens, and a step or a new job shows within seconds."""
    from playwright.sync_api import expect

    lists: list[str] = []
    page.on("request", lambda r: lists.append(r.url) if "/v1/jobs?" in r.url else None)
    _sign_in(page, served.url, served.key)
    row = page.locator(f"tr[data-job-id='{writer.job_id}']")
    expect(row).to_be_visible()
    # Quiet: the stream's first message and the first load settle, then nothing is read.
    page.wait_for_timeout(1500)
    settled = len(lists)
    page.wait_for_timeout(5000)  # > 2 polling periods of the old list
    assert len(lists) == settled, lists
    writer.status(JobStatus.RUNNING)
    writer.step(7)
    expect(row.locator(".step")).to_have_text("7 / 50")
    response = httpx.post(
        f"{served.url}/v1/jobs", json={**tiny_spec(), "name": "second"}, headers=served.headers
    )
    assert response.status_code == 201
    expect(page.locator(f"tr[data-job-id='{response.json()['id']}']")).to_be_visible()
    assert len(lists) <= settled + 4, lists  # a read per change, not per period


def test_the_compare_page_reads_again_only_when_the_project_stream_says_so(
    served: Served, page: Any, writer: JobWriter
) -> None:
    """The compare page loads once, then again only when /v1/stream reports a change: a step
    of a compared job adds its point, and nothing is read while nothing happens (it polled
    every 2 s)."""
    writer.status(JobStatus.RUNNING)
    writer.step(1)
    writer.step(2)
    reads: list[str] = []
    page.on("request", lambda r: reads.append(r.url) if "/v1/jobs" in r.url else None)
    _sign_in(page, served.url, served.key)
    page.goto(f"{served.url}/#/compare?jobs={writer.job_id}&metric=reward/mean")
    page.wait_for_function(f"() => {_points('compare')} === 2")
    page.wait_for_function("() => document.getElementById('conn').title.includes('event stream')")
    page.wait_for_timeout(1500)  # the stream's first message and its load settle
    settled = len(reads)
    page.wait_for_timeout(5000)  # > 2 polling periods of the old page
    assert len(reads) == settled, reads[settled:]
    writer.step(3)
    page.wait_for_function(f"() => {_points('compare')} === 3")
    assert len(reads) <= settled + 6, reads[settled:]  # one load for the change, not per period


def test_the_api_reference_runs_from_this_origin_under_the_csp(served: Served, page: Any) -> None:
    """/docs is Swagger UI from the package, under the dashboard's CSP: it renders the API's
    own schema, loads nothing from another origin and trips no policy (the `page` fixture
    fails the test on a CSP violation or a script error)."""
    from playwright.sync_api import expect

    origins: set[str] = set()
    page.on("request", lambda request: origins.add(re.sub(r"^(\w+://[^/]+).*", r"\1", request.url)))
    page.goto(f"{served.url}/docs")
    expect(page.locator(".swagger-ui .info .title")).to_contain_text("grpo-service")
    expect(page.locator(".opblock-summary-path", has_text="/v1/jobs").first).to_be_visible()
    assert origins == {served.url}, origins
