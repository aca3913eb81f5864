"""The output head fused with its log-softmax: per-token log-probabilities from hidden states
without keeping any [rows, vocab] tensor for the backward pass.

:class:`FusedHeadLogprobs` takes hidden states [N, H], the head's weight [V, H] (and bias),
token ids [N] and the temperature, and returns ``log_softmax(h W^T + b) / T`` at the ids [N]
(and the entropy [N], detached, when asked), ``chunk`` rows at a time. It saves its inputs and
each row's log-sum-exp only; the backward pass recomputes one chunk's logits at a time and
turns them in place into ``(onehot - softmax) * grad / T``, from which it forms the chunk's
``grad_hidden`` and adds its ``grad_weight`` into one [V, H] buffer. One [chunk, V] buffer is
alive at a time, where the checkpointed plain head (``trainer.update.logprobs``) also holds
autograd's temporaries of the log-sum-exp and gather backward (softmax, the scattered one-hot
gradient, their sum) and a [V, H] weight gradient per chunk before they are added up.

With a frozen head (LoRA, the head not adapted) and hidden states that need a gradient, the
forward pass also stores ``W[id] - softmax @ W`` [N, H] per row: the hidden-state gradient is
that times ``grad / T``, so the backward pass recomputes nothing.

Precision is the plain head's (``_head_chunk``): the head runs outside autocast in its own
dtype (float32 under bfloat16 mixed precision), its forward matmul at full float32 precision,
never TF32 (``exact_float32_matmuls``): the log-probabilities are exact. The backward's
recomputation of the logits and the gradient matmuls only feed gradients, and follow the
process's setting like every other gradient (TF32 on a GPU: half the head's exact float32
work of a full fine-tune's step goes). Half-precision
logits are upcast to float32 chunk by chunk.

Liger-Kernel's ``LigerFusedLinearCrossEntropyFunction`` is not used: it is Triton (CUDA only,
and this project's tests and CPU benchmarks run without CUDA); it returns a cross-entropy loss
whose input and weight gradients are computed in the forward pass for a loss with gradient 1
(per-token weights, the advantages and masks of GRPO, arrive only in the backward pass); it has
no entropy; and its logits are computed in the input dtype (bfloat16 under autocast), which the
exact-float32 rule above forbids. The package is not a dependency.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from trainer.models.precision import exact_float32_matmuls

__all__ = ["FusedHeadLogprobs", "fused_head_logprobs", "row_entropy", "row_logprobs", "scaled"]


def scaled(logits: Tensor, temperature: float) -> Tensor:
    """Upcast half-precision logits and divide by the sampling temperature."""
    x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    return x if temperature == 1.0 else x / temperature


def row_logprobs(x: Tensor, token_ids: Tensor) -> Tensor:
    """[N, V] scaled logits, [N] ids -> [N] log-softmax at the ids (logsumexp + gather)."""
    picked = x.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(x, dim=-1)


def row_entropy(x: Tensor) -> Tensor:
    """[N, V] scaled logits -> [N] entropy of softmax(x). Terms with p = 0 count as 0 (so a
    ``-inf`` logit does not give ``0 * -inf = nan``)."""
    logp = torch.log_softmax(x, dim=-1)
    p = logp.exp()
    plogp = torch.where(p > 0, p * logp, torch.zeros_like(p))
    return -plogp.sum(dim=-1)


def _logits(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float, exact: bool = True
) -> Tensor:
    """One chunk's scaled logits [rows, V], outside autocast; a fresh tensor the caller may
    overwrite. ``exact``: a full float32 matmul (the log-probabilities); else the process's
    float32 setting (TF32 on a GPU where the job turned it on): the backward's recomputation,
    which only feeds gradients, and gradients follow that setting everywhere else."""
    with exact_float32_matmuls() if exact else contextlib.nullcontext():
        logits = F.linear(hidden, weight, bias)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return logits if temperature == 1.0 else logits.div_(temperature)


def _chunk_forward(
    x: Tensor, ids: Tensor, with_entropy: bool, basis_weight: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """Scaled logits [rows, V] (overwritten) -> (logprobs, logsumexp, entropy or None, and
    with ``basis_weight`` W: ``W[id] - softmax @ W`` [rows, H], else None)."""
    lse = torch.logsumexp(x, dim=-1)
    logprobs = x.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy and basis_weight is None:
        return logprobs, lse, None, None
    logp = x.sub_(lse.unsqueeze(-1))
    entropy = None
    if with_entropy:
        # p log p, with 0 where p = 0 (a -inf logit gives 0 * -inf = nan; nansum drops it).
        entropy = -torch.nansum(logp.exp().mul_(logp), dim=-1)
    basis = None
    if basis_weight is not None:
        p = logp.exp_().to(basis_weight.dtype)
        basis = basis_weight[ids] - p @ basis_weight
    return logprobs, lse, entropy, basis


def _softmax_minus_onehot(
    x: Tensor, lse: Tensor, ids: Tensor, grad: Tensor, temperature: float
) -> Tensor:
    """In place: scaled logits [rows, V] -> d(sum grad * logprob)/d(logits) = (onehot - p) *
    grad / T."""
    g = grad.to(x.dtype) / temperature
    d = x.sub_(lse.unsqueeze(-1)).exp_().mul_(-g.unsqueeze(-1))
    rows = torch.arange(ids.shape[0], device=ids.device)
    d[rows, ids] += g
    return d


class FusedHeadLogprobs(torch.autograd.Function):
    """``(hidden [N, H], weight [V, H], bias [V] or None, ids [N], temperature, chunk,
    with_entropy) -> (logprobs [N], entropy [N] or empty)``; see the module's docstring."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        token_ids: Tensor,
        temperature: float,
        chunk: int,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        # A frozen head under a hidden-state gradient: keep W[id] - softmax @ W instead.
        frozen = ctx.needs_input_grad[0] and not any(ctx.needs_input_grad[1:3])
        lp_parts, lse_parts, ent_parts, basis_parts = [], [], [], []
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            for s in range(0, hidden.shape[0], chunk):
                x = _logits(hidden[s : s + chunk], weight, bias, temperature)
                lp, lse, ent, basis = _chunk_forward(
                    x, token_ids[s : s + chunk], with_entropy, weight if frozen else None
                )
                del x
                lp_parts.append(lp)
                lse_parts.append(lse)
                if ent is not None:
                    ent_parts.append(ent)
                if basis is not None:
                    basis_parts.append(basis)
        out_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        logprobs = _cat(lp_parts, out_dtype, hidden.device)
        entropy = _cat(ent_parts, out_dtype, hidden.device) if with_entropy else None
        lse_all = _cat(lse_parts, out_dtype, hidden.device)
        basis = torch.cat(basis_parts) if basis_parts else None
        ctx.save_for_backward(hidden, weight, bias, token_ids, lse_all, basis)
        ctx.temperature, ctx.chunk = temperature, chunk
        entropy = entropy if entropy is not None else logprobs.new_zeros(0)
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_lp: Tensor, _grad_entropy: Tensor
    ) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, token_ids, lse, basis = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        temperature, chunk = ctx.temperature, ctx.chunk
        if basis is not None:
            scale = (grad_lp / temperature).to(basis.dtype).unsqueeze(-1)
            return (basis * scale).to(hidden.dtype), None, None, None, None, None, None
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b and bias is not None else None
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            for s in range(0, hidden.shape[0], chunk):
                h = hidden[s : s + chunk]
                x = _logits(h, weight, bias, temperature, exact=False)
                d = _softmax_minus_onehot(
                    x,
                    lse[s : s + chunk],
                    token_ids[s : s + chunk],
                    grad_lp[s : s + chunk],
                    temperature,
                ).to(weight.dtype)
                if grad_h is not None:
                    grad_h[s : s + chunk] = d @ weight
                if grad_w is not None:
                    grad_w.addmm_(d.t(), h)
                if grad_b is not None:
                    grad_b += d.sum(0)
                del x, d
        return grad_h, grad_w, grad_b, None, None, None, None


def _cat(parts: list[Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
    if not parts:
        return torch.zeros(0, dtype=dtype, device=device)
    return torch.cat(parts).to(dtype)


def fused_head_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    token_ids: Tensor,
    temperature: float = 1.0,
    chunk: int = 1024,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor]:
    """Per-token log-probabilities (and detached entropies, else an empty tensor) of the
    output head ``weight`` (``bias``) at ``hidden`` [N, H] and ``token_ids`` [N], computed
    ``chunk`` rows at a time without keeping [rows, V] logits for the backward pass.

    Hidden states in another dtype than the head's (bfloat16 under autocast) are cast to the
    head's first, as the plain head does; their gradient comes back in their own dtype."""
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    if hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    out = FusedHeadLogprobs.apply(hidden, weight, bias, token_ids, temperature, chunk, with_entropy)
    return out[0], out[1]
