"""The API serves the dashboard's static files: public HTML/JS from a fixed allow-list, the chart
library from dashboard/node_modules, while every /v1 data call still needs the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.core.settings import build_settings
from app.dashboard.routes import ASSETS, DASHBOARD_DIR
from app.main import create_app


@pytest.fixture
def client(tmp_path: Path) -> TestClient:
    return TestClient(create_app(build_settings(data_dir=tmp_path)))


def test_the_page_is_public_and_loads_its_modules_from_the_api(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    for src in (
        'src="/dashboard/app.js"',
        'href="/dashboard/style.css"',
        "/dashboard/uPlot.min.css",
    ):
        assert src in page.text
    assert "cdn" not in page.text.lower()


@pytest.mark.parametrize("name", sorted(ASSETS))
def test_every_asset_is_served_with_its_media_type(client: TestClient, name: str) -> None:
    if name.startswith("uPlot") and not (DASHBOARD_DIR / "node_modules").is_dir():
        pytest.skip("dashboard/node_modules is missing: run `npm ci` in dashboard/")
    response = client.get(f"/dashboard/{name}")
    assert response.status_code == 200, response.text[:200]
    expected = "text/javascript" if name.endswith(".js") else "text/css"
    assert response.headers["content-type"].startswith(expected)
    assert len(response.content) > 100


# Files from npm, and the API reference's classic (non-module) start script.
VENDORED = ("uPlot", "swagger-ui")
CLASSIC_SCRIPTS = {"docs.js"}


def test_modules_import_only_files_the_api_serves() -> None:
    served = {f"/dashboard/{name}" for name in ASSETS}
    ours = [
        name
        for name in ASSETS
        if name.endswith(".js") and not name.startswith(VENDORED) and name not in CLASSIC_SCRIPTS
    ]
    assert {"app.js", "api.js", "job.js", "charts.js"} <= set(ours)
    for module in ours:
        text = (DASHBOARD_DIR / module).read_text()
        imports = re.findall(r'^import\b[^;]*?\bfrom\s+"([^"]+)"', text, flags=re.M | re.S)
        assert set(imports) <= served, (module, imports)
        assert imports or module == "api.js", module


@pytest.mark.parametrize(
    "path", ["/dashboard/../pyproject.toml", "/dashboard/index.py", "/dashboard/.env"]
)
def test_nothing_outside_the_allow_list_is_served(client: TestClient, path: str) -> None:
    response = client.get(path)
    assert response.status_code == 404
    assert "[project]" not in response.text


def test_data_calls_still_need_the_key(client: TestClient) -> None:
    assert client.get("/v1/jobs").status_code == 401


def test_the_dashboard_stays_out_of_the_api_schema(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert "/" not in paths and not any(p.startswith("/dashboard") for p in paths)


@pytest.mark.parametrize("path", ["/", "/docs", *(f"/dashboard/{name}" for name in sorted(ASSETS))])
def test_the_page_and_its_files_carry_a_strict_csp(client: TestClient, path: str) -> None:
    """Scripts and styles from this origin only, no inline code, no framing, no plugins: the
    page's own files are the only code that can run in it."""
    response = client.get(path)
    policy = {
        directive.split()[0]: directive.split()[1:]
        for directive in response.headers["content-security-policy"].split(";")
    }
    assert policy["default-src"] == ["'self'"]
    assert policy["script-src"] == ["'self'"]
    assert policy["style-src"] == ["'self'"]
    assert policy["connect-src"] == ["'self'"]
    assert policy["object-src"] == ["'none'"]
    assert policy["base-uri"] == ["'none'"]
    assert policy["frame-ancestors"] == ["'none'"]
    assert response.headers["x-content-type-options"] == "nosniff"


def test_the_api_reference_loads_only_served_files() -> None:
    """/docs (FastAPI's page loads Swagger UI from a CDN with an inline script) is a file of
    ours whose scripts and styles are all served by the dashboard's allow-list."""
    page = (DASHBOARD_DIR / "docs.html").read_text()
    sources = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert sources and set(sources) <= {f"/dashboard/{name}" for name in ASSETS}, sources
    assert not re.search(r"<script>|<style|\son\w+=", page)


def test_redoc_and_fastapis_docs_page_are_off(client: TestClient) -> None:
    assert client.get("/redoc").status_code == 404
    docs = client.get("/docs")
    assert docs.status_code == 200 and "cdn.jsdelivr.net" not in docs.text


def test_the_page_has_no_inline_script_or_style() -> None:
    """What the CSP would block must not be needed: every script and style is a file."""
    page = (DASHBOARD_DIR / "index.html").read_text()
    assert "<script" not in page.replace('<script type="module" src="/dashboard/app.js">', "")
    assert "<style" not in page and " style=" not in page and "onclick" not in page
