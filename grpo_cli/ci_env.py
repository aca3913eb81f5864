"""What the CLI learns from its environment: the API address and key, the CI commit, the spec
file, and the default Idempotency-Key derived from them."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

DEFAULT_API_URL = "http://127.0.0.1:8000"
LOCAL_KEY_FILE = "api-key"  # written by `grpo serve` into the data folder (grpo_cli.serve)
COMMIT_VARIABLES = ("GITHUB_SHA", "CI_COMMIT_SHA")  # GitHub Actions, GitLab CI


class UsageError(Exception):
    """The command cannot run as asked (bad file, no key); exits with the usage code."""


def api_url(flag: str | None, env: Mapping[str, str]) -> str:
    """--api-url, else GRPO_API_URL, else the local default."""
    return (flag or env.get("GRPO_API_URL") or DEFAULT_API_URL).rstrip("/")


def api_key(flag: str | None, env: Mapping[str, str]) -> str:
    """--api-key, else GRPO_API_KEY, else the key file that `grpo serve` leaves in the data folder
    ($GRPO_DATA_DIR/api-key, by default .grpo/api-key)."""
    if flag:
        return flag
    if env.get("GRPO_API_KEY"):
        return env["GRPO_API_KEY"]
    path = Path(env.get("GRPO_DATA_DIR") or ".grpo") / LOCAL_KEY_FILE
    try:
        key = path.read_text().strip()
    except OSError:
        key = ""
    if not key:
        raise UsageError(f"no API key: pass --api-key, set GRPO_API_KEY, or create {path}")
    return key


def ci_commit(env: Mapping[str, str], repo_dir: Path) -> str | None:
    """The commit being built: GITHUB_SHA or CI_COMMIT_SHA, else `git rev-parse HEAD` in
    `repo_dir` when it is inside a git work tree, else None."""
    for name in COMMIT_VARIABLES:
        if env.get(name, "").strip():
            return env[name].strip()
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=repo_dir,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    sha = out.stdout.strip()
    return sha if out.returncode == 0 and sha else None


def idempotency_key(spec: Mapping[str, Any], commit: str | None) -> str:
    """A stable key for (spec, commit): a retried pipeline of the same commit sends the same key
    and gets the job it already started, while a new commit or an edited spec starts a new one.
    The spec is hashed in canonical JSON, so key order and YAML formatting do not matter."""
    canonical = json.dumps(
        {"spec": spec, "commit": commit},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        default=str,
    )
    return "grpo-cli-" + hashlib.sha256(canonical.encode()).hexdigest()[:48]


def load_spec(path: str) -> tuple[dict[str, Any], Path]:
    """Read a YAML (or JSON) job spec; `-` reads stdin. Returns the spec and the folder to look
    for a git commit in."""
    try:
        if path == "-":
            text, folder = sys.stdin.read(), Path.cwd()
        else:
            file = Path(path)
            text, folder = file.read_text(), file.resolve().parent
    except OSError as exc:
        raise UsageError(f"cannot read spec {path}: {exc.strerror or exc}") from None
    try:
        spec = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise UsageError(f"spec {path} is not valid YAML: {exc}") from None
    if not isinstance(spec, dict):
        raise UsageError(f"spec {path} must be a mapping (model, dataset, graders, grpo, ...)")
    return spec, folder
