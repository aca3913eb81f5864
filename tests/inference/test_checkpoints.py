"""A checkpoint name (a job's, or a Tinker sampler save's) reaches only a folder inside the
checkpoint store."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from app.gateway.protocol import SamplerWeightsRef, WeightsRef
from app.gateway.served_kinds import ADAPTER_MARKER, MODEL_MARKER, served_name
from inference.checkpoints import (
    CheckpointMissing,
    CheckpointRefused,
    checkpoint_folder,
    weight_bytes,
)
from jobspec.checkpoint_files import tinker_save_folder

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


SAVE = {"project_id": "proj_a", "model_id": "sess_1:train:0", "name": "served", "version": 7}


def test_a_tinker_sampler_save_is_found_where_the_worker_writes_it(store: Path) -> None:
    folder = tinker_save_folder(store, "proj_a", "sess_1:train:0", "sampler_weights", "served")
    folder.mkdir(parents=True)
    (folder / ADAPTER_MARKER).write_text("{}")
    ref = SamplerWeightsRef(**SAVE)
    assert checkpoint_folder(store, ref, marker=ADAPTER_MARKER) == folder.resolve()
    assert served_name(ref) == "tinker/proj_a/sess_1:train:0/served@7"
    # An overwritten save (a new version) is another adapter to the engines.
    assert served_name(SamplerWeightsRef(**{**SAVE, "version": 8})) != served_name(ref)
    with pytest.raises(CheckpointMissing):
        checkpoint_folder(store, SamplerWeightsRef(**{**SAVE, "name": "other"}), marker="x")


@pytest.mark.parametrize(
    ("field", "value"),
    [("project_id", ".."), ("project_id", "a/b"), ("model_id", "../x:train:0"),
     ("model_id", "x:train:01"), ("name", ".."), ("name", "a/b"), ("name", ".hidden")],
)  # fmt: skip
def test_path_like_tinker_names_are_refused(store: Path, field: str, value: str) -> None:
    with pytest.raises(ValidationError):
        SamplerWeightsRef(**{**SAVE, field: value})
    # And again on this side, whatever reached it without the protocol's checks.
    with pytest.raises(CheckpointRefused):
        checkpoint_folder(
            store, SamplerWeightsRef.model_construct(**{**SAVE, field: value}), marker="x"
        )


def test_a_tinker_save_that_links_outside_the_store_is_refused(store: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / ADAPTER_MARKER).write_text("{}")
    folder = tinker_save_folder(store, "proj_a", "sess_1:train:0", "sampler_weights", "served")
    folder.parent.mkdir(parents=True)
    folder.symlink_to(outside)
    with pytest.raises(CheckpointRefused):
        checkpoint_folder(store, SamplerWeightsRef(**SAVE), marker=ADAPTER_MARKER)
