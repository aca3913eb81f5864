"""The study's true-KL measurement: exact over the vocabulary, zero against itself."""

from __future__ import annotations

import copy

import pytest
import torch

from bench.kl_study import CONFIGS, exact_kl, study_spec
from trainer.models.loading import load_policy, resolve_model


def test_exact_kl_is_zero_against_itself_and_grows_with_a_perturbation() -> None:
    torch.set_num_threads(1)
    model, tokenizer = load_policy(resolve_model("tiny-random-llama"))
    prompts = ["1+2", "3+4", "say a"]
    assert exact_kl(model, copy.deepcopy(model), tokenizer, prompts, seed=0) == pytest.approx(
        0.0, abs=1e-6
    )
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.05 * torch.randn_like(p))
    small = exact_kl(moved, model, tokenizer, prompts, seed=0)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.2 * torch.randn_like(p))
    large = exact_kl(moved, model, tokenizer, prompts, seed=0)
    assert 0 < small < large


def test_every_study_run_is_a_valid_job_with_its_kl_settings() -> None:
    for name, (estimator, placement) in CONFIGS.items():
        spec = study_spec(name, steps=20, beta=0.1, seed=0)
        assert spec.grpo.kl.estimator == estimator and spec.grpo.kl.placement == placement
        assert spec.grpo.kl.active == (estimator != "none")
        assert spec.grpo.steps == 20 and spec.model == "smollm2-135m-instruct"
