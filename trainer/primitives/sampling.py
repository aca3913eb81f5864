"""``sample``: completions of one prompt, decoded token by token with a KV cache.

The log-probability reported with each sampled token is ``log softmax(logits / T)`` at that
token: the distribution the token was drawn from, before top-k / top-p truncation (the
transformers rollout engine reports the same). At T = 1 it is exactly what ``forward_backward``
returns for the same token (a test holds them equal), so a loop can pass it back as the
sampler's ``logprobs`` (q) and get ratio 1 on-policy. At T != 1 it is the tempered
distribution's, which is what an importance ratio against the sampler needs. Greedy decoding
(T = 0) reports the model's own log-probability (T = 1).

Stopping: a row ends at the first stop token, or when its decoded text (special tokens
skipped, as vLLM matches stop strings) first contains a stop string; the token that ended it is
kept (``stop_reason`` "stop"). A row that reaches ``max_tokens`` ends with "length".

Randomness comes from a ``torch.Generator`` of the call's own: a seed gives the same samples
every time, and no call moves the global random stream. Rows of one call share it; a row that
stopped keeps drawing (and discarding) with the others, so a row's samples never depend on
when another row stopped.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from trainer.primitives.scoring import target_logprobs
from trainer.primitives.types import PrimitiveError, SampledSequence
from trainer.update.fused_head import scaled

__all__ = ["SamplingSettings", "check_sampling", "generate", "prompt_logprobs", "truncated"]


@dataclass(frozen=True)
class SamplingSettings:
    """One ``sample`` call's settings (the SDK's ``SamplingParams``, stop split by kind).
    ``top_k`` -1 (or 0): no limit; ``top_p`` 1: no limit."""

    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    stop_token_ids: Collection[int] = ()
    stop_strings: Sequence[str] = ()


def check_sampling(
    prompt: Sequence[int],
    num_samples: int,
    settings: SamplingSettings,
    *,
    vocab_size: int,
    max_context: int,
) -> None:
    """PrimitiveError naming the first argument a ``sample`` call cannot run with."""
    if not prompt:
        raise PrimitiveError("prompt: no tokens")
    for j, token in enumerate(prompt):
        if isinstance(token, bool) or not isinstance(token, int):
            raise PrimitiveError(f"prompt[{j}]: expected an integer token id")
        if not 0 <= token < vocab_size:
            raise PrimitiveError(
                f"prompt[{j}]: token id {token} is outside the vocabulary (0 to {vocab_size - 1})"
            )
    if num_samples < 1:
        raise PrimitiveError(f"num_samples: must be at least 1, got {num_samples}")
    if settings.max_tokens < 1:
        raise PrimitiveError(
            f"sampling_params.max_tokens: must be at least 1, got {settings.max_tokens}"
        )
    if len(prompt) + settings.max_tokens > max_context:
        raise PrimitiveError(
            f"sampling_params.max_tokens: {len(prompt)} prompt tokens + {settings.max_tokens} "
            f"exceed the model's context of {max_context}"
        )
    if not math.isfinite(settings.temperature) or settings.temperature < 0:
        raise PrimitiveError(
            f"sampling_params.temperature: must be a finite number >= 0, got {settings.temperature}"
        )
    if settings.top_k < -1:
        raise PrimitiveError(
            f"sampling_params.top_k: -1 (no limit) or positive, got {settings.top_k}"
        )
    if not 0 < settings.top_p <= 1:
        raise PrimitiveError(f"sampling_params.top_p: must be in (0, 1], got {settings.top_p}")
    if any(not s for s in settings.stop_strings):
        raise PrimitiveError("sampling_params.stop: an empty stop string would stop at once")


def truncated(logprobs: Tensor, top_k: int, top_p: float) -> Tensor:
    """[S, V] log-probabilities with every token outside the top ``top_k`` (when > 0) and
    then outside the smallest set whose probability reaches ``top_p`` (when < 1) set to
    ``-inf``; the rest unchanged (sampling renormalises). Ties at the k-th value are kept."""
    out = logprobs
    if 0 < top_k < logprobs.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[:, -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1:
        probs = torch.softmax(out, dim=-1)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # A token goes when the tokens more probable than it already reach top_p.
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop = torch.zeros_like(out, dtype=torch.bool).scatter(-1, order, before >= top_p)
        out = out.masked_fill(drop, float("-inf"))
    return out


def _draw(
    logits: Tensor, settings: SamplingSettings, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """[S, V] next-token logits -> (token ids [S], their reported log-probabilities [S])."""
    if settings.temperature == 0:
        logp = torch.log_softmax(scaled(logits, 1.0), dim=-1)
        ids = logp.argmax(dim=-1)
    else:
        logp = torch.log_softmax(scaled(logits, settings.temperature), dim=-1)
        probs = torch.softmax(truncated(logp, settings.top_k, settings.top_p), dim=-1)
        ids = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return ids, logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)


class _Row:
    """One sample as it grows, and whether (and why) it ended."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.reason: str | None = None

    def add(
        self,
        token: int,
        logprob: float,
        settings: SamplingSettings,
        tokenizer: PreTrainedTokenizerBase,
    ) -> None:
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if token in settings.stop_token_ids:
            self.reason = "stop"
        elif settings.stop_strings:
            text = tokenizer.decode(self.tokens, skip_special_tokens=True)
            if any(s in text for s in settings.stop_strings):
                self.reason = "stop"
        if self.reason is None and len(self.tokens) == settings.max_tokens:
            self.reason = "length"

    def sequence(self) -> SampledSequence:
        return SampledSequence(
            self.tokens, self.logprobs, "stop" if self.reason == "stop" else "length"
        )


def generate(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompt: Sequence[int],
    num_samples: int,
    settings: SamplingSettings,
    generator: torch.Generator,
) -> list[SampledSequence]:
    """``num_samples`` completions of ``prompt`` (checked by :func:`check_sampling`), decoded
    together as one batch (the prompt once per row: no padding anywhere). Runs without
    gradients; the caller sets the weights (``trainer.primitives.adapters.swapped_in``)."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt)] * num_samples, dtype=torch.long, device=device)
    rows = [_Row() for _ in range(num_samples)]
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        for step in range(settings.max_tokens):
            next_ids, next_lp = _draw(out.logits[:, -1], settings, generator)
            for row, token, lp in zip(rows, next_ids.tolist(), next_lp.tolist(), strict=True):
                if row.reason is None:
                    row.add(token, lp, settings, tokenizer)
            if all(row.reason is not None for row in rows) or step + 1 == settings.max_tokens:
                break
            out = model(
                input_ids=next_ids.unsqueeze(-1),
                past_key_values=out.past_key_values,
                use_cache=True,
            )
    return [row.sequence() for row in rows]


def prompt_logprobs(model: nn.Module, prompt: Sequence[int]) -> list[float | None]:
    """``log p(prompt[t] | prompt[:t])`` for t >= 1, ``None`` at t = 0, at temperature 1:
    the same numbers ``forward_backward`` gives for those targets."""
    if len(prompt) < 2:
        return [None] * len(prompt)
    device = next(model.parameters()).device
    tokens = torch.tensor([list(prompt[:-1])], dtype=torch.long, device=device)
    targets = torch.tensor([list(prompt[1:])], dtype=torch.long, device=device)
    with torch.no_grad():
        lp = target_logprobs(model, tokens, targets, torch.ones_like(tokens, dtype=torch.bool))
    return [None, *lp[0].tolist()]
