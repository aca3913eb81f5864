"""A checkpoint name reaches only a folder inside the checkpoint store."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.inference.protocol import WeightsRef
from app.inference.served_kinds import ADAPTER_MARKER, MODEL_MARKER, served_name
from inference.checkpoints import (
    CheckpointMissing,
    CheckpointRefused,
    checkpoint_folder,
    weight_bytes,
)

FOLDER = "checkpoint-000001"


def _model(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / MODEL_MARKER).write_text("{}")
    (folder / "model.safetensors").write_bytes(b"x" * 100)
    return folder


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "checkpoints"
    _model(root / "job_a" / FOLDER)
    return root


def test_a_checkpoint_in_the_store_is_found(store: Path) -> None:
    ref = WeightsRef(job_id="job_a", folder=FOLDER)
    assert (
        checkpoint_folder(store, ref, marker=MODEL_MARKER) == (store / "job_a" / FOLDER).resolve()
    )
    assert served_name(ref) == "job_a/checkpoint-000001"
    assert weight_bytes(store / "job_a" / FOLDER) == 100


@pytest.mark.parametrize("job_id", ["..", "../job_a", "job_a/..", "/etc", "a b", ".hidden"])
def test_path_like_job_ids_are_refused_before_the_disk_is_read(store: Path, job_id: str) -> None:
    with pytest.raises(CheckpointRefused):
        checkpoint_folder(store, WeightsRef(job_id=job_id, folder=FOLDER), marker=MODEL_MARKER)


def test_a_job_folder_that_links_outside_the_store_is_refused(store: Path, tmp_path: Path) -> None:
    _model(tmp_path / "elsewhere" / FOLDER)
    (store / "job_evil").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CheckpointRefused):
        checkpoint_folder(store, WeightsRef(job_id="job_evil", folder=FOLDER), marker=MODEL_MARKER)


def test_a_weights_file_that_links_outside_the_store_is_refused(
    store: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "secret.safetensors"
    outside.write_bytes(b"y")
    (store / "job_a" / FOLDER / "extra.safetensors").symlink_to(outside)
    with pytest.raises(CheckpointRefused):
        checkpoint_folder(store, WeightsRef(job_id="job_a", folder=FOLDER), marker=MODEL_MARKER)


def test_a_link_inside_the_store_is_followed(store: Path) -> None:
    (store / "job_alias").symlink_to(store / "job_a")
    found = checkpoint_folder(
        store, WeightsRef(job_id="job_alias", folder=FOLDER), marker=MODEL_MARKER
    )
    assert found == (store / "job_a" / FOLDER).resolve()


def test_missing_checkpoints_and_the_wrong_kind_are_missing(store: Path) -> None:
    with pytest.raises(CheckpointMissing):
        checkpoint_folder(store, WeightsRef(job_id="job_b", folder=FOLDER), marker=MODEL_MARKER)
    with pytest.raises(CheckpointMissing):  # a full model is no adapter
        checkpoint_folder(store, WeightsRef(job_id="job_a", folder=FOLDER), marker=ADAPTER_MARKER)
