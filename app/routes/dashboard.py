"""The web dashboard: static HTML/JS served at `/`, plus the chart library from npm.

The page and its scripts are public; they hold no data. Every data call the page makes goes to
/v1 with the project's key in the Authorization header, so the dashboard sees exactly what the
key's project may see. Files are served from a fixed allow-list (no user-supplied paths), and
the chart library comes from dashboard/node_modules, installed by `npm ci` in scripts/setup.sh.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response

from app.errors import NotFound

DASHBOARD_DIR = Path(
    os.environ.get("GRPO_DASHBOARD_DIR") or Path(__file__).resolve().parents[2] / "dashboard"
)

# name in the URL -> (path under DASHBOARD_DIR, media type)
ASSETS: dict[str, tuple[str, str]] = {
    "app.js": ("app.js", "text/javascript"),
    "charts.js": ("charts.js", "text/javascript"),
    "style.css": ("style.css", "text/css"),
    "uPlot.esm.js": ("node_modules/uplot/dist/uPlot.esm.js", "text/javascript"),
    "uPlot.min.css": ("node_modules/uplot/dist/uPlot.min.css", "text/css"),
}

MISSING = """<!doctype html><meta charset="utf-8"><title>grpo-service</title>
<p>The dashboard files are not installed ({what}). Run <code>scripts/setup.sh</code>
(it runs <code>npm ci</code> in <code>dashboard/</code>). The API is at <a href="/docs">/docs</a>.</p>
"""

# Revalidate on every load: the files change with the deployment and are tiny.
NO_CACHE = {"Cache-Control": "no-cache"}

router = APIRouter(include_in_schema=False)


@router.get("/", response_class=HTMLResponse)
def index() -> Response:
    page = DASHBOARD_DIR / "index.html"
    if not page.is_file():
        return HTMLResponse(MISSING.format(what="index.html"), status_code=503)
    return FileResponse(page, media_type="text/html", headers=NO_CACHE)


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
        return HTMLResponse(MISSING.format(what=relative), status_code=503)
    return FileResponse(path, media_type=media_type, headers=NO_CACHE)
