"""Rows from a Hugging Face ``datasets`` dataset saved to disk (``dataset.saved_dataset``).

The folder has already passed the operator's rule (``jobspec.paths.allowed_dataset_folder``,
applied by the API at submission and by the worker before this reads anything). Its split is
read with ``datasets.load_from_disk``, its columns renamed by ``columns`` (row field -> column;
columns not named keep their names and reach graders as ``item`` fields), and every record
validated as a row: bad records are reported by number, as an upload's lines are. What is
decoded is charged to the same memory budget as an upload (jobspec.row_budget).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from jobspec import MAX_INLINE_ROWS, PromptRow, SavedDataset
from jobspec.row_budget import RowBudget, RowBudgetExceeded
from trainer.errors import TrainerError

__all__ = ["hub_dataset_folder", "saved_dataset_rows"]

MAX_ROW_ERRORS = 20


def hub_dataset_folder(repo_id: str, revision: str | None) -> Path:
    """The snapshot folder of the Hub dataset ``repo_id`` in this worker's Hugging Face cache
    (downloaded first when the Hub may be contacted). TrainerError ``dataset_not_cached`` when
    it is not there, naming the command that puts it there."""
    from huggingface_hub import snapshot_download

    from trainer.models.hub import hub_cache_dir, hub_offline

    rev = revision or "main"
    try:
        return Path(
            snapshot_download(
                repo_id,
                repo_type="dataset",
                revision=rev,
                cache_dir=hub_cache_dir(),
                local_files_only=hub_offline(),
            )
        )
    except Exception as exc:  # not cached, not on the Hub, unreachable: the same advice
        raise TrainerError(
            f"dataset {repo_id} (revision {rev}) is not in this worker's Hugging Face cache "
            f"({type(exc).__name__}). Pre-fetch it: `HF_HOME=<the worker's HF_HOME> hf download "
            f"{repo_id} --repo-type dataset --revision {rev}`, then run the job again.",
            reason="dataset_not_cached",
        ) from None


def saved_dataset_rows(source: SavedDataset, folder: Path) -> list[PromptRow]:
    """The rows of ``source`` (its split, its column mapping), read from ``folder`` (a
    ``save_to_disk`` folder, or a Hub dataset's snapshot). TrainerError (reason
    ``dataset_invalid``) for a missing split or column, too many rows, rows past the memory
    budget, or records that are not rows (the first ones listed by number)."""
    import datasets  # pyarrow, pandas: only when a job reads a saved dataset

    if source.hub_id is not None:  # a repo's data files (parquet, jsonl, csv), built locally
        loaded = datasets.load_dataset(str(folder))
    else:
        loaded = datasets.load_from_disk(str(folder))
    if isinstance(loaded, datasets.DatasetDict):
        if source.split not in loaded:
            splits = ", ".join(sorted(loaded)) or "none"
            raise TrainerError(
                f"dataset.saved_dataset.split {source.split!r} is not one of its splits ({splits})",
                reason="dataset_invalid",
            )
        loaded = loaded[source.split]
    if loaded.num_rows > MAX_INLINE_ROWS:
        raise TrainerError(
            f"the saved dataset has {loaded.num_rows} rows, more than {MAX_INLINE_ROWS}",
            reason="dataset_invalid",
        )
    missing = sorted(set(source.columns.values()) - set(loaded.column_names))
    if missing:
        raise TrainerError(
            f"dataset.saved_dataset.columns names columns it does not have: {', '.join(missing)} "
            f"(it has {', '.join(loaded.column_names)})",
            reason="dataset_invalid",
        )
    budget = RowBudget()
    # The table is memory-mapped: its Arrow size is known before any record is read, and a
    # dataset larger than the budget is refused without touching its pages.
    if loaded.data.nbytes > budget.limit:
        raise TrainerError(
            f"the saved dataset holds {loaded.data.nbytes} bytes of columns, more than the "
            f"{budget.limit} a dataset may decode to",
            reason="dataset_invalid",
        )
    renamed = {column: field for field, column in source.columns.items()}
    rows: list[PromptRow] = []
    errors: list[str] = []
    for number, record in enumerate(loaded, start=1):
        data: dict[str, Any] = {
            renamed.get(column, column): value
            for column, value in record.items()
            if value is not None
        }
        try:
            budget.charge_value(data, f"row {number}")
        except RowBudgetExceeded as exc:
            raise TrainerError(f"the saved dataset: {exc}", reason="dataset_invalid") from None
        try:
            rows.append(PromptRow.model_validate(data))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "row"
            errors.append(
                f"row {number}: {where}: {str(first['msg']).removeprefix('Value error, ')}"
            )
            if len(errors) >= MAX_ROW_ERRORS:
                break
    if errors:
        raise TrainerError(
            f"the saved dataset has rows that are not rows: {'; '.join(errors)}",
            reason="dataset_invalid",
        )
    if not rows:
        raise TrainerError("the saved dataset has no rows", reason="dataset_invalid")
    return rows
