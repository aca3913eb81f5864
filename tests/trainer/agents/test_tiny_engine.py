"""Episodes on the packaged tiny-random-llama with the real transformers engine: one generate
call per turn for all live episodes, and the episodes' samples trained with their loss mask
(injected tokens: exactly zero gradient)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
from torch import Tensor

from jobspec import EpisodeSpec, GRPOSpec
from trainer.agents import (
    EnvStep,
    TurnSettings,
    chat_format,
    episode_metrics,
    episode_samples,
    run_episodes,
    start_episodes,
)
from trainer.models.loading import load_policy, resolve_model
from trainer.rollout.base import Completion
from trainer.rollout.hf_engine import HFEngine
from trainer.update import policy_update
from trainer.update.batch import pack_batch
from trainer.update.policy_update import NonFiniteGuard, UpdateInputs, run_updates


class Recording:
    """Wraps an engine; records the number of prompts of every generate call."""

    def __init__(self, engine: HFEngine) -> None:
        self.engine = engine
        self.calls: list[int] = []

    def generate(self, prompts: list[list[int]], n: int, **kwargs: Any) -> list[list[Completion]]:
        self.calls.append(len(prompts))
        return self.engine.generate(prompts, n, **kwargs)

    def sync_weights(self, model: Any) -> float:
        return 0.0

    def close(self) -> None:
        pass


class Quiz:
    """Three turns: after each answer a follow-up question, done after the third."""

    def reset(
        self, episode_ids: Sequence[str], items: Sequence[Mapping[str, Any]]
    ) -> list[EnvStep]:
        return [EnvStep() for _ in items]

    def step(
        self, episode_ids: Sequence[str], messages: Sequence[Sequence[Mapping[str, Any]]]
    ) -> list[EnvStep]:
        self.seen = getattr(self, "seen", 0) + 1
        done = self.seen >= 3
        follow = [{"role": "user", "content": "and 2+2?"}]
        return [EnvStep(messages=[] if done else follow, done=done) for _ in messages]

    def close(self) -> None:
        pass


def test_tiny_model_episodes_batch_per_turn_and_train_only_sampled_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, tokenizer = load_policy(resolve_model("tiny-random-llama"))
    end = int(tokenizer.eos_token_id)
    # Every token ends a turn, so each turn is one sampled token and ends "stop"; the episode
    # strips only the real end token from the assistant's message.
    every_token = list(range(len(tokenizer)))
    engine = Recording(
        HFEngine(model, tokenizer, dtype="float32", max_model_len=256, stop_token_ids=every_token)
    )
    fmt = chat_format(tokenizer)
    conversations = [[{"role": "user", "content": q}] for q in ("1+1?", "1+1?", "3*3?", "3*3?")]
    environment = Quiz()
    episodes = start_episodes(fmt, conversations, [{}] * 4, environment)
    turn = TurnSettings(
        max_new_tokens=8,
        temperature=1.0,
        seed=3,
        budgets=EpisodeSpec(max_turns=5, max_episode_tokens=256),
        stop_token_ids=(end,),
    )
    run_episodes(engine, fmt, episodes, turn, environment=environment)
    assert engine.calls == [4, 4, 4]  # one call per turn, every live episode in it
    assert [e.end_reason for e in episodes] == ["done"] * 4
    metrics = episode_metrics(episodes)
    assert metrics["episode/turns"] == 3.0 and metrics["episode/masked_token_frac"] > 0.5

    samples = [s for e in episodes for s in episode_samples(e)]
    comps = [c for _, c in samples]
    masks = [c.loss_mask for c in comps]
    assert all(m is not None and 0 < sum(m) < len(m) for m in masks)
    batch = pack_batch(
        [p for p, _ in samples],
        [c.token_ids for c in comps],
        [c.logprobs for c in comps],
        [False] * len(comps),
        torch.ones(len(comps)),
        torch.device("cpu"),
        token_masks=masks,
    )
    seen: list[Tensor] = []
    original = policy_update.completion_logprobs

    def keep(*args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        lp, ent = original(*args, **kwargs)
        lp.retain_grad()
        seen.append(lp)
        return lp, ent

    monkeypatch.setattr(policy_update, "completion_logprobs", keep)
    size = len(comps)
    spec = GRPOSpec(micro_batch_size=size, sampler_correction={"mode": "none"})
    model.train()
    run_updates(
        UpdateInputs(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
            batch=batch,
            advantages=torch.linspace(-1.0, 1.0, size),
            old_logprobs=None,
            ref_logprobs=None,
            pad_id=int(tokenizer.pad_token_id),
            guard=NonFiniteGuard(lambda *a, **k: None),
            step=1,
            seed=0,
        ),
        spec,
    )
    (lp,) = seen
    assert lp.grad is not None
    order = sorted(range(size), key=lambda r: (len(comps[r].token_ids), len(samples[r][0]), r))
    for row, original_row in enumerate(order):
        n = len(comps[original_row].token_ids)
        mask = torch.tensor(masks[original_row], dtype=torch.bool)
        grad = lp.grad[row, :n]
        assert torch.equal(grad[~mask], torch.zeros(int((~mask).sum())))
