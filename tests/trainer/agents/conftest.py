"""Shared pieces of the agent tests: the packaged tokenizers and an engine that answers from a
script and records every generate call."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from trainer.models.loading import resolve_model
from trainer.rollout.base import Completion

SMOL_END = "<|im_end|>"


@pytest.fixture(scope="session")
def smol() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def tiny() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(resolve_model("tiny-random-llama"))


@dataclass
class ScriptedEngine:
    """A RolloutEngine whose turn is ``reply(prompt text)``, encoded by ``tokenizer`` plus the
    end token (finish "stop"), or cut at ``max_new_tokens`` (finish "length"); logprobs are
    -0.25 each. ``calls`` records the number of prompts of every generate call."""

    tokenizer: PreTrainedTokenizerBase
    reply: Callable[[str], str]
    end_token: str = SMOL_END
    calls: list[int] = field(default_factory=list)
    sampled: list[list[int]] = field(default_factory=list)

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        *,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        greedy: bool = False,
    ) -> list[list[Completion]]:
        assert n == 1
        self.calls.append(len(prompts))
        out = []
        for prompt in prompts:
            text = self.reply(self.tokenizer.decode(prompt))
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            ids.append(self.tokenizer.convert_tokens_to_ids(self.end_token))
            reason = "stop"
            if len(ids) > max_new_tokens:
                ids, reason = ids[:max_new_tokens], "length"
            self.sampled.append(ids)
            out.append([Completion(ids, [-0.25] * len(ids), text, reason)])  # type: ignore[arg-type]
        return out

    def sync_weights(self, model: object) -> float:
        return 0.0

    def close(self) -> None:
        pass
