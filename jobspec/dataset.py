"""The ``dataset`` section of the job spec: inline rows, an uploaded file, a saved dataset, or a
generator (the rows themselves: :mod:`jobspec.rows`)."""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import (
    Field,
    model_validator,
)

from jobspec.base import MAX_HOLDOUT_ROWS, MAX_INLINE_ROWS, MAX_SEED, MAX_TEXT_CHARS
from jobspec.model_source import hub_repo_id_problem, revision_problem
from jobspec.rows import FIELD_NAME, MAX_MESSAGES, ChatMessage, PromptRow
from specbase import StrictModel

__all__ = ["ArithmeticGenerator", "DatasetSpec", "SavedDataset"]


_ARITHMETIC_TEMPLATES = {
    "add": "What is {a}+{b}? Answer with a number.",
    "multiply": "What is {a}*{b}? Answer with a number.",
}


class ArithmeticGenerator(StrictModel):
    """A synthetic arithmetic task, useful for smoke tests and recipes: addition ("What is
    3+4?" -> "7") or multiplication ("What is 12*345?" -> "4140")."""

    type: Literal["arithmetic"] = Field(description="Generator kind.")
    operation: Literal["add", "multiply"] = Field(
        default="add", description="The answer is a+b (add) or a*b (multiply)."
    )
    count: int = Field(default=256, ge=1, le=MAX_INLINE_ROWS, description="Rows to generate.")
    min_operand: int = Field(default=0, ge=0, le=10**6, description="Smallest operand.")
    max_operand: int = Field(default=9, ge=0, le=10**6, description="Largest operand.")
    template: str = Field(
        default=_ARITHMETIC_TEMPLATES["add"],
        min_length=1,
        max_length=500,
        description=(
            "Prompt template with {a} and {b} placeholders (default: 'What is {a}+{b}? Answer "
            "with a number.', with * for multiply)."
        ),
    )
    seed: int = Field(
        default=0,
        ge=0,
        le=MAX_SEED,
        description="Seed of the generator (independent of the run seed).",
    )

    @model_validator(mode="before")
    @classmethod
    def _operation_template(cls, data: Any) -> Any:
        # A multiply generator without a template of its own asks for products, not sums.
        if isinstance(data, dict) and "template" not in data:
            operation = data.get("operation", "add")
            if operation in _ARITHMETIC_TEMPLATES:
                return {**data, "template": _ARITHMETIC_TEMPLATES[operation]}
        return data

    @model_validator(mode="after")
    def _check(self) -> ArithmeticGenerator:
        if self.min_operand > self.max_operand:
            raise ValueError("min_operand must be <= max_operand")
        if "{a}" not in self.template or "{b}" not in self.template:
            raise ValueError("template must contain {a} and {b}")
        return self

    def rows(self) -> list[PromptRow]:
        """The ``count`` generated rows; the same settings (seed included) give the same rows."""
        rng = random.Random(self.seed)
        out = []
        for _ in range(self.count):
            a = rng.randint(self.min_operand, self.max_operand)
            b = rng.randint(self.min_operand, self.max_operand)
            # replace, not str.format: other braces in a user template must stay literal.
            prompt = self.template.replace("{a}", str(a)).replace("{b}", str(b))
            answer = a * b if self.operation == "multiply" else a + b
            out.append(PromptRow(prompt=prompt, answer=str(answer)))
        return out


_COLUMN = re.compile(r"^[A-Za-z_][A-Za-z0-9_ .\-]{0,127}$")


class SavedDataset(StrictModel):
    """A Hugging Face ``datasets`` dataset: saved with ``save_to_disk`` in a folder under one of
    the operator's dataset roots (``path``; ``GRPO_DATASET_ROOTS``, the API and the worker check
    it), or a Hub dataset repo in the workers' Hugging Face cache (``hub_id``, when the operator
    allows Hub datasets)."""

    path: str | None = Field(
        default=None,
        min_length=1,
        max_length=1000,
        description="Absolute path of the saved dataset's folder.",
    )
    hub_id: str | None = Field(
        default=None,
        max_length=200,
        description="A Hub dataset repo id (owner/name), read from the workers' cache.",
    )
    revision: str | None = Field(
        default=None, max_length=200, description="The Hub dataset's branch, tag or commit."
    )
    split: str = Field(
        default="train",
        pattern=r"^[A-Za-z0-9_.\-]{1,64}$",
        description="The split to train on (a DatasetDict's key; ignored for a single Dataset).",
    )
    columns: dict[str, str] = Field(
        default_factory=dict,
        max_length=64,
        description=(
            "Row field -> dataset column, e.g. {prompt: question, answer: solution}; columns "
            "not named keep their own names as row fields."
        ),
    )

    @model_validator(mode="after")
    def _names(self) -> SavedDataset:
        if (self.path is None) == (self.hub_id is None):
            raise ValueError("give exactly one of path (a saved folder) or hub_id (owner/name)")
        if self.hub_id is not None:
            problem = hub_repo_id_problem(self.hub_id)
            if problem:
                raise ValueError(f"hub_id: {problem}")
        if self.revision is not None:
            problem = revision_problem(self.revision) if self.hub_id else "needs a hub_id"
            if problem:
                raise ValueError(f"revision: {problem}")
        for field_name, column in self.columns.items():
            if not FIELD_NAME.match(field_name) or not _COLUMN.match(column):
                raise ValueError(
                    f"columns maps row field names to column names, got {field_name!r:.60}: "
                    f"{column!r:.60}"
                )
        return self


class DatasetSpec(StrictModel):
    """Where the prompts come from: exactly one of rows, file_id or generator."""

    rows: list[PromptRow] | None = Field(
        default=None, max_length=MAX_INLINE_ROWS, description="Inline prompt rows."
    )
    file_id: str | None = Field(
        default=None,
        max_length=64,
        description=(
            "Id of a file uploaded with POST /v1/files (JSONL, CSV or Parquet; one row each)."
        ),
    )
    generator: ArithmeticGenerator | None = Field(
        default=None, description="Generate a synthetic task instead of supplying rows."
    )
    validation_file_id: str | None = Field(
        default=None,
        max_length=64,
        description=(
            "Id of an uploaded file whose rows are the held-out evaluation set (eval/accuracy), "
            "instead of holding rows of the training data out (`holdout`)."
        ),
    )
    saved_dataset: SavedDataset | None = Field(
        default=None,
        description="A `datasets` dataset saved to disk under one of the operator's roots.",
    )
    system_prompt: str | None = Field(
        default=None,
        max_length=MAX_TEXT_CHARS,
        description="System message prepended to prompts (rows with their own system turn keep it).",
    )
    few_shot: list[ChatMessage] = Field(
        default_factory=list,
        max_length=MAX_MESSAGES,
        description=(
            "Example turns (user and assistant, ending with an assistant turn) put before every "
            "row's conversation, after the system prompt: a worked example the model reads, "
            "e.g. one tool call and its answer. They are prompt tokens, never trained."
        ),
    )
    use_chat_template: bool = Field(
        default=True, description="Format prompts with the tokenizer's chat template."
    )
    holdout: int = Field(
        default=0,
        ge=0,
        le=MAX_HOLDOUT_ROWS,
        description="Rows held out of training for evaluation (taken from the end of the dataset).",
    )
    shuffle: bool = Field(default=True, description="Shuffle prompts every epoch (seeded).")

    @model_validator(mode="after")
    def _exactly_one_source(self) -> DatasetSpec:
        sources = ("rows", "file_id", "generator", "saved_dataset")
        given = [n for n in sources if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of dataset.rows, dataset.file_id, dataset.generator or "
                f"dataset.saved_dataset (got {', '.join(given) or 'none'})"
            )
        if self.validation_file_id is not None and self.holdout:
            raise ValueError(
                "give dataset.validation_file_id or dataset.holdout, not both: the validation "
                "file is the held-out set"
            )
        if self.rows is not None and len(self.rows) == 0:
            raise ValueError("dataset.rows must not be empty")
        if any(m.role == "system" for m in self.few_shot):
            raise ValueError("dataset.few_shot has user and assistant turns (see system_prompt)")
        if self.few_shot and self.few_shot[-1].role != "assistant":
            raise ValueError("dataset.few_shot must end with an assistant turn")
        size = self.known_row_count()
        if size is not None and self.holdout >= size:
            raise ValueError(f"dataset.holdout ({self.holdout}) leaves no rows to train on")
        return self

    def known_row_count(self) -> int | None:
        """Rows the dataset holds, holdout included, or None for a ``file_id`` (only the stored
        file knows)."""
        if self.rows is not None:
            return len(self.rows)
        if self.generator is not None:
            return self.generator.count
        return None

    def all_rows(self) -> list[PromptRow]:
        """Every row, inline or generated (training rows first, holdout rows at the end).

        Raises ValueError for a ``file_id`` dataset: the caller reads the uploaded file and uses
        :meth:`with_rows` first.
        """
        if self.rows is not None:
            return list(self.rows)
        if self.generator is not None:
            return self.generator.rows()
        source = f"dataset.file_id {self.file_id!r}" if self.file_id else "dataset.saved_dataset"
        raise ValueError(
            f"{source} must be resolved into rows before training "
            "(read it and use DatasetSpec.with_rows(rows))"
        )

    def with_rows(self, rows: Sequence[PromptRow]) -> DatasetSpec:
        """The same dataset settings with ``rows`` inline instead of a ``file_id`` or generator.

        The result is validated again, so e.g. a holdout that leaves no training rows raises.
        """
        data = self.model_dump(exclude={"file_id", "rows", "generator", "saved_dataset"})
        rows_data = [r.model_dump(exclude_unset=True) for r in rows]
        return DatasetSpec.model_validate({**data, "rows": rows_data})

    def with_validation_rows(self, rows: Sequence[PromptRow]) -> DatasetSpec:
        """This (inline) dataset with the ``validation_file_id`` file's ``rows`` appended as
        the held-out set: ``holdout`` becomes their count, which is what the trainer holds out
        (the last rows), so a validation file needs nothing of the trainer."""
        if self.rows is None:
            raise ValueError("resolve the training rows first (with_rows)")
        data = self.model_dump(exclude={"validation_file_id", "rows"})
        rows_data = [r.model_dump(exclude_unset=True) for r in [*self.rows, *rows]]
        return DatasetSpec.model_validate({**data, "rows": rows_data, "holdout": len(rows)})
