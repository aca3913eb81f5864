"""Prompts for training: rows from a DatasetSpec, holdout split, formatting, tokenisation, and a
seeded sampler whose position is plain data (checkpoints save and restore it exactly).

An uploaded dataset (``file_id``) is resolved into rows by the caller (the service's worker reads
the file); ``DatasetSpec.with_rows`` builds the equivalent inline spec. Which rows a spec holds
(inline or generated) is the spec's own business (``DatasetSpec.all_rows``); this module turns
them into examples and tokens.

Prompts are never cut: a prompt cut from the left loses its system prompt and chat header, one
cut from the right loses the generation prompt. A run skips the rows whose formatted prompt is
longer than ``grpo.max_prompt_tokens`` (:func:`prompts_for_run`, which reports them by row
number) and fails when no training row is left.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from jobspec import DatasetSpec, PromptRow
from jobspec.prompt_format import conversation
from trainer.errors import TrainerError

__all__ = [
    "Example",
    "FittedPrompts",
    "PromptSampler",
    "PromptsTooLong",
    "RunPrompts",
    "SamplerState",
    "conversation",
    "dataset_rows",
    "encode_prompt",
    "encode_prompts",
    "fit_prompts",
    "format_prompt",
    "prompts_for_run",
    "split_holdout",
    "with_rows",
]

SKIPPED_ROWS_IN_MESSAGE = 10  # row numbers an event's message lists (its data holds more)
SKIPPED_ROWS_IN_DATA = 1000


@dataclass(frozen=True)
class Example:
    """One dataset row, as the run uses it: what the model is asked (``prompt``, or a
    conversation of ``messages``), the reference ``answer`` if any, and ``item``, every field of
    the row as given, which graders read."""

    prompt: str | None
    answer: str | None
    messages: tuple[dict[str, str], ...] | None = None
    item: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, row: PromptRow) -> Example:
        messages = None
        if row.messages is not None:
            messages = tuple({"role": m.role, "content": m.content} for m in row.messages)
        return cls(row.prompt, row.answer, messages, row.item)

    @property
    def display_prompt(self) -> str:
        """The prompt as a person reads it: the text, or the conversation's last user turn."""
        if self.prompt is not None:
            return self.prompt
        assert self.messages
        return self.messages[-1]["content"]

    @property
    def grading_item(self) -> Mapping[str, Any]:
        """What graders see of the row (``item``; a bare ``answer`` for hand-built rows)."""
        if self.item:
            return self.item
        return {"prompt": self.prompt, "answer": self.answer}


def with_rows(spec: DatasetSpec, rows: Sequence[PromptRow]) -> DatasetSpec:
    """``spec.with_rows(rows)``: kept for callers of the function form."""
    return spec.with_rows(rows)


def dataset_rows(spec: DatasetSpec) -> list[Example]:
    """All rows of the dataset as examples (training rows first, holdout rows at the end).

    Raises ValueError for a ``file_id`` spec: the caller resolves the file first
    (``DatasetSpec.with_rows``).
    """
    return [Example.of(r) for r in spec.all_rows()]


def split_holdout(rows: Sequence[Example], holdout: int) -> tuple[list[Example], list[Example]]:
    """(train, eval): the last ``holdout`` rows are held out for evaluation."""
    if holdout < 0 or holdout >= len(rows):
        raise ValueError(f"holdout {holdout} must be in [0, {len(rows) - 1}] for {len(rows)} rows")
    cut = len(rows) - holdout
    return list(rows[:cut]), list(rows[cut:])


def format_prompt(
    tokenizer: PreTrainedTokenizerBase,
    prompt: str | Sequence[Mapping[str, str]],
    *,
    system_prompt: str | None,
    use_chat_template: bool,
    few_shot: Sequence[Mapping[str, str]] = (),
) -> str:
    """The text the model sees for a prompt, or a conversation (``[{role, content}, ...]``
    ending with a user turn). With the chat template: the messages of :func:`conversation`
    and the assistant generation prompt; otherwise (or if the tokenizer has no template) their
    texts, each followed by a blank line."""
    messages = conversation(prompt, system_prompt=system_prompt, few_shot=few_shot)
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template returned {type(text).__name__}, not str")
        return text
    return "\n\n".join(m["content"] for m in messages)


def encode_prompt(tokenizer: PreTrainedTokenizerBase, row: Example, spec: DatasetSpec) -> list[int]:
    """Token ids of one row's formatted prompt (:func:`format_prompt`), whole."""
    chat = spec.use_chat_template and bool(getattr(tokenizer, "chat_template", None))
    prompt: str | Sequence[Mapping[str, str]] = (
        row.messages if row.messages is not None else (row.prompt or "")
    )
    text = format_prompt(
        tokenizer,
        prompt,
        system_prompt=spec.system_prompt,
        use_chat_template=spec.use_chat_template,
        few_shot=[m.model_dump() for m in spec.few_shot],
    )
    # A chat template writes its own special tokens (BOS included) into the text.
    return list(tokenizer(text, add_special_tokens=not chat)["input_ids"])


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[Example],
    spec: DatasetSpec,
    max_prompt_tokens: int,
) -> list[list[int]]:
    """Token ids of each row's formatted prompt; ValueError naming the first row (1-based)
    whose prompt is longer than ``max_prompt_tokens``. Nothing is ever cut (a run skips such
    rows instead: :func:`prompts_for_run`)."""
    fitted = fit_prompts(tokenizer, rows, spec, max_prompt_tokens)
    if fitted.too_long:
        position, length = fitted.too_long[0]
        raise ValueError(
            f"row {position + 1}: the prompt is {length} tokens, longer than "
            f"max_prompt_tokens ({max_prompt_tokens})"
        )
    return fitted.ids


@dataclass(frozen=True)
class FittedPrompts:
    """The rows whose prompt fits, as token ids, and the rows that did not fit."""

    ids: list[list[int]]  # token ids of each kept row's prompt, in row order
    kept: list[int]  # position (in the rows given) of each kept row
    too_long: list[tuple[int, int]]  # (position, prompt tokens) of each skipped row


def fit_prompts(
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[Example],
    spec: DatasetSpec,
    max_prompt_tokens: int,
    *,
    limit: int | None = None,
) -> FittedPrompts:
    """Encode the rows in order, keeping those of at most ``max_prompt_tokens`` tokens; with
    ``limit``, stop once that many are kept (later rows are not looked at)."""
    ids: list[list[int]] = []
    kept: list[int] = []
    too_long: list[tuple[int, int]] = []
    for position, row in enumerate(rows):
        if limit is not None and len(kept) >= limit:
            break
        encoded = encode_prompt(tokenizer, row, spec)
        if len(encoded) > max_prompt_tokens:
            too_long.append((position, len(encoded)))
        else:
            ids.append(encoded)
            kept.append(position)
    return FittedPrompts(ids, kept, too_long)


class PromptsTooLong(TrainerError):
    """No training row's prompt fits ``grpo.max_prompt_tokens``."""

    reason = "prompts_too_long"


@dataclass(frozen=True)
class RunPrompts:
    """A run's prompts after skipping those over the limit (:func:`prompts_for_run`)."""

    train_rows: list[Example]
    train_ids: list[list[int]]
    eval_rows: list[Example]
    eval_ids: list[list[int]]
    skipped: list[tuple[int, int]]  # (dataset row number from 1, prompt tokens), row order
    max_prompt_tokens: int

    def skipped_event(self) -> tuple[str, dict[str, object]]:
        """The message and data of the event that reports the skipped rows."""
        numbers = [number for number, _ in self.skipped]
        shown = ", ".join(map(str, numbers[:SKIPPED_ROWS_IN_MESSAGE]))
        more = len(numbers) - SKIPPED_ROWS_IN_MESSAGE
        if more > 0:
            shown += f" and {more} more"
        longest = max(length for _, length in self.skipped)
        rows = "row" if len(numbers) == 1 else "rows"
        message = (
            f"skipped {len(numbers)} dataset {rows} whose prompt is longer than "
            f"max_prompt_tokens ({self.max_prompt_tokens}; the longest has {longest} tokens): "
            f"{rows} {shown}"
        )
        data: dict[str, object] = {
            "count": len(numbers),
            "rows": numbers[:SKIPPED_ROWS_IN_DATA],
            "max_prompt_tokens": self.max_prompt_tokens,
            "longest": longest,
        }
        return message, data


def prompts_for_run(
    tokenizer: PreTrainedTokenizerBase,
    train_rows: Sequence[Example],
    eval_rows: Sequence[Example],
    spec: DatasetSpec,
    max_prompt_tokens: int,
    *,
    eval_max_rows: int,
) -> RunPrompts:
    """The training rows and the first ``eval_max_rows`` held-out rows whose formatted prompt
    fits ``max_prompt_tokens``, with their token ids; the others are skipped and listed by
    dataset row number (from 1: training rows first, then the held-out ones, as in the spec).

    Raises :class:`PromptsTooLong` (a TrainerError) when no training row fits, naming the limit
    and the longest prompt.
    """
    train = fit_prompts(tokenizer, train_rows, spec, max_prompt_tokens)
    held = fit_prompts(tokenizer, eval_rows, spec, max_prompt_tokens, limit=eval_max_rows)
    skipped = [(position + 1, length) for position, length in train.too_long]
    skipped += [(len(train_rows) + position + 1, length) for position, length in held.too_long]
    if not train.ids:
        longest = max(length for _, length in train.too_long)
        raise PromptsTooLong(
            f"no training row fits: every one of the {len(train_rows)} training prompts, "
            f"formatted for the model, is longer than grpo.max_prompt_tokens "
            f"({max_prompt_tokens} tokens; the longest has {longest}). Raise "
            "grpo.max_prompt_tokens or shorten the prompts (and the system prompt)."
        )
    return RunPrompts(
        train_rows=[train_rows[i] for i in train.kept],
        train_ids=train.ids,
        eval_rows=[eval_rows[i] for i in held.kept],
        eval_ids=held.ids,
        skipped=skipped,
        max_prompt_tokens=max_prompt_tokens,
    )


@dataclass(frozen=True)
class SamplerState:
    """Where the sampler is: epoch, index into that epoch's order, and the order's seed."""

    epoch: int
    index: int
    seed: int
    size: int
    shuffle: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplerState:
        return cls(
            epoch=int(data["epoch"]),
            index=int(data["index"]),
            seed=int(data["seed"]),
            size=int(data["size"]),
            shuffle=bool(data["shuffle"]),
        )


class PromptSampler:
    """Draws training-row indices epoch by epoch, each epoch a seeded permutation.

    The order of epoch e depends only on (seed, e), so the state (epoch, index) fully determines
    every future draw: restoring it continues exactly where a checkpoint left off.
    """

    def __init__(self, size: int, *, seed: int, shuffle: bool = True) -> None:
        if size <= 0:
            raise ValueError("the sampler needs at least one row")
        self._size = size
        self._seed = seed
        self._shuffle = shuffle
        self._epoch = 0
        self._index = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self._size))
        if self._shuffle:
            random.Random(f"{self._seed}:{epoch}").shuffle(order)
        return order

    def next(self, k: int) -> list[int]:
        """The next ``k`` row indices, crossing into new epochs as needed."""
        out: list[int] = []
        while len(out) < k:
            if self._index >= self._size:
                self._epoch += 1
                self._index = 0
                self._order = self._permutation(self._epoch)
            take = min(k - len(out), self._size - self._index)
            out.extend(self._order[self._index : self._index + take])
            self._index += take
        return out

    def state(self) -> SamplerState:
        return SamplerState(self._epoch, self._index, self._seed, self._size, self._shuffle)

    def restore(self, state: SamplerState) -> None:
        if (state.size, state.seed, state.shuffle) != (self._size, self._seed, self._shuffle):
            raise ValueError(
                f"sampler state is for {state.size} rows (seed {state.seed}, shuffle "
                f"{state.shuffle}), but this run has {self._size} rows (seed {self._seed}, "
                f"shuffle {self._shuffle}): the dataset or seed changed since the checkpoint"
            )
        if not 0 <= state.index <= self._size or state.epoch < 0:
            raise ValueError(f"invalid sampler position {state}")
        self._epoch = state.epoch
        self._index = state.index
        self._order = self._permutation(state.epoch)
