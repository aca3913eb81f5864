"""bfloat16 mixed precision: bfloat16 matmuls, float32 master weights, optimizer state, output
head and log-probabilities; a bfloat16 KL reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.trainer.test_loop import Recorder, tiny_spec
from trainer.logprobs import completion_logprobs
from trainer.loop import _Given, _Run, train
from trainer.models import load_policy, resolve_model
from trainer.precision import autocast, frozen_reference


def _ids() -> torch.Tensor:
    return torch.randint(7, 50, (3, 14), generator=torch.Generator().manual_seed(2))


def test_log_probabilities_stay_float32_under_bfloat16_autocast() -> None:
    model, _ = load_policy(resolve_model("tiny-random-llama"))
    model.eval()
    ids = _ids()
    exact, _ = completion_logprobs(model, ids, torch.ones_like(ids), 5)
    with autocast("bfloat16", torch.device("cpu")):
        mixed, _ = completion_logprobs(model, ids, torch.ones_like(ids), 5)
    assert mixed.dtype == torch.float32
    # The decoder's bfloat16 matmuls move the values a little, no more.
    assert 0 < (mixed - exact).abs().max() < 0.05


def test_the_head_runs_outside_autocast() -> None:
    """The same hidden states give the same head log-probs with and without autocast: a
    bfloat16 head would round the logits (errors up to ~0.06 at logit 20)."""
    from trainer.logprobs import _head_chunk

    head = torch.nn.Linear(64, 500, bias=False)
    with torch.no_grad():
        head.weight.mul_(40)  # large logits, where bfloat16 rounding is coarse
    hidden = torch.randn(6, 64, generator=torch.Generator().manual_seed(3))
    ids = torch.arange(6)
    plain, _ = _head_chunk(head, hidden, ids, 1.0, False)
    with autocast("bfloat16", torch.device("cpu")):
        mixed, _ = _head_chunk(head, hidden, ids, 1.0, False)
    assert torch.equal(plain, mixed)


def test_the_bfloat16_reference_keeps_a_float32_head() -> None:
    model, _ = load_policy(resolve_model("tiny-random-llama"))
    ref: Any = frozen_reference(model, "bfloat16")
    assert ref.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert ref.get_output_embeddings().weight.dtype == torch.float32
    assert not any(p.requires_grad for p in ref.parameters())
    assert next(model.parameters()).dtype == torch.float32  # the policy is untouched


def test_a_bfloat16_job_learns_with_float32_master_weights(tmp_path: Path) -> None:
    spec = tiny_spec(grpo={"dtype": "bfloat16", "kl": {"estimator": "k3", "beta": 0.05}})
    run = _Run(spec, Recorder(), tmp_path / "probe", torch.device("cpu"), _Given())
    try:
        assert all(p.dtype == torch.float32 for p in run.model.parameters())
        assert run.reference is not None
        ref: Any = run.reference.model
        assert ref.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    finally:
        run.close()

    rec = Recorder()
    train(spec, rec, output_dir=tmp_path / "run")
    rewards = rec.rewards()
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.25, rewards
    # The engine generates with the float32 policy; the trainer scores it in bfloat16: close.
    assert all(m["logprob_diff/engine_vs_trainer"] < 0.05 for m in rec.metrics.values())
