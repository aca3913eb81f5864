"""`grpo download`: a checkpoint saved and extracted from a real API over HTTP (uvicorn in a
thread on the embedded SQLite database; the checkpoints are written by hand, no worker)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.core.settings import Settings
from app.main import create_app
from tests.app.progress.test_checkpoint_download import ADAPTER, FULL, write_checkpoint
from tests.app.progress.test_progress_api import running_job
from tests.cli.helpers import cli
from tests.conftest import Api, new_project_key, settings_for
from tests.live_server import serve


@pytest.fixture
def served(sqlite_dir: Path, queue_name: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Api]:
    settings: Settings = settings_for("sqlite", "", sqlite_dir, queue_name)
    key, project_id = new_project_key(settings)
    with TestClient(create_app(settings)) as client, serve(settings) as server:
        monkeypatch.setenv("GRPO_API_URL", server.url)
        monkeypatch.setenv("GRPO_API_KEY", key)
        yield Api(client, settings, key, project_id)


def test_download_saves_the_latest_checkpoint_by_default(
    served: Api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id, callbacks, _ = running_job(served)
    callbacks.on_checkpoint(1, write_checkpoint(served, job_id, 1, FULL))
    callbacks.on_checkpoint(2, write_checkpoint(served, job_id, 2, ADAPTER))
    monkeypatch.chdir(tmp_path)
    result = cli("download", job_id)
    assert result.code == 0, result.err
    saved = tmp_path / f"{job_id}-step2"
    assert {p.name: p.read_bytes() for p in saved.iterdir()} == ADAPTER
    # Only the folder is left: no temporary archive or folder beside it.
    assert os.listdir(tmp_path) == [saved.name]
    # An explicit step, as JSON; an existing --out is refused before downloading.
    out = tmp_path / "models" / "first"
    result = cli("download", job_id, "--step", "1", "--out", str(out), "--json")
    assert result.code == 0, result.err
    assert result.json()["step"] == 1 and result.json()["path"] == str(out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == FULL
    again = cli("download", job_id, "--step", "1", "--out", str(out))
    assert again.code == 2 and "exists" in again.err


def test_download_takes_the_openai_apis_checkpoint_name(
    served: Api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id, callbacks, _ = running_job(served)
    callbacks.on_checkpoint(1, write_checkpoint(served, job_id, 1, FULL))
    callbacks.on_checkpoint(2, write_checkpoint(served, job_id, 2, ADAPTER))
    listed = served.client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints", headers=served.headers)
    names = {c["step_number"]: c["fine_tuned_model_checkpoint"] for c in listed.json()["data"]}
    monkeypatch.chdir(tmp_path)
    result = cli("download", names[1], "--json")
    assert result.code == 0, result.err
    assert result.json()["job_id"] == job_id and result.json()["step"] == 1
    assert {p.name: p.read_bytes() for p in Path(result.json()["path"]).iterdir()} == FULL
    model = names[1].rsplit(":", 1)[0]  # the job's fine-tuned model name: its latest checkpoint
    latest = cli("download", model, "--out", str(tmp_path / "latest"), "--json")
    assert latest.code == 0 and latest.json()["step"] == 2, latest.err
    clash = cli("download", names[1], "--step", "2", "--out", str(tmp_path / "x"))
    assert clash.code == 2 and "contradicts" in clash.err


def test_download_errors_map_to_exit_codes(served: Api, tmp_path: Path) -> None:
    job_id, callbacks, _ = running_job(served)
    none_yet = cli("download", job_id, "--out", str(tmp_path / "a"))
    assert none_yet.code == 2 and "no checkpoints" in none_yet.err
    callbacks.on_checkpoint(1, write_checkpoint(served, job_id, 1, FULL))
    missing = cli("download", job_id, "--step", "5", "--out", str(tmp_path / "b"))
    assert missing.code == 2 and "step" in missing.err
    unknown = cli("download", "job_nope", "--out", str(tmp_path / "c"))
    assert unknown.code == 2
    assert not any(tmp_path.iterdir())


def test_download_merge_gives_the_adapter_models_logprobs(served: Api, tmp_path: Path) -> None:
    """A real tiny LoRA checkpoint (adapters and tokenizer, as a worker saves them), downloaded
    with --merge: a plain model folder with the adapter model's log-probabilities."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.trainer.test_lora import _logprobs, _tiny_lora
    from trainer.models.loading import resolve_model

    _, lora = _tiny_lora()
    job_id, callbacks, _ = running_job(served)
    folder = write_checkpoint(served, job_id, 3, {})
    lora.save_pretrained(str(folder))
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model("tiny-random-llama")))
    tokenizer.save_pretrained(str(folder))
    callbacks.on_checkpoint(3, folder)
    out = tmp_path / "merged"
    result = cli("download", job_id, "--merge", "--out", str(out))
    assert result.code == 0, result.err
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert not any(".lora_" in k for k in loaded.state_dict())
    assert torch.allclose(_logprobs(loaded), _logprobs(lora), atol=1e-4)
    assert (out / "tokenizer_config.json").is_file()
    assert os.listdir(tmp_path) == ["merged"]  # no staging folder left behind
