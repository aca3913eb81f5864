"""Target log-probabilities: ``log p(targets[t] | tokens[: t + 1])`` at every real position.

Unlike the GRPO update's :func:`trainer.update.logprobs.completion_logprobs`, which reads
each target from the next input token, a Tinker datum names its targets apart from its input
(the cookbook's RL datums put target 0 on prompt positions), so the head is applied at every
position with the given targets. The decoder and the chunked output head are the update's
own (``decoder_and_head``, ``head_chunks``): the same precision rules (the head outside
autocast, exact float32 logits) and no [rows, vocab] logits kept for the backward pass.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

# The update's decoder/head split and chunked head, reused rather than copied (they are
# module-private there; making them public is a rename in trainer.update.logprobs).
from jobspec.memory_terms import head_chunk_rows_for
from trainer.update.logprobs import decoder_and_head, head_chunks, logits_divisor

__all__ = ["target_logprobs"]


def target_logprobs(model: nn.Module, tokens: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
    """[B, T] log-probabilities of ``targets`` under ``model`` at temperature 1, 0 where
    ``mask`` is False.

    Args:
        model: a causal LM with ``get_decoder()`` and ``get_output_embeddings()`` (a peft
            model's adapters apply, the head's included).
        tokens: [B, T] int64 input ids, right-padded.
        targets: [B, T] int64 target ids.
        mask: [B, T] bool, True on real positions (a prefix of each row).

    Differentiable into the model's parameters when grad mode is on. float32 out for a
    half-precision model (the head's logits are upcast), the model's dtype otherwise.
    """
    decoder, head = decoder_and_head(model)
    attention = mask.long()
    # Right padding: real tokens sit at positions 0..N-1 already; padding positions are never
    # read (their rows are dropped below).
    position_ids = (attention.cumsum(dim=-1) - 1).clamp(min=0)
    hidden = decoder(
        input_ids=tokens, attention_mask=attention, position_ids=position_ids, use_cache=False
    ).last_hidden_state
    rows = mask.reshape(-1).nonzero().squeeze(-1)
    states = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)
    ids = targets.reshape(-1).index_select(0, rows)
    vocab = int(getattr(head, "out_features", 65_536))
    # Temperature 1; Granite's logits are lm_head(h) / config.logits_scaling.
    parts, _ = head_chunks(
        head, states, ids, logits_divisor(model), False, head_chunk_rows_for(vocab, free_bytes=None)
    )
    out_dtype = torch.float32 if hidden.dtype in (torch.float16, torch.bfloat16) else hidden.dtype
    flat = torch.zeros(tokens.numel(), dtype=out_dtype, device=tokens.device)
    flat = flat.index_copy(0, rows, torch.cat(parts).to(out_dtype))
    return flat.reshape(tokens.shape)
