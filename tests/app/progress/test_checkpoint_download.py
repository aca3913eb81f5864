"""`GET /v1/jobs/{id}/checkpoints/{step}/download`: a checkpoint's model as a streamed tar."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

from tests.app.progress.test_progress_api import running_job
from tests.conftest import Api

TRAINER_FILES = {"optimizer.pt": b"o" * 700, "rng_state.pt": b"r" * 30, "manifest.json": b"{}"}
FULL = {
    "config.json": b'{"model_type": "llama"}',
    "model.safetensors": os.urandom(1024 * 1024 + 1536),  # over one chunk, not block-aligned
    "tokenizer.json": b"t" * 512,  # exactly one block: no padding
    "generation_config.json": b"{}",
}
ADAPTER = {
    "adapter_config.json": b'{"base_model_name_or_path": "tiny-random-llama", "r": 4}',
    "adapter_model.safetensors": os.urandom(3000),
    "tokenizer.json": b"{}",
    "tokenizer_config.json": b"{}",
}


def write_checkpoint(
    api: Api, job_id: str, step: int, files: dict[str, bytes], *, sharded: bool = False
) -> Path:
    folder = api.settings.resolved_checkpoint_dir / job_id / f"checkpoint-{step:06d}"
    folder.mkdir(parents=True)
    for name, data in {**files, **TRAINER_FILES}.items():
        (folder / name).write_bytes(data)
    if sharded:  # a multi-rank run's sharded optimizer state: resume state, never downloaded
        (folder / "sharded").mkdir()
        (folder / "sharded" / "__0_0.distcp").write_bytes(b"s" * 900)
    return folder


def download(api: Api, job_id: str, step: int, headers: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    url = f"/v1/jobs/{job_id}/checkpoints/{step}/download"
    return api.client.get(url, headers=headers or api.headers)


def members(body: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        found = {}
        for info in tar.getmembers():
            assert info.mode in (0o644, 0o755) and info.uid == 0 and info.gid == 0
            if info.isfile():
                handle = tar.extractfile(info)
                assert handle is not None
                found[info.name] = handle.read()
            else:
                assert info.isdir(), info.name
        return found


def test_full_and_adapter_checkpoints_round_trip_without_trainer_state(api: Api) -> None:
    job_id, callbacks, _ = running_job(api)
    for step, files in ((1, FULL), (2, ADAPTER)):
        folder = write_checkpoint(api, job_id, step, files, sharded=step == 2)
        callbacks.on_checkpoint(step, folder)
        response = download(api, job_id, step)
        assert response.status_code == 200, response.text
        assert response.headers["content-type"] == "application/x-tar"
        assert response.headers["content-disposition"] == (
            f'attachment; filename="{job_id}-step{step}.tar"'
        )
        assert int(response.headers["content-length"]) == len(response.content)
        top = f"{job_id}-step{step}"
        assert members(response.content) == {f"{top}/{n}": data for n, data in files.items()}
        # Deterministic: the same checkpoint gives the same bytes.
        assert download(api, job_id, step).content == response.content


def test_another_projects_job_and_an_unknown_step_are_404(api: Api) -> None:
    job_id, callbacks, _ = running_job(api)
    callbacks.on_checkpoint(1, write_checkpoint(api, job_id, 1, FULL))
    other_key, _ = api.new_key()
    response = download(api, job_id, 1, {"Authorization": f"Bearer {other_key}"})
    assert response.status_code == 404 and response.json()["error"]["param"] == "job_id"
    response = download(api, job_id, 7)
    assert response.status_code == 404
    assert (
        response.json()["error"]["param"] == "step" and "7" in response.json()["error"]["message"]
    )
    assert download(api, job_id, -1).status_code == 422


def test_a_deleted_checkpoint_is_410_without_a_path(api: Api) -> None:
    job_id, callbacks, _ = running_job(api)
    folder = write_checkpoint(api, job_id, 1, FULL)
    callbacks.on_checkpoint(1, folder)
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()
    response = download(api, job_id, 1)
    assert response.status_code == 410, response.text
    error = response.json()["error"]
    assert error["type"] == "gone" and error["param"] == "step"
    assert str(api.settings.data_dir) not in response.text and "checkpoint-0" not in response.text


def test_paths_outside_the_job_folder_are_refused_without_naming_them(
    api: Api, tmp_path: Path
) -> None:
    job_id, callbacks, _ = running_job(api)
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "key.txt").write_bytes(b"do not serve")
    # 1: a row pointing outside the checkpoint store.
    outside = tmp_path / "checkpoint-000001"
    outside.mkdir()
    (outside / "config.json").write_bytes(b"{}")
    callbacks.on_checkpoint(1, outside)
    # 2: a row pointing into the store, but at another job's folder.
    other_job = write_checkpoint(api, f"{job_id}-other", 2, FULL)
    callbacks.on_checkpoint(2, other_job)
    # 3: the job's own folder is a link to somewhere else.
    linked = api.settings.resolved_checkpoint_dir / job_id / "checkpoint-000003"
    linked.parent.mkdir(parents=True, exist_ok=True)
    linked.symlink_to(secret, target_is_directory=True)
    callbacks.on_checkpoint(3, linked)
    # 4: a real folder with a file linking out of it.
    escaping = write_checkpoint(api, job_id, 4, FULL)
    (escaping / "tokenizer_config.json").symlink_to(secret / "key.txt")
    callbacks.on_checkpoint(4, escaping)
    for step in (1, 2, 3, 4):
        response = download(api, job_id, step)
        assert response.status_code == 404, (step, response.text)
        assert response.json()["error"]["param"] == "step"
        for leak in (str(tmp_path), str(api.settings.data_dir), "secret", "do not serve"):
            assert leak not in response.text, (step, leak)
