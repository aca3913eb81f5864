"""``sample``: log-probabilities that ``forward_backward`` agrees with, seeded reproducibility,
stops that keep their token, snapshots, and refusals of impossible requests."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from tests.trainer.primitives.conftest import new_session, values
from trainer.primitives import Datum, PrimitiveError, ResidentModel
from trainer.primitives.sampling import truncated

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [2, 6, 20, 21, 22, 17]
EOS = 3  # the tiny tokenizer's <|end|>


def _session(tiny_path: Path, **overrides: Any) -> ResidentModel:
    return new_session(tiny_path, **overrides)


def test_sampled_logprobs_are_forward_backwards_target_logprobs(tiny_path: Path) -> None:
    """What rl_loop relies on: the sampler's logprobs, passed back as q, equal the learner's
    log-probabilities of the same tokens (ratio 1 on-policy); the prompt's likewise."""
    session = _session(tiny_path)
    result = session.sample(
        PROMPT, 3, max_tokens=12, seed=4, stop_token_ids=[], prompt_logprobs=True
    )
    data = [
        Datum(PROMPT + s.tokens[:-1], {"target_tokens": PROMPT[1:] + s.tokens})
        for s in result.sequences
    ]
    scored = session.forward_backward(data, "cross_entropy", forward_only=True)
    start = len(PROMPT) - 1
    for sequence, learner in zip(result.sequences, scored.logprobs, strict=True):
        assert len(sequence.tokens) == len(sequence.logprobs) == 12
        assert torch.allclose(
            torch.tensor(sequence.logprobs), torch.tensor(learner[start:]), rtol=0, atol=1e-5
        )
    assert result.prompt_logprobs is not None and result.prompt_logprobs[0] is None
    assert torch.allclose(
        torch.tensor(result.prompt_logprobs[1:]),
        torch.tensor(scored.logprobs[0][:start]),
        rtol=0,
        atol=1e-5,
    )
    # Without the request there are none.
    assert session.sample(PROMPT, 1, max_tokens=1, seed=4).prompt_logprobs is None


def test_at_another_temperature_the_logprobs_are_the_tempered_distributions(
    tiny_path: Path,
) -> None:
    session = _session(tiny_path, dtype=torch.float64)
    [sequence] = session.sample(
        PROMPT, 1, max_tokens=6, seed=1, temperature=0.7, stop_token_ids=[]
    ).sequences
    ids = torch.tensor([PROMPT + sequence.tokens])
    with torch.no_grad():
        logits = session.model(input_ids=ids).logits[0, len(PROMPT) - 1 : -1]
    want = torch.log_softmax(logits / 0.7, dim=-1).gather(
        -1, torch.tensor(sequence.tokens)[:, None]
    )[:, 0]
    assert torch.allclose(
        torch.tensor(sequence.logprobs, dtype=torch.float64), want, rtol=0, atol=1e-10
    )


def test_the_same_seed_gives_the_same_samples_and_another_seed_others(tiny_path: Path) -> None:
    session = _session(tiny_path)
    a = session.sample(PROMPT, 4, max_tokens=10, seed=9, stop_token_ids=[])
    b = session.sample(PROMPT, 4, max_tokens=10, seed=9, stop_token_ids=[])
    c = session.sample(PROMPT, 4, max_tokens=10, seed=10, stop_token_ids=[])
    assert a == b
    assert [s.tokens for s in a.sequences] != [s.tokens for s in c.sequences]
    # Rows of one call differ from each other (each draws its own tokens).
    assert len({tuple(s.tokens) for s in a.sequences}) > 1


def test_a_stop_token_ends_the_sample_and_is_kept(tiny_path: Path) -> None:
    session = _session(tiny_path)
    [free] = session.sample(PROMPT, 1, max_tokens=16, seed=2, stop_token_ids=[]).sequences
    assert free.stop_reason == "length" and len(free.tokens) == 16
    k = next(i for i in range(3, 16) if free.tokens[i] not in free.tokens[:i])
    [stopped] = session.sample(
        PROMPT, 1, max_tokens=16, seed=2, stop_token_ids=[free.tokens[k]]
    ).sequences
    assert stopped.stop_reason == "stop"
    assert stopped.tokens == free.tokens[: k + 1]
    assert stopped.logprobs == free.logprobs[: k + 1]


def test_a_stop_string_ends_the_sample_with_its_tokens_kept(tiny_path: Path) -> None:
    session = _session(tiny_path)
    tokenizer = AutoTokenizer.from_pretrained(str(session.tokenizer_path), local_files_only=True)
    [free] = session.sample(PROMPT, 1, max_tokens=16, seed=3, stop_token_ids=[]).sequences
    text = tokenizer.decode(free.tokens, skip_special_tokens=True)
    assert len(text) >= 6
    stop = text[4:6]
    # The first prefix of the sample whose text contains the stop string.
    end = next(
        i
        for i in range(1, 17)
        if stop in tokenizer.decode(free.tokens[:i], skip_special_tokens=True)
    )
    [stopped] = session.sample(
        PROMPT, 1, max_tokens=16, seed=3, stop_token_ids=[], stop_strings=["zzzz", stop]
    ).sequences
    assert stopped.stop_reason == "stop"
    assert stopped.tokens == free.tokens[:end]


def test_no_stop_list_means_the_models_end_tokens(tiny_path: Path) -> None:
    """Trained towards <|end|>, the model stops on it when no stop list is given, and runs on
    through it when the list is empty."""
    session = _session(tiny_path)
    assert EOS in session.default_stop_token_ids
    data = [Datum(PROMPT + [10] * 6, {"target_tokens": [EOS] * 12})]
    for _ in range(8):
        session.forward_backward(data, "cross_entropy")
        session.optim_step(learning_rate=0.05)
    stopping = session.sample(PROMPT, 4, max_tokens=8, seed=0)
    running = session.sample(PROMPT, 4, max_tokens=8, seed=0, stop_token_ids=[])
    assert any(s.stop_reason == "stop" for s in stopping.sequences)
    for stopped, ran in zip(stopping.sequences, running.sequences, strict=True):
        if stopped.stop_reason == "stop":
            assert stopped.tokens[-1] in session.default_stop_token_ids
            assert ran.tokens[: len(stopped.tokens)] == stopped.tokens
        assert ran.stop_reason == "length" and len(ran.tokens) == 8


def test_a_snapshot_samples_with_the_weights_it_copied_and_puts_the_current_back(
    tiny_path: Path,
) -> None:
    session = _session(tiny_path)
    snapshot = session.snapshot()
    before = session.sample(PROMPT, 2, max_tokens=8, seed=5, stop_token_ids=[])
    session.forward_backward([Datum(PROMPT, {"target_tokens": [*PROMPT[1:], 7]})], "cross_entropy")
    session.optim_step(learning_rate=0.05)
    trained = values(session)

    assert (
        session.sample(PROMPT, 2, max_tokens=8, seed=5, stop_token_ids=[], weights=snapshot)
        == before
    )
    assert all(
        torch.equal(a, b) for a, b in zip(values(session).values(), trained.values(), strict=True)
    )
    now = session.sample(PROMPT, 2, max_tokens=8, seed=5, stop_token_ids=[])
    assert [s.logprobs for s in now.sequences] != [s.logprobs for s in before.sequences]


def test_top_k_of_one_is_greedy(tiny_path: Path) -> None:
    session = _session(tiny_path)
    greedy = session.sample(PROMPT, 1, max_tokens=8, temperature=0.0, stop_token_ids=[])
    top1 = session.sample(PROMPT, 2, max_tokens=8, seed=1, top_k=1, stop_token_ids=[])
    assert all(s.tokens == greedy.sequences[0].tokens for s in top1.sequences)


def test_truncation_keeps_the_top_k_then_the_top_p_mass() -> None:
    logp = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    inf = -math.inf
    assert truncated(logp, -1, 1.0).tolist() == logp.tolist()
    assert truncated(logp, 2, 1.0)[0, 2:].tolist() == [inf, inf]
    assert torch.isfinite(truncated(logp, 2, 1.0)[0, :2]).all()
    # top_p: the smallest set of most likely tokens that reaches p.
    # (p away from the cumulative sums 0.5, 0.8, 0.95, where float rounding would decide.)
    assert torch.isfinite(truncated(logp, -1, 0.45)).tolist() == [[True, False, False, False]]
    assert torch.isfinite(truncated(logp, -1, 0.6)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(truncated(logp, -1, 0.9)).tolist() == [[True, True, True, False]]
    # top_k first, then top_p on what is left (renormalised: 0.5 / 0.8 of it reaches 0.6).
    assert torch.isfinite(truncated(logp, 2, 0.6)).tolist() == [[True, False, False, False]]


@pytest.mark.parametrize(
    ("prompt", "kwargs", "field"),
    [
        ([], {}, "prompt: no tokens"),
        ([1, 57], {}, r"prompt\[1\]: token id 57"),
        (PROMPT, {"max_tokens": 0}, "sampling_params.max_tokens: must be at least 1"),
        (PROMPT, {"max_tokens": 1020}, "sampling_params.max_tokens: 6 prompt tokens \\+ 1020"),
        (PROMPT, {"temperature": -0.5}, "sampling_params.temperature"),
        (PROMPT, {"top_p": 0.0}, "sampling_params.top_p"),
        (PROMPT, {"top_k": -2}, "sampling_params.top_k"),
        (PROMPT, {"stop_strings": [""]}, "sampling_params.stop"),
        (PROMPT, {"num_samples": 0}, "num_samples"),
    ],
)
def test_impossible_requests_are_refused_naming_the_field(
    tiny_path: Path, prompt: list[int], kwargs: dict[str, Any], field: str
) -> None:
    session = _session(tiny_path)
    arguments: dict[str, Any] = {"num_samples": 1, "max_tokens": 4, **kwargs}
    num_samples = arguments.pop("num_samples")
    with pytest.raises(PrimitiveError, match=field):
        session.sample(prompt, num_samples, **arguments)
