"""Shared pieces of the agent tests: the packaged tokenizers. The scripted engine and the agent
jobs are in tests/agent_jobs.py (the service tests use them too)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from trainer.models.loading import resolve_model


@pytest.fixture(scope="session")
def smol() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def tiny() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(resolve_model("tiny-random-llama"))
