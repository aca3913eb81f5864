"""The update does what the math says: no dropout noise in the ratio, clip fractions only over
updates that can clip, weight decay on matrices only."""

from __future__ import annotations

import math

import torch
from transformers import LlamaForCausalLM

from jobspec import GRPOSpec
from jobspec.adaptation import LoraSpec
from tests.trainer.conftest import tiny_llama
from trainer.models.loading import disable_dropout
from trainer.models.lora import apply_lora
from trainer.update.batch import Batch, forward_logprobs, pack_batch
from trainer.update.optim import build_optimizer, decay_groups
from trainer.update.policy_update import NonFiniteGuard, UpdateInputs, UpdateStats, run_updates

VOCAB = 40


def _llama_with_dropout() -> LlamaForCausalLM:
    return tiny_llama(VOCAB, attention_dropout=0.5)


def _batch(rows: int = 4) -> Batch:
    g = torch.Generator().manual_seed(1)
    return pack_batch(
        [torch.randint(1, VOCAB, (3,), generator=g).tolist() for _ in range(rows)],
        [torch.randint(1, VOCAB, (5,), generator=g).tolist() for _ in range(rows)],
        [None] * rows,
        [False] * rows,
        torch.ones(rows),
        torch.device("cpu"),
    )


def _logprobs(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    with torch.no_grad():
        lp, _ = forward_logprobs(
            model, batch, micro_batch_size=8, temperature=1.0, pad_id=0, with_entropy=False
        )
    return lp


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return model(input_ids=ids).logits  # type: ignore[no-any-return]


def test_train_mode_scores_like_eval_mode_once_dropout_is_off() -> None:
    model = _llama_with_dropout()
    model.eval()
    scored = _logits(model)  # how pi_old and the reference are scored
    model.train()  # how the update runs (gradient checkpointing needs train mode)
    assert not torch.allclose(_logits(model), scored)  # dropout acts: the ratio is not 1
    assert disable_dropout(model) > 0
    assert torch.equal(_logits(model), scored)  # the first ratio is exactly 1
    assert disable_dropout(model) == 0  # nothing left to turn off


def test_the_adapters_own_dropout_is_left_as_the_job_asked() -> None:
    model = apply_lora(tiny_llama(VOCAB), LoraSpec(rank=2, dropout=0.25))
    disable_dropout(model)
    adapter_dropouts = [
        m.p
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Dropout) and "lora_dropout" in name.split(".")
    ]
    assert adapter_dropouts and set(adapter_dropouts) == {0.25}


def _update(spec: GRPOSpec) -> UpdateStats:
    model, batch = tiny_llama(VOCAB), _batch()
    old = _logprobs(model, batch)
    stats, _ = run_updates(
        UpdateInputs(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=spec.learning_rate),
            batch=batch,
            advantages=torch.tensor([1.0, -1.0, 2.0, -2.0]),
            step=1,
            seed=0,
            old_logprobs=old,
            ref_logprobs=None,
            pad_id=0,
            guard=NonFiniteGuard(lambda *a, **k: None),
            collect_pre_update=False,
        ),
        spec,
    )
    return stats


def test_clip_fractions_leave_out_the_update_that_cannot_clip() -> None:
    single = _update(GRPOSpec(learning_rate=0.5, micro_batch_size=8))
    assert single.updates == 1
    assert all(math.isnan(v) for v in (single.clip_low, single.clip_high, single.clamped))
    # A large step: the second pass over the batch sees ratios far from 1 and clips. Had the
    # first pass (ratio 1: nothing clipped) been averaged in, the fraction would be halved.
    two = _update(GRPOSpec(learning_rate=0.5, micro_batch_size=8, num_iterations=2))
    assert two.updates == 2
    assert 0 < two.clip_low + two.clip_high <= 1
    assert two.clip_dual == 0.0  # off


def test_only_matrices_decay() -> None:
    model = tiny_llama(VOCAB)
    params = list(model.parameters())
    groups = decay_groups(params, 0.1)
    decayed, plain = groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decayed["params"])
    norms = [m.weight for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert norms and all(any(n is p for p in plain["params"]) for n in norms)
    assert len(decayed["params"]) + len(plain["params"]) == len(params)
    # No decay: one group, as before the groups existed (older checkpoints load into it).
    optimizer = build_optimizer(model, GRPOSpec(weight_decay=0.0))
    assert len(optimizer.param_groups) == 1
    assert len(build_optimizer(model, GRPOSpec(weight_decay=0.01)).param_groups) == 2
