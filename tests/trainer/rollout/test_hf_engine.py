from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tests.trainer.rollout.conftest import chat_prompts, teacher_forced_logprobs
from trainer.models.loading import load_policy
from trainer.rollout.base import Completion
from trainer.rollout.hf_engine import HFEngine
from trainer.rollout.registry import make_engine

QUESTIONS = ["what is 2+3?", "hi", "count: 1, 2, 3"]


@pytest.fixture()
def policy(tiny_model_dir: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    return load_policy(tiny_model_dir)


def _engine(
    policy: tuple[PreTrainedModel, PreTrainedTokenizerBase],
    tiny_model_dir: Path,
    dtype: str = "float32",
    max_model_len: int = 256,
) -> HFEngine:
    model, tokenizer = policy
    engine = make_engine(
        "transformers",
        tiny_model_dir,
        tokenizer,
        dtype=dtype,
        max_model_len=max_model_len,
        policy_model=model,
    )
    assert isinstance(engine, HFEngine)
    return engine


def _ids(groups: list[list[Completion]]) -> list[list[list[int]]]:
    return [[c.token_ids for c in group] for group in groups]


def test_generate_shapes_and_finish_reasons(policy, tiny_model_dir: Path) -> None:
    _, tokenizer = policy
    engine = _engine(policy, tiny_model_dir)
    prompts = chat_prompts(tokenizer, QUESTIONS)
    groups = engine.generate(prompts, 4, max_new_tokens=24, temperature=1.0, seed=0)
    assert len(groups) == len(prompts)
    reasons = set()
    for group in groups:
        assert len(group) == 4
        for c in group:
            assert 1 <= len(c.token_ids) <= 24
            assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
            assert all(lp <= 0.0 for lp in c.logprobs)
            assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
            eos_positions = [i for i, t in enumerate(c.token_ids) if t == tokenizer.eos_token_id]
            if c.finish_reason == "stop":
                assert eos_positions == [len(c.token_ids) - 1]
            else:
                assert eos_positions == [] and len(c.token_ids) == 24
            reasons.add(c.finish_reason)
    # The tiny model's eos is likely enough that 12 samples of 24 tokens see both outcomes.
    assert reasons == {"stop", "length"}
    # Samples of one prompt differ from each other.
    assert len({tuple(c.token_ids) for c in groups[0]}) > 1


def test_per_call_seed_is_deterministic(policy, tiny_model_dir: Path) -> None:
    _, tokenizer = policy
    engine = _engine(policy, tiny_model_dir)
    prompts = chat_prompts(tokenizer, QUESTIONS)
    kwargs = {"max_new_tokens": 16, "temperature": 0.9}
    torch.manual_seed(123)
    expected_next_draw = torch.rand(3)
    torch.manual_seed(123)
    first = engine.generate(prompts, 3, seed=7, **kwargs)
    # The caller's global RNG stream is left where it was.
    assert torch.equal(torch.rand(3), expected_next_draw)
    other = engine.generate(prompts, 3, seed=8, **kwargs)
    again = engine.generate(prompts, 3, seed=7, **kwargs)
    assert again == first
    assert _ids(other) != _ids(first)


def test_logprobs_match_teacher_forcing(policy, tiny_model_dir: Path) -> None:
    model, tokenizer = policy
    engine = _engine(policy, tiny_model_dir)
    prompts = chat_prompts(tokenizer, QUESTIONS)
    for temperature in (0.7, 1.3):
        groups = engine.generate(prompts, 2, max_new_tokens=16, temperature=temperature, seed=1)
        for prompt, group in zip(prompts, groups, strict=True):
            for c in group:
                reference = teacher_forced_logprobs(model, prompt, c.token_ids, temperature)
                assert c.logprobs is not None
                assert torch.allclose(torch.tensor(c.logprobs), reference, atol=1e-4)


def test_greedy_follows_argmax_and_reports_t1_logprobs(policy, tiny_model_dir: Path) -> None:
    model, tokenizer = policy
    engine = _engine(policy, tiny_model_dir)
    prompts = chat_prompts(tokenizer, QUESTIONS)
    groups = engine.generate(prompts, 3, max_new_tokens=12, temperature=0.7, seed=0, greedy=True)
    for prompt, group in zip(prompts, groups, strict=True):
        assert group[0] == group[1] == group[2]
        tokens = group[0].token_ids
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        assert logits.argmax(-1).tolist() == tokens
        reference = teacher_forced_logprobs(model, prompt, tokens, 1.0)
        assert torch.allclose(torch.tensor(group[0].logprobs), reference, atol=1e-4)
    # temperature 0 means greedy as well.
    zero = engine.generate(prompts, 1, max_new_tokens=12, temperature=0.0, seed=5)
    assert _ids(zero) == [[g[0].token_ids] for g in groups]


def test_generation_stops_at_max_model_len(policy, tiny_model_dir: Path) -> None:
    _, tokenizer = policy
    engine = _engine(policy, tiny_model_dir, max_model_len=24)
    prompts = chat_prompts(tokenizer, ["what is 2+3?"])  # 16 tokens
    groups = engine.generate(prompts, 8, max_new_tokens=50, temperature=1.0, seed=0)
    assert all(len(c.token_ids) <= 24 - len(prompts[0]) for c in groups[0])
    assert any(c.finish_reason == "length" for c in groups[0])
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([[1] * 24], 1, max_new_tokens=4, temperature=1.0, seed=0)


def test_same_dtype_engine_uses_the_policy_and_keeps_train_mode(
    policy, tiny_model_dir: Path
) -> None:
    model, tokenizer = policy
    engine = _engine(policy, tiny_model_dir)
    prompts = chat_prompts(tokenizer, ["hi"])
    before = engine.generate(prompts, 1, max_new_tokens=12, temperature=1.0, seed=0, greedy=True)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(-1.0)
    assert engine.sync_weights(model) == 0.0
    model.train()
    after = engine.generate(prompts, 1, max_new_tokens=12, temperature=1.0, seed=0, greedy=True)
    assert model.training
    assert _ids(after) != _ids(before)


def test_other_dtype_engine_keeps_a_copy_that_sync_updates(policy, tiny_model_dir: Path) -> None:
    model, tokenizer = policy
    engine = _engine(policy, tiny_model_dir, dtype="bfloat16")
    prompts = chat_prompts(tokenizer, QUESTIONS)
    kwargs = {"max_new_tokens": 12, "temperature": 1.0, "seed": 0, "greedy": True}
    before = engine.generate(prompts, 1, **kwargs)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(-1.0)
    assert engine.generate(prompts, 1, **kwargs) == before  # the copy has the old weights
    assert engine.sync_weights(model) > 0.0
    assert _ids(engine.generate(prompts, 1, **kwargs)) != _ids(before)
    assert next(model.parameters()).dtype == torch.float32


def test_make_engine_requires_policy_for_transformers(policy, tiny_model_dir: Path) -> None:
    _, tokenizer = policy
    with pytest.raises(ValueError, match="policy_model"):
        make_engine("transformers", tiny_model_dir, tokenizer, dtype="float32", max_model_len=64)
