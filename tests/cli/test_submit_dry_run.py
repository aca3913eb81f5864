"""`grpo submit --dry-run` against the real API served over HTTP: it prints the job's memory
plan per device as a table, creates nothing, and exits 0 when the plan fits the workers'
device (GRPO_WORKER_DEVICE_MEMORY_GIB), 2 when it does not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.core.settings import Settings
from grpo_cli.ci_args import Exit
from grpo_cli.main import main
from tests.cli.test_submit_webhook import Served, _serve
from tests.conftest import tiny_spec

pytestmark = pytest.mark.parametrize("backend", ["postgres"], indirect=True)


@pytest.fixture
def served(settings: Settings) -> Iterator[Served]:
    yield from _serve(settings.model_copy(update={"worker_device_memory_gib": 1.0}))


def _spec(tmp_path: Path, **extra: object) -> str:
    path = tmp_path / "job.json"
    spec = {**tiny_spec(micro_batch_size=4), "model": "smollm2-135m-instruct", **extra}
    path.write_text(json.dumps(spec))
    return str(path)


def _dry_run(served: Served, spec: str, *flags: str) -> int:
    return main(
        ["submit", spec, "--api-url", served.url, "--api-key", served.key, "--dry-run", *flags]
    )


def test_dry_run_prints_the_plan_and_fails_when_it_does_not_fit(
    served: Served, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _dry_run(served, _spec(tmp_path)) == Exit.USAGE
    out = capsys.readouterr().out
    assert "memory plan per device" in out and "optimizer" in out and "does NOT fit" in out
    assert "would fit: lora.rank" in out
    assert served.get("/v1/jobs")["data"] == []  # nothing created

    assert _dry_run(served, _spec(tmp_path, lora={"rank": 8}), "--json") == Exit.OK
    answer = json.loads(capsys.readouterr().out)
    assert answer["plan"]["fits"] is True and answer["exit_code"] == 0
