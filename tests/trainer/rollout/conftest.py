"""Shared fixtures for the rollout engine tests: the tiny model and a teacher-forcing reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from trainer.models import resolve_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return resolve_model("tiny-random-llama", cache_dir=tmp_path_factory.mktemp("models"))


def chat_prompts(tokenizer: PreTrainedTokenizerBase, questions: list[str]) -> list[list[int]]:
    """Token ids of single-turn chat prompts ending with the assistant header."""
    out = []
    for question in questions:
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True
        )
        out.append(list(encoded["input_ids"]))
    return out


def teacher_forced_logprobs(
    model: PreTrainedModel, prompt: list[int], completion: list[int], temperature: float
) -> torch.Tensor:
    """log_softmax(logits / T) of each completion token given everything before it, [len]."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion)[:, None])[:, 0]
