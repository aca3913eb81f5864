"""A step's batch: its completions packed into right-padded tensors (:class:`Batch`), its
micro-batches' inputs, and the no-grad logprobs of its sampled tokens under a model (the policy
before the update, the reference). The updates themselves are in
:mod:`trainer.update.policy_update`.

Shapes: B completions in the step's batch, T = the longest completion (right padding),
micro-batches of at most ``micro_batch_size`` rows are re-padded to their own widths.

A completion may hold tokens the model did not sample (an agent episode's tool results and
environment turns, ``trainer.agents``): the model reads them as context, but its per-token
mask is 0 there, so they get no gradient and count in no loss denominator or token metric.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from jobspec import TrainingDtype
from trainer.models.memory import release_free_memory
from trainer.models.precision import autocast
from trainer.update.logprobs import completion_logprobs

__all__ = [
    "Batch",
    "by_length",
    "forward_logprobs",
    "micro_inputs",
    "pack_batch",
]


@dataclass
class Batch:
    """The completions a step trains on, flattened group by group (G consecutive rows per prompt)."""

    prompts: list[list[int]]  # [B] prompt token ids
    completions: list[list[int]]  # [B] completion token ids
    mask: Tensor  # [B, T] 1.0 on sampled completion tokens (0: padding, injected tokens)
    loss_mask: Tensor  # [B, T] mask times the per-sequence truncation mask
    engine_logprobs: Tensor | None  # [B, T] the engine's logprobs of the sampled tokens
    lengths: Tensor  # [B] completion lengths (tokens)
    truncated: Tensor  # [B] bool: finished by the token limit

    @property
    def size(self) -> int:
        return len(self.completions)

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])


def pack_batch(
    prompts: Sequence[list[int]],
    completions: Sequence[list[int]],
    engine_logprobs: Sequence[list[float] | None],
    truncated: Sequence[bool],
    seq_loss_weight: Tensor,
    device: torch.device,
    token_masks: Sequence[Sequence[int] | None] | None = None,
) -> Batch:
    """Right-pad completions into [B, T] tensors; ``seq_loss_weight`` [B] scales the loss mask.

    ``token_masks[i]`` (one 0/1 per token of completion i; None, or a None entry: all ones)
    marks the tokens the model sampled; 0 removes a token from every mask of the batch while it
    stays in the completion the model reads. An engine logprob of an injected token is unused."""
    size = len(completions)
    width = max(1, max((len(c) for c in completions), default=1))
    mask = torch.zeros(size, width)
    have_engine = all(lp is not None for lp in engine_logprobs)
    engine = torch.zeros(size, width)
    for i, comp in enumerate(completions):
        token_mask = None if token_masks is None else token_masks[i]
        if token_mask is None:
            mask[i, : len(comp)] = 1.0
        elif len(token_mask) != len(comp):
            raise ValueError(f"row {i}: {len(token_mask)} mask values for {len(comp)} tokens")
        else:
            mask[i, : len(comp)] = torch.tensor(token_mask, dtype=torch.float32).clamp(0, 1)
        lp = engine_logprobs[i]
        if lp is not None and len(lp) == len(comp):
            engine[i, : len(comp)] = torch.tensor(lp, dtype=torch.float32)
        else:
            have_engine = False
    # Lengths count every token of a completion, injected ones too (the overlong shaping's
    # budget is the whole completion the engine and the episode produced).
    lengths = torch.tensor([float(len(c)) for c in completions], dtype=torch.float32)
    return Batch(
        prompts=list(prompts),
        completions=list(completions),
        mask=mask.to(device),
        loss_mask=(mask * seq_loss_weight.detach().to("cpu", mask.dtype)[:, None]).to(device),
        engine_logprobs=engine.to(device) if have_engine else None,
        lengths=lengths.to(device),
        truncated=torch.tensor(list(truncated), dtype=torch.bool, device=device),
    )


def micro_inputs(
    batch: Batch, rows: Sequence[int], pad_id: int, device: torch.device
) -> tuple[Tensor, Tensor, int, int]:
    """Inputs of a micro-batch: (input_ids [b, P + t], attention_mask, P, t), prompts left-padded
    to their longest (P) and completions right-padded to their longest (t <= T)."""
    prompts = [batch.prompts[r] for r in rows]
    comps = [batch.completions[r] for r in rows]
    p_width = max(len(p) for p in prompts)
    t_width = max(1, max(len(c) for c in comps))
    ids = torch.full((len(rows), p_width + t_width), pad_id, dtype=torch.long)
    att = torch.zeros((len(rows), p_width + t_width), dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, comps, strict=True)):
        ids[i, p_width - len(p) : p_width] = torch.tensor(p, dtype=torch.long)
        att[i, p_width - len(p) : p_width] = 1
        if c:
            ids[i, p_width : p_width + len(c)] = torch.tensor(c, dtype=torch.long)
            att[i, p_width : p_width + len(c)] = 1
    return ids.to(device), att.to(device), p_width, t_width


def by_length(batch: Batch, rows: Sequence[int]) -> list[int]:
    """``rows`` sorted by (completion length, prompt length), so that consecutive micro-batches
    hold rows of similar widths and pad little. About a fifth of the positions of a typical
    batch are padding in batch order (truncated completions set the width of almost every
    micro-batch); results do not depend on the order, as losses use minibatch-wide totals."""
    return sorted(rows, key=lambda r: (len(batch.completions[r]), len(batch.prompts[r]), r))


def forward_logprobs(
    model: nn.Module,
    batch: Batch,
    *,
    micro_batch_size: int,
    temperature: float,
    pad_id: int,
    with_entropy: bool = False,
    dtype: TrainingDtype = "float32",
) -> tuple[Tensor, Tensor | None]:
    """No-grad logprobs (and entropies) of every sampled token: ([B, T], [B, T] or None);
    the decoder runs in ``dtype`` (``trainer.models.precision``), the head in float32."""
    device = batch.mask.device
    # float32 (the head's output under any training dtype); a float64 model's stay float64.
    out_dtype = torch.float64 if _parameter_dtype(model) == torch.float64 else torch.float32
    lp_all = torch.zeros(batch.size, batch.width, device=device, dtype=out_dtype)
    ent_all = (
        torch.zeros(batch.size, batch.width, device=device, dtype=out_dtype)
        if with_entropy
        else None
    )
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            order = by_length(batch, range(batch.size))
            for start in range(0, batch.size, micro_batch_size):
                rows = order[start : start + micro_batch_size]
                ids, att, p_width, t_width = micro_inputs(batch, rows, pad_id, device)
                with autocast(dtype, device):
                    lp, ent = completion_logprobs(
                        model, ids, att, p_width, temperature=temperature, with_entropy=with_entropy
                    )
                lp_all[rows, :t_width] = lp.to(out_dtype)
                if ent_all is not None and ent is not None:
                    ent_all[rows, :t_width] = ent.to(out_dtype)
                del lp, ent
                release_free_memory()
    finally:
        model.train(was_training)
    return lp_all, ent_all


def _parameter_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of the model's first parameter (None: it has none)."""
    first = next(iter(model.parameters()), None)
    return None if first is None else first.dtype
