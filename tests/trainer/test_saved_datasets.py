"""Rows from a datasets dataset saved to disk: split, column mapping, row errors by number, and
the operator's folder rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobspec import DatasetSpec, SavedDataset
from jobspec.paths import allowed_dataset_folder
from trainer.data.saved_datasets import saved_dataset_rows
from trainer.errors import TrainerError

datasets = pytest.importorskip("datasets")


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    folder = tmp_path / "roots" / "gsm-tiny"
    train = datasets.Dataset.from_dict(
        {"question": ["1+1?", "2+2?"], "solution": ["2", "4"], "level": [1, 2]}
    )
    test = datasets.Dataset.from_dict({"question": ["3+3?"], "solution": ["6"], "level": [1]})
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(folder))
    return folder


def test_a_split_with_its_columns_mapped_becomes_rows(saved: Path) -> None:
    source = SavedDataset(path=str(saved), columns={"prompt": "question", "answer": "solution"})
    rows = saved_dataset_rows(source, saved)
    assert [r.item for r in rows] == [
        {"prompt": "1+1?", "answer": "2", "level": 1},
        {"prompt": "2+2?", "answer": "4", "level": 2},
    ]
    test_rows = saved_dataset_rows(source.model_copy(update={"split": "test"}), saved)
    assert [r.prompt for r in test_rows] == ["3+3?"]
    # The spec then carries them inline, as an uploaded file's.
    spec = DatasetSpec(saved_dataset=source, holdout=1).with_rows(rows)
    assert spec.saved_dataset is None and spec.rows is not None and len(spec.rows) == 2


def test_wrong_splits_columns_and_rows_are_named(saved: Path) -> None:
    with pytest.raises(TrainerError, match="not one of its splits \\(test, train\\)"):
        saved_dataset_rows(SavedDataset(path=str(saved), split="dev"), saved)
    with pytest.raises(TrainerError, match="columns it does not have: nope"):
        saved_dataset_rows(SavedDataset(path=str(saved), columns={"prompt": "nope"}), saved)
    # Without a mapping no column is a prompt: every record is reported, by number.
    with pytest.raises(TrainerError, match=r"row 1: .*exactly one of prompt or messages"):
        saved_dataset_rows(SavedDataset(path=str(saved)), saved)


def test_only_folders_saved_under_the_roots_are_read(saved: Path, tmp_path: Path) -> None:
    roots = [tmp_path / "roots"]
    assert allowed_dataset_folder(str(saved), roots) == saved.resolve()
    assert allowed_dataset_folder(str(saved), []) is None  # no roots: nothing from disk
    assert allowed_dataset_folder(str(saved / ".." / "gsm-tiny"), roots) is None
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "state.json").write_text("{}")
    assert allowed_dataset_folder(str(outside), roots) is None
    link = tmp_path / "roots" / "escape"
    link.symlink_to(outside)
    assert allowed_dataset_folder(str(link), roots) is None
    plain = tmp_path / "roots" / "not-a-dataset"
    plain.mkdir()
    assert allowed_dataset_folder(str(plain), roots) is None


def _hub_cache_with_a_dataset(home: Path) -> None:
    """A real Hugging Face hub-cache layout holding the dataset repo acme/qa (a parquet file
    under data/, as the Hub stores datasets), as `hf download --repo-type dataset` leaves it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    commit = "c" * 40
    repo = home / "hub" / "datasets--acme--qa"
    data = repo / "snapshots" / commit / "data"
    data.mkdir(parents=True)
    table = pa.table({"question": ["1+1?", "2+2?"], "solution": ["2", "4"]})
    pq.write_table(table, data / "train-00000-of-00001.parquet")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_a_hub_dataset_is_read_from_the_workers_cache_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainer.data.saved_datasets import hub_dataset_folder

    home = tmp_path / "hf"
    _hub_cache_with_a_dataset(home)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    source = SavedDataset(hub_id="acme/qa", columns={"prompt": "question", "answer": "solution"})
    rows = saved_dataset_rows(source, hub_dataset_folder("acme/qa", None))
    assert [r.item for r in rows] == [
        {"prompt": "1+1?", "answer": "2"},
        {"prompt": "2+2?", "answer": "4"},
    ]
    with pytest.raises(TrainerError, match="hf download acme/other --repo-type dataset"):
        hub_dataset_folder("acme/other", None)


def test_a_saved_dataset_is_a_folder_or_a_hub_id() -> None:
    from pydantic import ValidationError

    for bad in ({}, {"path": "/x", "hub_id": "a/b"}, {"hub_id": "no-slash"}, {"path": "/x", "revision": "v1"}):  # fmt: skip
        with pytest.raises(ValidationError):
            SavedDataset.model_validate(bad)
