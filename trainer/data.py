"""Prompts for training: rows from a DatasetSpec, holdout split, formatting, tokenisation, and a
seeded sampler whose position is plain data (checkpoints save and restore it exactly).

An uploaded dataset (``file_id``) is resolved into rows by the caller (the service's worker reads
the file); ``DatasetSpec.with_rows`` builds the equivalent inline spec. Which rows a spec holds
(inline or generated) is the spec's own business (``DatasetSpec.all_rows``); this module turns
them into examples and tokens.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from trainer.config import DatasetSpec, PromptRow

__all__ = [
    "Example",
    "PromptSampler",
    "SamplerState",
    "dataset_rows",
    "encode_prompts",
    "format_prompt",
    "split_holdout",
    "with_rows",
]


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str | None


def with_rows(spec: DatasetSpec, rows: Sequence[PromptRow]) -> DatasetSpec:
    """``spec.with_rows(rows)``: kept for callers of the function form."""
    return spec.with_rows(rows)


def dataset_rows(spec: DatasetSpec) -> list[Example]:
    """All rows of the dataset as examples (training rows first, holdout rows at the end).

    Raises ValueError for a ``file_id`` spec: the caller resolves the file first
    (``DatasetSpec.with_rows``).
    """
    return [Example(r.prompt, r.answer) for r in spec.all_rows()]


def split_holdout(rows: Sequence[Example], holdout: int) -> tuple[list[Example], list[Example]]:
    """(train, eval): the last ``holdout`` rows are held out for evaluation."""
    if holdout < 0 or holdout >= len(rows):
        raise ValueError(f"holdout {holdout} must be in [0, {len(rows) - 1}] for {len(rows)} rows")
    cut = len(rows) - holdout
    return list(rows[:cut]), list(rows[cut:])


def format_prompt(
    tokenizer: PreTrainedTokenizerBase,
    prompt: str,
    *,
    system_prompt: str | None,
    use_chat_template: bool,
) -> str:
    """The text the model sees. With the chat template: system + user messages and the
    assistant generation prompt; otherwise (or if the tokenizer has no template) the raw prompt,
    preceded by the system prompt and a blank line."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        messages = []
        if system_prompt:
            messages.append({"role": "system", "content": system_prompt})
        messages.append({"role": "user", "content": prompt})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template returned {type(text).__name__}, not str")
        return text
    return f"{system_prompt}\n\n{prompt}" if system_prompt else prompt


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[Example],
    spec: DatasetSpec,
    max_prompt_tokens: int,
) -> list[list[int]]:
    """Token ids of each formatted prompt, at most ``max_prompt_tokens`` each.

    Too-long prompts keep their END: the generation prompt (and the question, usually last) must
    survive; the start (system prompt, preamble) is what goes.
    """
    chat = spec.use_chat_template and bool(getattr(tokenizer, "chat_template", None))
    out = []
    for row in rows:
        text = format_prompt(
            tokenizer,
            row.prompt,
            system_prompt=spec.system_prompt,
            use_chat_template=spec.use_chat_template,
        )
        # A chat template writes its own special tokens (BOS included) into the text.
        ids = list(tokenizer(text, add_special_tokens=not chat)["input_ids"])
        out.append(ids[-max_prompt_tokens:])
    return out


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
