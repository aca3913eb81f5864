from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaForCausalLM

from jobspec import GRPOSpec
from tests.trainer.conftest import tiny_llama
from trainer.errors import NonFiniteLossError
from trainer.models.loading import enable_gradient_checkpointing
from trainer.seeding import derive_seed
from trainer.update.batch import Batch, by_length, forward_logprobs, pack_batch
from trainer.update.logprobs import completion_logprobs
from trainer.update.policy_update import NonFiniteGuard, UpdateInputs, run_updates
from trainer.update.schedule import lr_factor, make_scheduler


def test_lr_schedules() -> None:
    const = GRPOSpec(steps=10, warmup_steps=2)
    assert [lr_factor(const, k) for k in (1, 2, 3, 10)] == [0.5, 1.0, 1.0, 1.0]
    linear = GRPOSpec(steps=6, warmup_steps=2, lr_schedule="linear")
    assert [lr_factor(linear, k) for k in range(1, 7)] == pytest.approx(
        [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    )
    cosine = GRPOSpec(steps=5, lr_schedule="cosine")
    values = [lr_factor(cosine, k) for k in range(1, 6)]
    assert values[0] == 1.0 and values == sorted(values, reverse=True) and values[-1] > 0
    assert values[2] == pytest.approx(0.5 * (1 + math.cos(math.pi * 2 / 5)))


def test_scheduler_steps_once_per_training_step() -> None:
    spec = GRPOSpec(steps=4, warmup_steps=2, learning_rate=0.1, lr_schedule="linear")
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=spec.learning_rate)
    sched = make_scheduler(opt, spec)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()  # no gradients: changes nothing
        sched.step()
    assert seen == pytest.approx([0.05, 0.1, 0.1, 0.05])


def test_derive_seed_is_stable_and_distinct() -> None:
    # Pinned values: a resumed run in another process must draw the very same seeds.
    assert derive_seed(0, 1, 0) == 2085219357
    assert derive_seed(1, 49, 2) == 1022779501
    seeds = {derive_seed(s, step, r) for s in (0, 1) for step in range(50) for r in range(3)}
    assert len(seeds) == 300 and all(0 <= x < 2**31 for x in seeds)


def test_pack_batch_masks() -> None:
    batch = pack_batch(
        [[1, 2], [3]],
        [[5, 6, 7], [8]],
        [[-0.1, -0.2, -0.3], [-0.4]],
        [True, False],
        torch.tensor([0.0, 1.0]),  # the first (truncated) completion is out of the loss
        torch.device("cpu"),
    )
    assert batch.mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 0, 0], [1, 0, 0]]
    assert batch.lengths.tolist() == [3, 1]
    assert batch.engine_logprobs is not None
    assert batch.engine_logprobs[0].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    missing = pack_batch([[1]], [[5]], [None], [False], torch.ones(1), torch.device("cpu"))
    assert missing.engine_logprobs is None


def test_non_finite_guard_counts_consecutive() -> None:
    events: list[str] = []
    guard = NonFiniteGuard(lambda kind, *a, **k: events.append(kind), limit=3)
    assert not guard.check(1, float("nan"), 1.0)
    assert not guard.check(2, 1.0, float("inf"))
    assert guard.check(3, 1.0, 1.0) and guard.streak == 0  # a good update resets the streak
    assert not guard.check(4, float("nan"), 1.0)
    assert not guard.check(5, float("nan"), 1.0)
    with pytest.raises(NonFiniteLossError) as info:
        guard.check(6, float("nan"), 1.0)
    assert info.value.reason == "non_finite_loss"
    assert events == ["non_finite"] * 5 and guard.skipped == 5


# --------------------------------------------------------------------------- micro-batching


def _tiny_llama() -> LlamaForCausalLM:
    return tiny_llama(40)


def _ragged_batch() -> Batch:
    g = torch.Generator().manual_seed(3)
    prompt_lens = [4, 2, 5, 3, 1, 4]
    completion_lens = [6, 1, 3, 6, 2, 4]

    def ids(n: int) -> list[int]:
        return torch.randint(1, 40, (n,), generator=g).tolist()

    return pack_batch(
        [ids(n) for n in prompt_lens],
        [ids(n) for n in completion_lens],
        [None] * len(prompt_lens),
        [False] * len(prompt_lens),
        torch.ones(len(prompt_lens)),
        torch.device("cpu"),
    )


def test_by_length_puts_rows_of_similar_width_together() -> None:
    batch = _ragged_batch()
    assert by_length(batch, range(batch.size)) == [1, 4, 2, 5, 3, 0]
    assert by_length(batch, [3, 0, 1]) == [1, 3, 0]  # a subset keeps to its own rows


def test_forward_logprobs_places_each_row_where_it_was() -> None:
    # Micro-batches are cut in length order; every row's values must still land on its own row:
    # the same as scoring each row on its own.
    model = _tiny_llama()
    batch = _ragged_batch()
    together, entropy = forward_logprobs(
        model, batch, micro_batch_size=2, temperature=0.8, pad_id=0, with_entropy=True
    )
    alone, alone_entropy = forward_logprobs(
        model, batch, micro_batch_size=1, temperature=0.8, pad_id=0, with_entropy=True
    )
    assert entropy is not None and alone_entropy is not None
    assert together[batch.mask > 0].abs().min() > 0  # real values on every real token
    assert torch.allclose(together, alone, atol=1e-5, rtol=0)
    assert torch.allclose(entropy, alone_entropy, atol=1e-5, rtol=0)
    assert torch.equal(together[batch.mask == 0], torch.zeros(int((batch.mask == 0).sum())))


def _one_update(micro_batch_size: int, checkpointing: bool) -> list[torch.Tensor]:
    model = _tiny_llama()
    if checkpointing:
        assert enable_gradient_checkpointing(model)
    batch = _ragged_batch()
    spec = GRPOSpec(micro_batch_size=micro_batch_size, learning_rate=0.05)
    optimizer = torch.optim.SGD(model.parameters(), lr=spec.learning_rate)
    advantages = torch.tensor([1.0, -0.5, 0.25, -1.0, 0.75, -0.5])
    run_updates(
        UpdateInputs(
            model=model,
            optimizer=optimizer,
            batch=batch,
            advantages=advantages,
            step=1,
            seed=0,
            old_logprobs=None,
            ref_logprobs=None,
            pad_id=0,
            guard=NonFiniteGuard(lambda *a, **k: None),
            collect_pre_update=False,
        ),
        spec,
    )
    return [p.detach().clone() for p in model.parameters()]


def test_update_does_not_depend_on_micro_batching_or_checkpointing() -> None:
    base = [p.detach().clone() for p in _tiny_llama().parameters()]
    whole = _one_update(micro_batch_size=6, checkpointing=False)
    assert max(float((a - b).abs().max()) for a, b in zip(whole, base, strict=True)) > 1e-3
    for micro, checkpointing in [(2, False), (4, False), (2, True)]:
        other = _one_update(micro_batch_size=micro, checkpointing=checkpointing)
        for a, b in zip(whole, other, strict=True):
            assert torch.allclose(a, b, atol=1e-6, rtol=0), (micro, checkpointing)


def test_gradient_checkpointing_recomputes_layers_in_backward() -> None:
    # The memory saving is real only if far less is kept for the backward pass and the layers
    # run again in it.
    calls = {"on": 0, "off": 0}
    saved = {"on": 0, "off": 0}
    for mode in ("off", "on"):
        model = _tiny_llama().train()
        if mode == "on":
            assert enable_gradient_checkpointing(model)
        model.model.layers[0].register_forward_pre_hook(
            lambda *_, m=mode: calls.__setitem__(m, calls[m] + 1)
        )

        def pack(t: torch.Tensor, m: str = mode) -> torch.Tensor:
            saved[m] += t.numel() * t.element_size()
            return t

        ids = torch.randint(1, 40, (2, 6), generator=torch.Generator().manual_seed(0))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lp, _ = completion_logprobs(model, ids, torch.ones_like(ids), 3)
        lp.sum().backward()
    assert calls == {"off": 1, "on": 2}
    assert saved["on"] < saved["off"] / 4


def test_models_without_checkpointing_support_are_reported() -> None:
    assert not enable_gradient_checkpointing(torch.nn.Linear(2, 2))
