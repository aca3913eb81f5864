"""Rows from a datasets dataset saved to disk: split, column mapping, row errors by number, and
the operator's folder rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.config import DatasetSpec, SavedDataset
from trainer.errors import TrainerError
from trainer.model_paths import allowed_dataset_folder
from trainer.saved_datasets import saved_dataset_rows

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
