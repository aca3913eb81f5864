"""Where the CLI finds its server, key and commit, and the default Idempotency-Key."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from grpo_cli import ci_env


def test_api_url_flag_then_env_then_default() -> None:
    env = {"GRPO_API_URL": "http://api.example:9000/"}
    assert ci_env.api_url("http://flag:1", env) == "http://flag:1"
    assert ci_env.api_url(None, env) == "http://api.example:9000"
    assert ci_env.api_url(None, {}) == "http://127.0.0.1:8000"


def test_api_key_flag_then_env_then_the_local_key_file(tmp_path: Path) -> None:
    (tmp_path / "api-key").write_text("grpo_from_file\n")
    env = {"GRPO_DATA_DIR": str(tmp_path)}
    assert ci_env.api_key("grpo_flag", {**env, "GRPO_API_KEY": "grpo_env"}) == "grpo_flag"
    assert ci_env.api_key(None, {**env, "GRPO_API_KEY": "grpo_env"}) == "grpo_env"
    assert ci_env.api_key(None, env) == "grpo_from_file"
    with pytest.raises(ci_env.UsageError, match="no API key"):
        ci_env.api_key(None, {"GRPO_DATA_DIR": str(tmp_path / "missing")})


def _git(repo: Path, *args: str) -> str:
    out = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        cwd=repo,
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


def test_commit_from_ci_variables_then_git(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    _git(repo, "commit", "-q", "--allow-empty", "-m", "x")
    head = _git(repo, "rev-parse", "HEAD")
    assert ci_env.ci_commit({"GITHUB_SHA": "aaa", "CI_COMMIT_SHA": "bbb"}, repo) == "aaa"
    assert ci_env.ci_commit({"CI_COMMIT_SHA": "bbb"}, repo) == "bbb"
    assert ci_env.ci_commit({"GITHUB_SHA": " "}, repo) == head
    outside = tmp_path / "plain"
    outside.mkdir()
    assert ci_env.ci_commit({}, outside) is None


def test_idempotency_key_is_stable_and_changes_with_spec_or_commit() -> None:
    spec = {"model": "m", "grpo": {"steps": 2, "group_size": 2}}
    reordered = {"grpo": {"group_size": 2, "steps": 2}, "model": "m"}
    key = ci_env.idempotency_key(spec, "abc")
    assert key == ci_env.idempotency_key(reordered, "abc")
    assert key.startswith("grpo-cli-") and len(key) <= 255
    assert key != ci_env.idempotency_key(spec, "abd")
    assert key != ci_env.idempotency_key(spec, None)
    assert key != ci_env.idempotency_key({**spec, "grpo": {"steps": 3, "group_size": 2}}, "abc")


def test_load_spec(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text("model: tiny-random-llama\ngrpo:\n  steps: 2\n")
    spec, folder = ci_env.load_spec(str(path))
    assert spec == {"model": "tiny-random-llama", "grpo": {"steps": 2}}
    assert folder == tmp_path.resolve()
    for text, message in (("- a\n- b\n", "must be a mapping"), ("a: [", "not valid YAML")):
        path.write_text(text)
        with pytest.raises(ci_env.UsageError, match=message):
            ci_env.load_spec(str(path))
    with pytest.raises(ci_env.UsageError, match="cannot read spec"):
        ci_env.load_spec(str(tmp_path / "nope.yaml"))
