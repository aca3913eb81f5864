"""Length-based reward shaping and loss masking (DAPO section 3.4)."""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(lengths: Tensor, max_len: int, cache_len: int, penalty: float = 1.0) -> Tensor:
    """Soft overlong punishment, DAPO eq. 13, scaled by ``penalty``: [B] lengths -> [B] float.

    With ``L = length`` and ``start = max_len - cache_len``:

    - ``0`` when ``L <= start``;
    - ``-(L - start) / cache_len * penalty`` when ``start < L <= max_len`` (linear, reaching
      ``-penalty`` at ``L = max_len``);
    - ``-penalty`` when ``L > max_len``.

    Added to the task reward before advantages. ``lengths`` counts completion tokens.
    """
    if cache_len <= 0 or cache_len > max_len:
        raise ValueError(f"need 0 < cache_len <= max_len, got cache_len={cache_len}, {max_len=}")
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be [B], got shape {tuple(lengths.shape)}")
    dtype = lengths.dtype if lengths.is_floating_point() else torch.get_default_dtype()
    start = max_len - cache_len
    # (start - L) / cache_len is >= 0 below the window, in [-1, 0) inside it and < -1 past
    # max_len: clamping to [-1, 0] gives the three pieces of eq. 13 at once.
    frac = (start - lengths.to(dtype)) / cache_len
    return frac.clamp(min=-1.0, max=0.0) * penalty


def truncation_loss_mask(truncated: Tensor, enabled: bool) -> Tensor:
    """Per-sequence loss weight [B] float: 0 for truncated completions when ``enabled``, else 1.

    A completion cut off at the token limit has no final answer, so its reward says little about
    the tokens it did produce; masking it keeps that noise out of the gradient. Multiply the
    [B, T] token mask by ``mask[:, None]``.
    """
    if truncated.dim() != 1:
        raise ValueError(f"truncated must be [B], got shape {tuple(truncated.shape)}")
    dtype = torch.get_default_dtype()
    if not enabled:
        return torch.ones(truncated.shape, dtype=dtype, device=truncated.device)
    return (~truncated.bool()).to(dtype)


def longest_turns(mask: Tensor) -> Tensor:
    """The model's own tokens of each row's longest turn: [B, T] 0/1 mask -> [B] float.

    A turn is a run of consecutive sampled tokens (mask 1); an agent episode's tool results and
    environment messages (mask 0) separate its turns, and padding ends the row. A single-turn
    completion's longest turn is its length. Overlong shaping reads this: ``max_new_tokens`` is
    a budget per turn, so injected tokens must not count against it (counting them made a
    2-turn episode of two short answers score the full penalty while a direct answer of the
    same words scored 0).
    """
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
    ones = (mask != 0).to(torch.float64)
    count = ones.cumsum(dim=1)
    # At every 0 the run restarts: the count reached there is the offset of the next run.
    offset = torch.where(ones == 0, count, torch.zeros_like(count)).cummax(dim=1).values
    runs = count - offset
    dtype = mask.dtype if mask.is_floating_point() else torch.get_default_dtype()
    return runs.amax(dim=1).to(dtype) if mask.shape[1] else torch.zeros(mask.shape[0], dtype=dtype)
