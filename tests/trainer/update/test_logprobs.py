"""Selective / chunked log-probabilities against a naive full log-softmax reference."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

from jobspec.memory_terms import head_chunk_rows_for
from tests.trainer.conftest import tiny_llama
from trainer.update.logprobs import (
    completion_logprobs,
    entropy_from_logits,
    selective_logprobs,
)

VOCAB = 50
P, T = 5, 4  # prompt width, completion width
PROMPT_LENS = [5, 3, 1]
COMPLETION_LENS = [4, 2, 3]


def _tiny_llama() -> LlamaForCausalLM:
    return tiny_llama(VOCAB)


def _batch() -> tuple[Tensor, Tensor]:
    """Left-padded prompts of width P followed by right-padded completions of width T."""
    g = torch.Generator().manual_seed(1)
    ids = torch.zeros(len(PROMPT_LENS), P + T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, (pl, cl) in enumerate(zip(PROMPT_LENS, COMPLETION_LENS, strict=True)):
        ids[b, P - pl : P] = torch.randint(1, VOCAB, (pl,), generator=g)
        ids[b, P : P + cl] = torch.randint(1, VOCAB, (cl,), generator=g)
        mask[b, P - pl : P + cl] = 1
    return ids, mask


def _naive(
    model: LlamaForCausalLM, ids: Tensor, mask: Tensor, temperature: float
) -> tuple[Tensor, Tensor]:
    """Full [B, L, V] logits and log_softmax, gathered at the completion tokens."""
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
    logp = torch.log_softmax(logits[:, P - 1 : P + T - 1] / temperature, dim=-1)
    lp = logp.gather(-1, ids[:, P:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return lp, entropy


def _grads(model: LlamaForCausalLM, loss: Tensor) -> list[Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    return list(torch.autograd.grad(loss, params))


@pytest.mark.parametrize(
    ("temperature", "chunk_size"), [(1.0, 1024), (0.7, 3), (1.3, 1), (1.0, None)]
)
def test_completion_logprobs_match_naive_reference_with_gradients(
    temperature: float, chunk_size: int | None
) -> None:
    model = _tiny_llama()
    ids, mask = _batch()
    comp_mask = mask[:, P:].bool()
    weights = torch.randn(ids.shape[0], T, generator=torch.Generator().manual_seed(2))

    lp, entropy = completion_logprobs(
        model, ids, mask, P, temperature=temperature, chunk_size=chunk_size, with_entropy=True
    )
    ref_lp, ref_entropy = _naive(model, ids, mask, temperature)

    assert lp.shape == (3, T) and lp.dtype == torch.float32
    assert ref_lp[comp_mask].std() > 0.3  # far from uniform: the comparison has teeth
    assert torch.allclose(lp[comp_mask], ref_lp[comp_mask], atol=1e-5, rtol=0)
    assert torch.equal(lp[~comp_mask], torch.zeros_like(lp[~comp_mask]))
    assert entropy is not None and not entropy.requires_grad
    assert torch.allclose(entropy[comp_mask], ref_entropy[comp_mask].detach(), atol=1e-5, rtol=0)

    ours = _grads(model, (lp * weights).sum())
    theirs = _grads(model, (ref_lp * weights * comp_mask).sum())
    assert any(g.abs().max() > 1e-3 for g in theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_completion_logprobs_under_no_grad() -> None:
    model = _tiny_llama()
    ids, mask = _batch()
    comp_mask = mask[:, P:].bool()
    with torch.no_grad():
        lp, entropy = completion_logprobs(model, ids, mask, P, chunk_size=2)
        ref_lp, _ = _naive(model, ids, mask, 1.0)
    assert entropy is None and not lp.requires_grad
    assert torch.allclose(lp[comp_mask], ref_lp[comp_mask], atol=1e-5, rtol=0)


def _tiny_gpt2() -> GPT2LMHeadModel:
    # Learned absolute position embeddings: unlike RoPE (which only sees relative positions,
    # so a constant shift from left padding is invisible), wrong position ids change the output.
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=2, n_positions=64, initializer_range=0.3
    )
    model = GPT2LMHeadModel(config).float()
    model.eval()
    return model


@pytest.mark.parametrize("make_model", [_tiny_llama, _tiny_gpt2])
def test_left_padding_does_not_change_logprobs(make_model: Callable[[], nn.Module]) -> None:
    # Row 1 of the batch (prompt of 3 after 2 pads, completion of 2 then 2 pads) must score the
    # same as that sequence alone, unpadded: positions and masking are right.
    model = make_model()
    ids, mask = _batch()
    with torch.no_grad():
        batched, _ = completion_logprobs(model, ids, mask, P)
        alone_ids = ids[1:2, P - 3 : P + 2]
        alone, _ = completion_logprobs(model, alone_ids, torch.ones_like(alone_ids), 3)
    assert torch.allclose(batched[1, :2], alone[0], atol=1e-5, rtol=0)


def test_completion_logprobs_rejects_bad_prompt_len() -> None:
    model = _tiny_llama()
    ids, mask = _batch()
    for bad in (0, P + T + 1):
        with pytest.raises(ValueError):
            completion_logprobs(model, ids, mask, bad)


@pytest.mark.parametrize("chunk_size", [1, 4, 1024])
def test_selective_logprobs_and_entropy_match_full_log_softmax(chunk_size: int) -> None:
    g = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(2, 5, 11, generator=g, dtype=torch.float64)).requires_grad_(True)
    ids = torch.randint(0, 11, (2, 5), generator=g)
    for temperature in (1.0, 0.6):
        logp = torch.log_softmax(logits / temperature, dim=-1)
        ref = logp.gather(-1, ids[..., None]).squeeze(-1)
        ref_entropy = -(logp.exp() * logp).sum(-1)
        got = selective_logprobs(logits, ids, temperature, chunk_size=chunk_size)
        got_entropy = entropy_from_logits(logits, temperature, chunk_size=chunk_size)
        assert torch.allclose(got, ref, atol=1e-12)
        assert torch.allclose(got_entropy, ref_entropy, atol=1e-12)
        (g_ours,) = torch.autograd.grad(got.sum(), logits)
        (g_ref,) = torch.autograd.grad(ref.sum(), logits)
        assert torch.allclose(g_ours, g_ref, atol=1e-12)


def test_half_precision_logits_are_upcast() -> None:
    logits = torch.randn(2, 3, 7).to(torch.bfloat16)
    ids = torch.randint(0, 7, (2, 3))
    got = selective_logprobs(logits, ids)
    ref = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[..., None]).squeeze(-1)
    assert got.dtype == torch.float32
    assert torch.allclose(got, ref, atol=1e-6)


def test_entropy_with_minus_inf_logits_is_finite() -> None:
    # A masked vocabulary entry (logit -inf) has p = 0 and contributes 0, not 0 * -inf = nan.
    logits = torch.tensor([[[0.0, 0.0, float("-inf")]]])
    got = entropy_from_logits(logits)
    assert torch.allclose(got, torch.tensor([[torch.log(torch.tensor(2.0)).item()]]))


@pytest.mark.parametrize("head", ["fused", "plain"])
def test_full_vocabulary_logits_are_not_kept_for_backward(head: str) -> None:
    # Every tensor autograd saves (outside the plain path's checkpointed output-head chunks) is
    # recorded; none may have the vocabulary as its last dimension (the [rows, V] logits are
    # recomputed in the backward pass instead of stored). The fused head saves its weight
    # [V, H] only, whose last dimension is the hidden size.
    model = _tiny_llama()
    ids, mask = _batch()
    saved: list[tuple[int, ...]] = []

    def pack(t: Tensor) -> Tensor:
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, _ = completion_logprobs(model, ids, mask, P, chunk_size=2, head=head)  # type: ignore[arg-type]
    assert saved  # the decoder's activations were seen
    assert all(shape[-1] != VOCAB for shape in saved if shape), saved
    lp.sum().backward()  # and the recomputation works


def test_head_chunks_hold_about_16m_logits() -> None:
    # SmolLM2's vocabulary: 341 rows of 49,152 float32 logits = 64 MiB per chunk.
    assert head_chunk_rows_for(49_152, free_bytes=None) == 341
    assert head_chunk_rows_for(49_152, free_bytes=None) * 49_152 * 4 <= 64 << 20
    assert (
        head_chunk_rows_for(10_000_000, free_bytes=None) == 16
    )  # never fewer rows than that, whatever the vocab


def test_a_sharded_model_keeps_only_the_last_hidden_state(tmp_path: Path) -> None:
    """Under FSDP2 the root's whole forward runs (issue 34 item 7): it returns no per-layer
    hidden states (output_hidden_states kept all L + 1 of them alive for one), and the
    log-probabilities and gradients are those of the unsharded model."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.distributed.sharding import full_value, shard_model

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model, ref = _tiny_llama(), _tiny_llama()
        ids, mask = _batch()
        shard_model(model, init_device_mesh("cpu", (1,)))
        calls: list[tuple[dict[str, Any], Any]] = []
        model.register_forward_hook(
            lambda _m, _a, kwargs, out: calls.append((kwargs, out)), with_kwargs=True
        )
        lp, _ = completion_logprobs(model, ids, mask, P, chunk_size=3)
        ref_lp, _ = completion_logprobs(ref, ids, mask, P, chunk_size=3)
        assert len(calls) == 1
        kwargs, out = calls[0]
        assert not kwargs.get("output_hidden_states") and out.hidden_states is None
        assert out.logits.shape[1] == 1  # the head at one position only
        assert torch.equal(lp, ref_lp)
        lp.sum().backward()
        ref_lp.sum().backward()
        for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None, name
            assert torch.allclose(full_value(a.grad), b.grad, atol=1e-6, rtol=0), name
    finally:
        dist.destroy_process_group()
