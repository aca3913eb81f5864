"""The fused output head (trainer.update.fused_head) against today's checkpointed plain head:
the same log-probabilities, entropies and gradients, to 1e-6 in float64."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from jobspec import LoraSpec
from tests.trainer.conftest import tiny_llama
from trainer.models.lora import apply_lora
from trainer.update import fused_head
from trainer.update.fused_head import fused_head_logprobs
from trainer.update.logprobs import completion_logprobs, fusable_head, head_chunks

TOL = 1e-6
VOCAB = 50
P, T = 6, 7  # prompt width, completion width
PROMPT_LENS = [6, 3, 1, 4]
COMPLETION_LENS = [7, 2, 5, 0]  # the last row has no completion tokens at all


def _head(bias: bool) -> nn.Linear:
    torch.manual_seed(0)
    head = nn.Linear(16, 37, bias=bias).double()
    with torch.no_grad():
        head.weight.mul_(8)  # logits far from uniform
    return head


def _plain(
    head: nn.Linear, hidden: Tensor, ids: Tensor, temperature: float, chunk: int
) -> tuple[Tensor, Tensor]:
    lp, ent = head_chunks(head, hidden, ids, temperature, True, chunk, head="plain")
    return torch.cat(lp), torch.cat(ent)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("chunk", [1, 3, 5, 64])
def test_the_fused_head_equals_the_plain_head(bias: bool, temperature: float, chunk: int) -> None:
    head = _head(bias)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(13, 16, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 37, (13,), generator=g)
    weights = torch.randn(13, generator=g, dtype=torch.float64)

    lp, ent = fused_head_logprobs(
        hidden, head.weight, head.bias, ids, temperature, chunk, with_entropy=True
    )
    ref_lp, ref_ent = _plain(head, hidden, ids, temperature, chunk)
    assert lp.dtype == torch.float64 and not ent.requires_grad
    assert ref_lp.std() > 1.0  # far from uniform: the comparison has teeth
    torch.testing.assert_close(lp, ref_lp, atol=TOL, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=TOL, rtol=0)

    params = [hidden, head.weight] + ([head.bias] if bias else [])
    ours = torch.autograd.grad((lp * weights).sum(), params)
    theirs = torch.autograd.grad((ref_lp * weights).sum(), params)
    for a, b in zip(ours, theirs, strict=True):
        assert b.abs().max() > 1e-2
        torch.testing.assert_close(a, b, atol=TOL, rtol=0)


@pytest.mark.parametrize("chunk", [2, 5])
def test_a_frozen_head_gives_the_hidden_gradient_without_recomputing(chunk: int) -> None:
    head = _head(bias=True).requires_grad_(False)
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(11, 16, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 37, (11,), generator=g)
    weights = torch.randn(11, generator=g, dtype=torch.float64)
    calls: list[int] = []
    real_logits = fused_head._logits

    def counting(*args: Any) -> Tensor:
        calls.append(1)
        return real_logits(*args)

    fused_head._logits = counting  # type: ignore[assignment]
    try:
        lp, ent = fused_head_logprobs(hidden, head.weight, head.bias, ids, 0.8, chunk, True)
        forward_calls = len(calls)
        (ours,) = torch.autograd.grad((lp * weights).sum(), hidden)
    finally:
        fused_head._logits = real_logits  # type: ignore[assignment]
    assert len(calls) == forward_calls == -(-11 // chunk)  # nothing recomputed in backward
    ref_lp, ref_ent = _plain(head, hidden, ids, 0.8, chunk)
    (theirs,) = torch.autograd.grad((ref_lp * weights).sum(), hidden)
    torch.testing.assert_close(lp, ref_lp, atol=TOL, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=TOL, rtol=0)
    torch.testing.assert_close(ours, theirs, atol=TOL, rtol=0)


def _batch() -> tuple[Tensor, Tensor]:
    """Left-padded prompts of width P, then right-padded completions of width T."""
    g = torch.Generator().manual_seed(3)
    ids = torch.zeros(len(PROMPT_LENS), P + T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, (pl, cl) in enumerate(zip(PROMPT_LENS, COMPLETION_LENS, strict=True)):
        ids[b, P - pl : P + cl] = torch.randint(1, VOCAB, (pl + cl,), generator=g)
        mask[b, P - pl : P + cl] = 1
    return ids, mask


def _logprobs_and_grads(
    model: nn.Module, head: str, temperature: float, chunk: int
) -> tuple[Tensor, Tensor, list[Tensor]]:
    ids, mask = _batch()
    lp, ent = completion_logprobs(
        model,
        ids,
        mask,
        P,
        temperature,
        chunk,
        with_entropy=True,
        head=head,  # type: ignore[arg-type]
    )
    assert ent is not None
    # What the update does: per-token weights (advantages), masked to the real tokens.
    weights = torch.randn(lp.shape, generator=torch.Generator().manual_seed(4), dtype=lp.dtype)
    loss = (lp * weights * mask[:, P:]).sum()
    params = [p for p in model.parameters() if p.requires_grad]
    return lp, ent, list(torch.autograd.grad(loss, params))


@pytest.mark.parametrize(("temperature", "chunk"), [(1.0, 4), (0.6, 7), (1.4, 100)])
@pytest.mark.parametrize("tied", [False, True])
def test_a_whole_model_has_the_same_logprobs_and_gradients(
    temperature: float, chunk: int, tied: bool
) -> None:
    model = tiny_llama(VOCAB, tie_word_embeddings=tied).double()
    assert fusable_head(model.get_output_embeddings()) is not None
    lp, ent, grads = _logprobs_and_grads(model, "fused", temperature, chunk)
    ref_lp, ref_ent, ref_grads = _logprobs_and_grads(model, "plain", temperature, chunk)
    real = _batch()[1][:, P:].bool()
    assert ref_lp[real].std() > 0.3 and torch.equal(lp[~real], torch.zeros_like(lp[~real]))
    torch.testing.assert_close(lp, ref_lp, atol=TOL, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=TOL, rtol=0)
    assert len(grads) == len(ref_grads) == len(list(model.parameters()))
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0)


def test_lora_with_a_frozen_head_has_the_same_gradients() -> None:
    model = apply_lora(tiny_llama(VOCAB).double(), LoraSpec(rank=4, alpha=8))
    with torch.no_grad():  # B random, as after some training
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1, generator=torch.Generator().manual_seed(5))
    assert fusable_head(model.get_output_embeddings()) is not None
    lp, ent, grads = _logprobs_and_grads(model, "fused", 0.9, 5)
    ref_lp, ref_ent, ref_grads = _logprobs_and_grads(model, "plain", 0.9, 5)
    torch.testing.assert_close(lp, ref_lp, atol=TOL, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=TOL, rtol=0)
    assert grads and any(g.abs().max() > 1e-3 for g in ref_grads)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0)


def test_a_lora_wrapped_head_falls_back_to_the_plain_path() -> None:
    model = apply_lora(
        tiny_llama(VOCAB), LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "lm_head"])
    )
    head = model.get_output_embeddings()
    assert not isinstance(head, nn.Linear) and hasattr(head, "weight")
    assert fusable_head(head) is None
    ids, mask = _batch()
    with torch.no_grad():
        fused, _ = completion_logprobs(model, ids, mask, P)
        plain, _ = completion_logprobs(model, ids, mask, P, head="plain")
    assert torch.equal(fused, plain)


def test_a_head_with_its_own_forward_or_hooks_is_not_fused() -> None:
    class Scaled(nn.Linear):
        def forward(self, x: Tensor) -> Tensor:
            return 2 * super().forward(x)

    assert fusable_head(Scaled(4, 5)) is None
    hooked = nn.Linear(4, 5)
    hooked.register_forward_hook(lambda *args: None)
    assert fusable_head(hooked) is None
    assert fusable_head(nn.Linear(4, 5)) is not None


def test_bfloat16_autocast_keeps_the_head_exact_float32() -> None:
    model = tiny_llama(VOCAB)
    ids, mask = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused, _ = completion_logprobs(model, ids, mask, P, chunk_size=5)
        plain, _ = completion_logprobs(model, ids, mask, P, chunk_size=5, head="plain")
    assert fused.dtype == torch.float32
    torch.testing.assert_close(fused, plain, atol=1e-6, rtol=0)
    fused.sum().backward()  # bfloat16 hidden states get their gradient back in bfloat16


def test_the_forward_matmul_runs_without_tf32_and_the_backward_as_the_process_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[str] = []

    def linear(*args: Any) -> Tensor:
        seen.append(torch.get_float32_matmul_precision())
        return F.linear(*args)

    monkeypatch.setattr(fused_head, "F", SimpleNamespace(linear=linear))
    head = nn.Linear(16, 40, bias=False)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # what allow_tf32 = True sets
    try:
        hidden = torch.randn(3, 16, requires_grad=True)
        lp, _ = fused_head_logprobs(hidden, head.weight, None, torch.arange(3), 1.0, 2)
        lp.sum().backward()
        after = torch.get_float32_matmul_precision()
    finally:
        torch.set_float32_matmul_precision(before)
    # Two chunks: the forward exact; the backward's recomputation (gradients only) in TF32.
    assert seen == ["highest", "highest", "high", "high"]
    assert after == "high"


def test_no_rows() -> None:
    head = _head(bias=False)
    hidden = torch.zeros(0, 16, dtype=torch.float64, requires_grad=True)
    lp, ent = fused_head_logprobs(hidden, head.weight, None, torch.zeros(0, dtype=torch.long))
    assert lp.shape == (0,) and ent.shape == (0,)
    lp.sum().backward()
    with pytest.raises(ValueError):
        fused_head_logprobs(hidden, head.weight, None, torch.zeros(0, dtype=torch.long), chunk=0)
