"""The web dashboard: static HTML/JS served at `/`, plus the chart library from npm.

The page and its scripts are public; they hold no data. The page signs in once with the key
(POST /v1/session, app.sessions.routes) and then calls /v1 with the session cookie, so the
dashboard sees exactly what the key's project may see. Every file is served with a strict
Content-Security-Policy: scripts and styles from this origin only, no inline code, no framing,
so a job name or completion text that slipped into the DOM as markup still could not run. Files are served from a fixed allow-list (no user-supplied paths), and
the chart library comes from dashboard/node_modules, installed by `npm ci` in scripts/setup.sh.
The API reference at /docs is served the same way (Swagger UI from npm, dashboard/docs.html),
never from a CDN.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response

from app.core.errors import NotFound

DASHBOARD_DIR = Path(
    os.environ.get("GRPO_DASHBOARD_DIR") or Path(__file__).resolve().parents[2] / "dashboard"
)

# name in the URL -> (path under DASHBOARD_DIR, media type)
ASSETS: dict[str, tuple[str, str]] = {
    "app.js": ("app.js", "text/javascript"),
    "api.js": ("api.js", "text/javascript"),
    "dom.js": ("dom.js", "text/javascript"),
    "job.js": ("job.js", "text/javascript"),
    "job_parts.js": ("job_parts.js", "text/javascript"),
    "rollouts.js": ("rollouts.js", "text/javascript"),
    "chat.js": ("chat.js", "text/javascript"),
    "tinker.js": ("tinker.js", "text/javascript"),
    "spec.js": ("spec.js", "text/javascript"),
    "charts.js": ("charts.js", "text/javascript"),
    "style.css": ("style.css", "text/css"),
    "uPlot.esm.js": ("node_modules/uplot/dist/uPlot.esm.js", "text/javascript"),
    "uPlot.min.css": ("node_modules/uplot/dist/uPlot.min.css", "text/css"),
    # The API reference at /docs (FastAPI's own page loads these from a CDN with an inline
    # script: another origin's code on the origin of the session cookie).
    "docs.js": ("docs.js", "text/javascript"),
    "swagger-ui-bundle.js": (
        "node_modules/swagger-ui-dist/swagger-ui-bundle.js",
        "text/javascript",
    ),
    "swagger-ui.css": ("node_modules/swagger-ui-dist/swagger-ui.css", "text/css"),
}

MISSING = """<!doctype html><meta charset="utf-8"><title>grpo-service</title>
<p>The dashboard files are not installed ({what}). Run <code>scripts/setup.sh</code>
(it runs <code>npm ci</code> in <code>dashboard/</code>). The API is at <a href="/docs">/docs</a>.</p>
"""

CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)
# Revalidate on every load (the files change with the deployment and are tiny); never framed,
# never sniffed into another type, no Referer to other sites.
HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}

router = APIRouter(include_in_schema=False)


@router.get("/", response_class=HTMLResponse)
def index() -> Response:
    page = DASHBOARD_DIR / "index.html"
    if not page.is_file():
        return HTMLResponse(MISSING.format(what="index.html"), status_code=503, headers=HEADERS)
    return FileResponse(page, media_type="text/html", headers=HEADERS)


@router.get("/docs", response_class=HTMLResponse)
def api_reference() -> Response:
    """The API reference (Swagger UI on /openapi.json), from this origin under the CSP."""
    page = DASHBOARD_DIR / "docs.html"
    if not page.is_file():
        return HTMLResponse(MISSING.format(what="docs.html"), status_code=503, headers=HEADERS)
    return FileResponse(page, media_type="text/html", headers=HEADERS)


@router.get("/dashboard")
def dashboard_root() -> RedirectResponse:
    return RedirectResponse("/", status_code=307)


@router.get("/dashboard/{name}")
def asset(name: Annotated[str, PathParam(max_length=64)]) -> Response:
    entry = ASSETS.get(name)
    if entry is None:
        raise NotFound(f"no dashboard file {name!r}")
    relative, media_type = entry
    path = DASHBOARD_DIR / relative
    if not path.is_file():
        return HTMLResponse(MISSING.format(what=relative), status_code=503, headers=HEADERS)
    return FileResponse(path, media_type=media_type, headers=HEADERS)
