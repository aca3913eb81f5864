"""bfloat16 mixed precision: bfloat16 matmuls, float32 master weights, optimizer state, output
head and log-probabilities; a bfloat16 KL reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer.conftest import tiny_llama
from tests.trainer.test_loop import Recorder, tiny_spec
from trainer.models.loading import load_policy, resolve_model
from trainer.models.precision import autocast, frozen_reference
from trainer.run.loop import _Run, train
from trainer.run.setup import Given as _Given
from trainer.update.kl import per_token_kl
from trainer.update.logprobs import completion_logprobs


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
    from trainer.update.logprobs import _head_chunk

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
    # What autocast leaves in float32 stays float32: embeddings, norms, rotary frequencies.
    assert ref.model.embed_tokens.weight.dtype == torch.float32
    assert ref.model.norm.weight.dtype == torch.float32
    assert ref.model.layers[0].input_layernorm.weight.dtype == torch.float32
    assert ref.model.rotary_emb.inv_freq.dtype == torch.float32
    assert not any(p.requires_grad for p in ref.parameters())
    assert next(model.parameters()).dtype == torch.float32  # the policy is untouched


@pytest.mark.parametrize("tied", [True, False])
def test_the_bfloat16_reference_equals_the_bfloat16_policy_before_any_update(tied: bool) -> None:
    """Step 0: the policy (float32 weights under bfloat16 autocast) and its bfloat16 reference
    give bit-identical log-probabilities, so every KL estimator is exactly 0. A whole-model
    bfloat16 copy was 0.026 nat a token away on SmolLM2."""
    model = tiny_llama(60, tie_word_embeddings=tied)
    ref = frozen_reference(model, "bfloat16")
    ids = _ids()
    mask = torch.ones_like(ids)
    with torch.no_grad(), autocast("bfloat16", torch.device("cpu")):
        policy_lp, _ = completion_logprobs(model, ids, mask, 5)
        ref_lp, _ = completion_logprobs(ref, ids, mask, 5)
    assert torch.equal(policy_lp, ref_lp), (policy_lp - ref_lp).abs().max()
    for estimator in ("k1", "k2", "k3"):
        assert torch.equal(per_token_kl(estimator, policy_lp, ref_lp), torch.zeros_like(ref_lp))
    # ... and the reference is still bfloat16 where it can be: its Linear layers.
    linear = [m for m in ref.modules() if isinstance(m, torch.nn.Linear)]
    assert sum(m.weight.dtype == torch.bfloat16 for m in linear) == len(linear) - 1


def test_the_float32_head_runs_without_tf32_and_restores_the_setting() -> None:
    """With TF32 on for the process (``enable_tf32`` on a GPU), the output head's matmul still
    runs at full float32 precision, and the process's setting is back afterwards."""
    from trainer.update.logprobs import _head_chunk

    seen: list[str] = []

    class Head(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(torch.get_float32_matmul_precision())
            return super().forward(x)

    head = Head(16, 40, bias=False)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # what allow_tf32 = True sets
    try:
        _head_chunk(head, torch.randn(3, 16), torch.arange(3), 1.0, False)
        after = torch.get_float32_matmul_precision()
    finally:
        torch.set_float32_matmul_precision(before)
    assert seen == ["highest"]
    assert after == "high"


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


def test_a_lora_base_stored_in_bfloat16_computes_exactly_what_autocast_computed() -> None:
    """A bfloat16 LoRA job stores its frozen base's Linear weights in bfloat16 (half the
    base's memory): under autocast the log-probabilities and the adapters' gradients are
    bit-identical to those of the float32 base; the head and embeddings stay float32."""
    from jobspec import LoraSpec
    from trainer.models.lora import apply_lora
    from trainer.models.precision import store_frozen_linears_for_autocast

    def run(cast: bool) -> tuple[torch.Tensor, list[torch.Tensor], Any]:
        torch.manual_seed(0)
        model, _ = load_policy(resolve_model("tiny-random-llama"))
        policy: Any = apply_lora(model, LoraSpec(rank=4), base_name="tiny-random-llama")
        for name, p in policy.named_parameters():  # adapters away from their zero init
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1)
        if cast:
            assert store_frozen_linears_for_autocast(policy, "bfloat16") > 0
        ids = _ids()
        with autocast("bfloat16", torch.device("cpu")):
            logprobs, _ = completion_logprobs(policy, ids, torch.ones_like(ids), 5)
        logprobs.sum().backward()
        grads = [p.grad for p in policy.parameters() if p.requires_grad]
        return logprobs.detach(), grads, policy

    exact, exact_grads, _ = run(cast=False)
    stored, stored_grads, policy = run(cast=True)
    assert torch.equal(exact, stored)
    assert all(torch.equal(a, b) for a, b in zip(exact_grads, stored_grads, strict=True))
    base = policy.base_model.model
    assert base.model.layers[0].self_attn.q_proj.base_layer.weight.dtype == torch.bfloat16
    assert base.model.layers[0].self_attn.q_proj.lora_A["default"].weight.dtype == torch.float32
    assert base.get_output_embeddings().weight.dtype == torch.float32
    assert base.model.embed_tokens.weight.dtype == torch.float32
