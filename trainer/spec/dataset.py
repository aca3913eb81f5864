"""The ``dataset`` section of the job spec: inline rows, an uploaded file, or a generator."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Literal

from pydantic import Field, model_validator

from trainer.spec.base import MAX_INLINE_ROWS, MAX_SEED, MAX_TEXT_CHARS, StrictModel

__all__ = ["ArithmeticGenerator", "DatasetSpec", "PromptRow"]


class PromptRow(StrictModel):
    prompt: str = Field(
        min_length=1, max_length=MAX_TEXT_CHARS, description="The user prompt sent to the model."
    )
    answer: str | None = Field(
        default=None,
        max_length=MAX_TEXT_CHARS,
        description="Optional reference answer the graders compare completions against.",
    )


class ArithmeticGenerator(StrictModel):
    """A synthetic addition task, useful for smoke tests and recipes ("What is 3+4?" -> "7")."""

    type: Literal["arithmetic"] = Field(description="Generator kind.")
    count: int = Field(default=256, ge=1, le=MAX_INLINE_ROWS, description="Rows to generate.")
    min_operand: int = Field(default=0, ge=0, le=10**6, description="Smallest operand.")
    max_operand: int = Field(default=9, ge=0, le=10**6, description="Largest operand.")
    template: str = Field(
        default="What is {a}+{b}? Answer with a number.",
        min_length=1,
        max_length=500,
        description="Prompt template with {a} and {b} placeholders.",
    )
    seed: int = Field(
        default=0,
        ge=0,
        le=MAX_SEED,
        description="Seed of the generator (independent of the run seed).",
    )

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
            out.append(PromptRow(prompt=prompt, answer=str(a + b)))
        return out


class DatasetSpec(StrictModel):
    """Where the prompts come from: exactly one of rows, file_id or generator."""

    rows: list[PromptRow] | None = Field(
        default=None, max_length=MAX_INLINE_ROWS, description="Inline prompt rows."
    )
    file_id: str | None = Field(
        default=None,
        max_length=64,
        description="Id of a JSONL file uploaded with POST /v1/files (one {prompt, answer} per line).",
    )
    generator: ArithmeticGenerator | None = Field(
        default=None, description="Generate a synthetic task instead of supplying rows."
    )
    system_prompt: str | None = Field(
        default=None, max_length=MAX_TEXT_CHARS, description="System message prepended to prompts."
    )
    use_chat_template: bool = Field(
        default=True, description="Format prompts with the tokenizer's chat template."
    )
    holdout: int = Field(
        default=0,
        ge=0,
        le=10_000,
        description="Rows held out of training for evaluation (taken from the end of the dataset).",
    )
    shuffle: bool = Field(default=True, description="Shuffle prompts every epoch (seeded).")

    @model_validator(mode="after")
    def _exactly_one_source(self) -> DatasetSpec:
        given = [n for n in ("rows", "file_id", "generator") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of dataset.rows, dataset.file_id or dataset.generator "
                f"(got {', '.join(given) or 'none'})"
            )
        if self.rows is not None and len(self.rows) == 0:
            raise ValueError("dataset.rows must not be empty")
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
        raise ValueError(
            f"dataset.file_id {self.file_id!r} must be resolved into rows before training "
            "(read the file and use DatasetSpec.with_rows(rows))"
        )

    def with_rows(self, rows: Sequence[PromptRow]) -> DatasetSpec:
        """The same dataset settings with ``rows`` inline instead of a ``file_id`` or generator.

        The result is validated again, so e.g. a holdout that leaves no training rows raises.
        """
        data = self.model_dump(exclude={"file_id", "rows", "generator"})
        return DatasetSpec.model_validate({**data, "rows": [r.model_dump() for r in rows]})
