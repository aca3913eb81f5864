"""Checked datums packed into right-padded tensors, a micro-batch at a time.

Right padding keeps every real token at its own position (0 to N - 1) and, under causal
attention, out of reach of the padding after it, so a datum's log-probabilities do not depend
on what it is packed with. Since the loss is a sum over datums, micro-batches (each its own
forward and backward pass) add up to exactly the gradient of the whole call."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from trainer.primitives.losses import LossFunction
from trainer.primitives.validation import CheckedDatum

__all__ = ["Packed", "micro_batches", "pack"]


@dataclass(frozen=True)
class Packed:
    """B datums padded to T = the longest: ``tokens``, ``targets`` [B, T] int64 (0 at
    padding), ``mask`` [B, T] bool (True on real positions), ``inputs`` every input the loss
    reads, [B, T] in the compute dtype: the datum's values, else the optional input's default
    or the config's value on real positions; 0 at padding (so every padded position has
    advantage and weight 0 and contributes nothing)."""

    tokens: Tensor
    targets: Tensor
    mask: Tensor
    inputs: dict[str, Tensor]

    @property
    def lengths(self) -> list[int]:
        return [int(n) for n in self.mask.sum(dim=-1)]


def micro_batches(lengths: Sequence[int], token_budget: int) -> list[range]:
    """Consecutive runs of datums whose padded size (count x longest) stays within
    ``token_budget``; a datum longer than the budget is a run of its own. Order is kept, so
    results come back in the caller's order."""
    runs: list[range] = []
    start, longest = 0, 0
    for i, n in enumerate(lengths):
        widest = max(longest, n)
        if i > start and widest * (i - start + 1) > token_budget:
            runs.append(range(start, i))
            start, widest = i, n
        longest = widest
    if lengths:
        runs.append(range(start, len(lengths)))
    return runs


def pack(
    datums: Sequence[CheckedDatum],
    loss: LossFunction,
    config: Mapping[str, float],
    dtype: torch.dtype,
    device: torch.device | str,
) -> Packed:
    """``datums`` as one right-padded :class:`Packed` batch on ``device``; float inputs in
    ``dtype``."""
    lengths = [int(d.tokens.numel()) for d in datums]
    batch, width = len(datums), max(lengths)
    tokens = torch.zeros(batch, width, dtype=torch.long)
    targets = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.bool)
    fills = {**loss.optional_inputs, **{k: config[k] for k in loss.per_token}}
    names = (*loss.inputs, *loss.optional_inputs, *loss.per_token)
    inputs = {k: torch.zeros(batch, width, dtype=torch.float64) for k in names}
    for i, (d, n) in enumerate(zip(datums, lengths, strict=True)):
        tokens[i, :n] = d.tokens
        targets[i, :n] = d.targets
        mask[i, :n] = True
        for key in names:
            given = d.inputs.get(key)
            inputs[key][i, :n] = given if given is not None else fills[key]
    return Packed(
        tokens.to(device),
        targets.to(device),
        mask.to(device),
        {k: v.to(device=device, dtype=dtype) for k, v in inputs.items()},
    )
