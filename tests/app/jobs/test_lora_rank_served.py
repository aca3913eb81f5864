"""The dry run warns of a LoRA rank the inference tier cannot serve (issue 44): such a job trains
and checkpoints, but no engine loads adapters past GRPO_INFERENCE_MAX_LORA_RANK, so
/v1/chat/completions refuses its model. The inference processes state the limit in their
registry rows; the warning names the field and the limit. Before, nothing said so until the
first chat request after hours of training."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator

import pytest

from app.core.db import session_scope
from app.core.models import InferenceServer
from app.gateway import servers_repository
from tests.app.jobs.conftest import Deployment

# vLLM's largest max_lora_rank: no registered process of another test can state more.
LIMIT = 512


@pytest.fixture
def inference_tier(deployment: Callable[..., Deployment]) -> Iterator[Deployment]:
    """A deployment with an inference process registered that serves LoRA ranks up to LIMIT."""
    service = deployment()
    server_id = f"inference-{secrets.token_hex(4)}"
    with session_scope(service.sessions) as session:
        servers_repository.register(
            session,
            server_id=server_id,
            control_url="http://127.0.0.1:1",
            bases=["*"],
            state={"engines": [], "max_lora_rank": LIMIT},
        )
    yield service
    with session_scope(service.sessions) as session:
        servers_repository.unregister(session, server_id=server_id)
        assert session.get(InferenceServer, server_id) is None


def test_a_lora_rank_past_the_inference_tiers_limit_is_warned(inference_tier: Deployment) -> None:
    (warning,) = inference_tier.validate(1, lora={"rank": 1024})
    assert warning.startswith(f"lora.rank 1024 is larger than the {LIMIT} the inference tier")
    assert "GRPO_INFERENCE_MAX_LORA_RANK" in warning and "/v1/chat/completions" in warning
    # A dry run only: the job may still be created (it trains; only serving it fails).
    created = inference_tier.post(1, lora={"rank": 1024})
    assert created.status_code == 201, created.text


def test_a_rank_within_the_limit_and_a_full_fine_tune_are_not(inference_tier: Deployment) -> None:
    assert inference_tier.validate(1, lora={"rank": LIMIT}) == []
    assert inference_tier.validate(1) == []
