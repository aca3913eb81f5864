"""Granite divides its logits by ``config.logits_scaling``: the log-probabilities the trainer
computes from the output head itself (the update's fused and plain heads, the primitives'
target scoring) are the model's own forward's, on a tiny random Granite (no hub)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor
from transformers import GraniteConfig, GraniteForCausalLM, LlamaConfig, LlamaForCausalLM

from trainer.primitives.scoring import target_logprobs
from trainer.update.logprobs import completion_logprobs, logits_divisor

VOCAB = 40
SCALING = 4.0  # far from 1: ignoring it moves every log-probability by much more than TOL
TOL = 1e-10


def _tiny_granite(scaling: float = SCALING) -> GraniteForCausalLM:
    torch.manual_seed(0)
    config = GraniteConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        initializer_range=0.3,  # logits far from uniform
        logits_scaling=scaling,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.25,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    return GraniteForCausalLM(config).double().eval()


def _batch() -> tuple[Tensor, Tensor, int]:
    """Two rows: a left-padded prompt of width 4 and right-padded completions of width 3."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0  # prompt of 2
    ids[1, 6], mask[1, 6] = 0, 0  # completion of 2
    return ids, mask, 4


def _forward_logprobs(model: GraniteForCausalLM, ids: Tensor, mask: Tensor) -> Tensor:
    """[B, L - 1, V] log-softmax of the model's own forward logits (position t predicts t+1)."""
    position_ids = (mask.cumsum(dim=-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
    return torch.log_softmax(logits[:, :-1], dim=-1)


def test_logits_divisor_reads_granites_config_and_is_one_elsewhere() -> None:
    assert logits_divisor(_tiny_granite(8.0)) == 8.0
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
        )
    )
    assert logits_divisor(llama) == 1.0
    with pytest.raises(ValueError, match="logits_scaling"):
        logits_divisor(_tiny_granite(0.0))


@pytest.mark.parametrize("head", ["fused", "plain"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_completion_logprobs_are_the_forwards_with_its_logits_scaling(
    head: str, temperature: float
) -> None:
    model = _tiny_granite()
    ids, mask, prompt = _batch()
    path: Any = head
    lp, ent = completion_logprobs(
        model, ids, mask, prompt, temperature=temperature, with_entropy=True, head=path
    )
    assert ent is not None
    position_ids = (mask.cumsum(dim=-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
    logp = torch.log_softmax(logits[:, prompt - 1 : -1] / temperature, dim=-1)
    want = logp.gather(-1, ids[:, prompt:, None])[..., 0] * mask[:, prompt:]
    want_ent = -(logp.exp() * logp).sum(-1) * mask[:, prompt:]
    assert float((lp.detach() - want).abs().max()) <= TOL
    assert float((ent - want_ent).abs().max()) <= TOL
    # The scaling matters: unscaled, the head's log-probabilities are far off.
    unscaled = torch.log_softmax(logits[:, prompt - 1 : -1] * SCALING / temperature, dim=-1)
    off = unscaled.gather(-1, ids[:, prompt:, None])[..., 0] * mask[:, prompt:]
    assert float((off - want).abs().max()) > 0.1


def test_completion_logprobs_gradient_is_the_forwards() -> None:
    """The fused head's backward divides by the scaling too: the parameters' gradient of
    ``sum(lp)`` equals that of the plain forward's log-softmax."""
    model = _tiny_granite()
    ids, mask, prompt = _batch()
    lp, _ = completion_logprobs(model, ids, mask, prompt, head="fused")
    got = torch.autograd.grad(lp.sum(), list(model.parameters()))
    logp = _forward_logprobs(model, ids, mask)[:, prompt - 1 :]
    want_lp = (logp.gather(-1, ids[:, prompt:, None])[..., 0] * mask[:, prompt:]).sum()
    want = torch.autograd.grad(want_lp, list(model.parameters()))
    for g, w in zip(got, want, strict=True):
        assert float((g - w).abs().max()) <= TOL * max(1.0, float(w.abs().max()))


def test_target_logprobs_are_the_forwards_with_its_logits_scaling() -> None:
    """The primitives' scoring (any targets, temperature 1), right-padded rows."""
    model = _tiny_granite()
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(1, VOCAB, (2, 6), generator=g)
    targets = torch.randint(0, VOCAB, (2, 6), generator=g)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    tokens[1, 4:], targets[1, 4:] = 0, 0
    with torch.no_grad():
        got = target_logprobs(model, tokens, targets, mask)
        logits = model(input_ids=tokens, attention_mask=mask.long()).logits
    want = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None])[..., 0] * mask
    assert float((got - want).abs().max()) <= TOL
