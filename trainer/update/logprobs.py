"""Log-probabilities and entropies of sampled tokens without a full-vocabulary tensor.

A full ``log_softmax`` over [B, T, V] is large (64 x 80 positions x 49,152 vocab in float32 is
about 1 GB) and so, under autograd, are the logits kept for the backward pass. Everything here
works on row chunks of at most ``chunk_size`` x V. :func:`completion_logprobs` runs the output
head fused with its log-softmax (``trainer.update.fused_head``: each chunk's logits recomputed in
the backward pass, which forms the head's gradients itself, one [chunk, V] buffer at a time);
``head="plain"`` (and a head that is not a plain Linear, such as a LoRA-wrapped one) runs
``lm_head`` on each chunk under activation checkpointing instead, the path before the fused one.

Half-precision logits are upcast to float32 chunk by chunk before the softmax; outputs are
float32 then (float64 stays float64).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, cast

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from jobspec.memory_terms import head_chunk_rows_for
from trainer.models.precision import exact_float32_matmuls
from trainer.update.fused_head import fused_head_logprobs
from trainer.update.fused_head import row_entropy as _row_entropy
from trainer.update.fused_head import row_logprobs as _row_logprobs
from trainer.update.fused_head import scaled as _scaled


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")


def _by_row_chunks(
    fn: Callable[[Tensor, Tensor], Tensor], logits: Tensor, token_ids: Tensor, chunk_size: int
) -> Tensor:
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    ids = token_ids.reshape(-1)
    out_dtype = torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype
    if flat.shape[0] == 0:
        return torch.zeros(token_ids.shape, dtype=out_dtype, device=logits.device)
    parts = [
        fn(flat[s : s + chunk_size], ids[s : s + chunk_size])
        for s in range(0, flat.shape[0], chunk_size)
    ]
    return torch.cat(parts).reshape(token_ids.shape)


def selective_logprobs(
    logits: Tensor, token_ids: Tensor, temperature: float = 1.0, chunk_size: int = 1024
) -> Tensor:
    """``log_softmax(logits / temperature)`` gathered at ``token_ids``: [B, T, V], [B, T] -> [B, T].

    Computed as ``x[id] - logsumexp(x)`` per chunk of ``chunk_size`` rows (positions), so the
    largest temporary is [chunk_size, V]. Differentiable.
    """
    _check_temperature(temperature)
    if logits.shape[:-1] != token_ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match ids {token_ids.shape}")
    return _by_row_chunks(
        lambda x, ids: _row_logprobs(_scaled(x, temperature), ids), logits, token_ids, chunk_size
    )


def entropy_from_logits(logits: Tensor, temperature: float = 1.0, chunk_size: int = 1024) -> Tensor:
    """Entropy of ``softmax(logits / temperature)`` per position: [B, T, V] -> [B, T].

    Chunked over rows like :func:`selective_logprobs`. Differentiable if the input is.
    """
    _check_temperature(temperature)
    placeholder = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return _by_row_chunks(
        lambda x, _ids: _row_entropy(_scaled(x, temperature)), logits, placeholder, chunk_size
    )


def _head_chunk(
    lm_head: nn.Module, hidden: Tensor, token_ids: Tensor, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor]:
    """[N, H] hidden states, [N] ids -> ([N] logprobs, [N] detached entropy or empty).

    Outside any autocast, in the head's own dtype (float32 under bfloat16 mixed precision),
    and without TF32: bfloat16 logits would carry errors as large as a clip range of ratio
    (``trainer.models.precision``). The scope covers the forward pass (and its recomputation under
    checkpointing): the log-probabilities are exact; the head's gradients follow the process's
    setting like every other gradient."""
    weight = getattr(lm_head, "weight", None)
    with torch.autocast(device_type=hidden.device.type, enabled=False), exact_float32_matmuls():
        if isinstance(weight, Tensor) and hidden.dtype != weight.dtype:
            hidden = hidden.to(weight.dtype)
        x = _scaled(lm_head(hidden), temperature)
    logprobs = _row_logprobs(x, token_ids)
    if not with_entropy:
        return logprobs, logprobs.new_zeros(0)
    with torch.no_grad():
        entropy = _row_entropy(x)
    return logprobs, entropy


def decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    config = getattr(model, "config", None)
    # Only models whose logits are exactly lm_head(last_hidden_state) are supported; these
    # config fields mark the common exceptions (Gemma 2 soft-capping, Cohere logit scale).
    for field in ("final_logit_softcapping", "logit_scale"):
        if getattr(config, field, None) not in (None, 1.0):
            raise NotImplementedError(f"models with config.{field} are not supported")
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else getattr(model, "model", None)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(decoder, nn.Module) or not isinstance(head, nn.Module):
        raise TypeError(
            f"{type(model).__name__} does not expose a decoder and an output embedding "
            "(get_decoder() / get_output_embeddings())"
        )
    return decoder, head


def logits_divisor(model: nn.Module) -> float:
    """What ``model`` divides its output head's logits by before the softmax: Granite's
    ``config.logits_scaling`` (its forward, and vLLM's, return ``lm_head(h) / logits_scaling``),
    1 for every other model. The log-probabilities computed here from the head itself divide
    by it too (times the sampling temperature), so they are the model's own."""
    value = getattr(getattr(model, "config", None), "logits_scaling", None)
    if value is None:
        return 1.0
    divisor = float(value)
    if not divisor > 0:
        raise ValueError(f"config.logits_scaling must be positive, got {value}")
    return divisor


def _check_inputs(
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_len: int,
    temperature: float,
    chunk_size: int | None,
) -> None:
    """ValueError for arguments :func:`completion_logprobs` cannot work with."""
    _check_temperature(temperature)
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(
            f"need input_ids and attention_mask [B, L]: {input_ids.shape}, {attention_mask.shape}"
        )
    length = input_ids.shape[1]
    if not 1 <= prompt_len <= length:
        raise ValueError(f"prompt_len must be in [1, {length}], got {prompt_len}")


def _default_chunk_rows(lm_head: nn.Module, input_ids: Tensor) -> int:
    """Rows per output-head call when the caller names none."""
    weight = getattr(lm_head, "weight", None)
    vocab = int(weight.shape[0]) if weight is not None else 65_536
    # On a GPU the chunk follows what is free there; on CPU the fixed 16M-logit chunk,
    # measured as fast as larger ones (jobspec.memory_terms.head_chunk_rows_for).
    free = torch.cuda.mem_get_info(input_ids.device)[0] if input_ids.is_cuda else None
    return head_chunk_rows_for(vocab, free_bytes=free)


HeadPath = Literal["fused", "plain"]


def fusable_head(lm_head: nn.Module) -> tuple[Tensor, Tensor | None] | None:
    """The (weight, bias) of a head the fused path can compute, else None: a plain
    ``nn.Linear`` (not a LoRA-wrapped head, which peft makes a ``LoraLayer``; not a subclass
    with its own forward) with no hooks (an FSDP unit of its own gathers its weight in one)
    and an ordinary, unsharded weight."""
    if not isinstance(lm_head, nn.Linear) or type(lm_head).forward is not nn.Linear.forward:
        return None
    if lm_head._forward_hooks or lm_head._forward_pre_hooks:
        return None
    weight, bias = lm_head.weight, lm_head.bias
    if isinstance(weight, DTensor) or isinstance(bias, DTensor):
        return None
    return weight, bias


def head_chunks(
    lm_head: nn.Module,
    states: Tensor,
    targets: Tensor,
    temperature: float,
    with_entropy: bool,
    chunk_size: int,
    head: HeadPath = "fused",
) -> tuple[list[Tensor], list[Tensor]]:
    """The output head over the completion rows, ``chunk_size`` rows at a time.

    ``fused`` (a plain Linear head): :func:`trainer.update.fused_head.fused_head_logprobs`,
    which keeps no [rows, V] tensor for the backward pass. ``plain``, and any other head:
    each chunk through ``lm_head`` itself, checkpointed under autograd (its logits recomputed
    in the backward pass, where autograd holds the softmax's temporaries)."""
    fusable = fusable_head(lm_head) if head == "fused" else None
    if fusable is not None:
        lp, ent = fused_head_logprobs(
            states, fusable[0], fusable[1], targets, temperature, chunk_size, with_entropy
        )
        return [lp], [ent]
    recompute = torch.is_grad_enabled() and states.requires_grad
    lp_parts: list[Tensor] = []
    ent_parts: list[Tensor] = []
    for s in range(0, states.shape[0], chunk_size):
        args = (
            lm_head,
            states[s : s + chunk_size],
            targets[s : s + chunk_size],
            temperature,
            with_entropy,
        )
        if recompute:
            lp, ent = checkpoint(_head_chunk, *args, use_reentrant=False)
        else:
            lp, ent = _head_chunk(*args)
        lp_parts.append(lp)
        ent_parts.append(ent)
    return lp_parts, ent_parts


def _last_hidden(
    model: nn.Module,
    decoder: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
) -> Tensor:
    """The decoder's final (normed) hidden states [B, L, H].

    A model sharded with FSDP2 gathers its root weights (embeddings, final norm, output head)
    only in the root module's own forward, and keeps them gathered for the backward: so it runs
    its whole forward, with the head applied at one position only (``logits_to_keep=1``), and
    the head is then applied where this module needs it. Any other model runs its decoder
    alone."""
    if isinstance(model, FSDPModule):
        return _root_forward_last_hidden(model, decoder, input_ids, attention_mask, position_ids)
    outputs = decoder(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
    )
    return cast(Tensor, outputs.last_hidden_state)


def _root_forward_last_hidden(
    model: nn.Module,
    decoder: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
) -> Tensor:
    """The root's whole forward (``logits_to_keep=1``), the decoder's output taken by a
    forward hook: ``output_hidden_states=True`` would keep every layer's hidden states (and
    autograd their graph) for the one this module needs."""
    captured: list[Tensor] = []

    def keep(_module: nn.Module, _args: object, output: Any) -> None:
        last = getattr(output, "last_hidden_state", None)
        captured.append(last if isinstance(last, Tensor) else output[0])

    handle = decoder.register_forward_hook(keep)
    try:
        model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=1,
        )
    finally:
        handle.remove()
    if len(captured) != 1:
        raise RuntimeError(f"the decoder ran {len(captured)} times in one forward pass")
    return captured[0]


def completion_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_len: int,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    head: HeadPath = "fused",
) -> tuple[Tensor, Tensor | None]:
    """Log-probabilities (and optionally entropies) of the completion tokens under ``model``.

    Batch convention: ``input_ids`` [B, P + T] is left-padded prompts (width ``P =
    prompt_len``) followed by right-padded completions (width T); ``attention_mask`` [B, P + T]
    is 1 on real tokens. The logprob of completion token t is read from the logits at position
    ``P - 1 + t``. Position ids are ``cumsum(attention_mask) - 1``, so a left-padded prompt gets
    the same positions as it would unpadded.

    The base transformer runs once over the whole sequence; the output head is applied only at
    the T completion positions where ``attention_mask`` is 1, ``chunk_size`` (position, sequence)
    rows at a time. Under autograd no [chunk_size, V] logits are stored: they are recomputed
    in the backward pass (by the fused head, or by checkpointing on the plain path).

    Args:
        model: a causal LM exposing ``get_decoder()`` (returning a module whose output has
            ``last_hidden_state``) and ``get_output_embeddings()`` (the lm_head), as Hugging
            Face ``*ForCausalLM`` models do.
        temperature: the sampling temperature; logits are divided by it (and by Granite's
            ``config.logits_scaling``, :func:`logits_divisor`).
        chunk_size: rows per output-head call (bounds the [rows, V] temporaries); None picks
            ``head_chunk_rows_for(V, free_bytes=None)``.
        with_entropy: also return the per-position entropy (detached: it is a metric).
        head: ``fused`` (the update's path) or ``plain`` (the checkpointed ``lm_head`` per
            chunk, kept to check the fused one against); see :func:`head_chunks`.

    Returns:
        ``(logprobs [B, T], entropy [B, T] or None)``. Both are 0 at completion padding.
        Gradients flow into the model's parameters when grad mode is enabled.
    """
    _check_inputs(input_ids, attention_mask, prompt_len, temperature, chunk_size)
    batch, length = input_ids.shape
    decoder, lm_head = decoder_and_head(model)
    if chunk_size is None:
        chunk_size = _default_chunk_rows(lm_head, input_ids)

    # Left padding shifts every real token right; positions must count real tokens only.
    position_ids = (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)
    hidden = _last_hidden(model, decoder, input_ids, attention_mask, position_ids)
    width = length - prompt_len
    # Position P - 1 + t predicts completion token t.
    states = hidden[:, prompt_len - 1 : length - 1].reshape(batch * width, hidden.shape[-1])
    targets = input_ids[:, prompt_len:].reshape(-1)
    rows = attention_mask[:, prompt_len:].reshape(-1).nonzero().squeeze(-1)
    states = states.index_select(0, rows)
    targets = targets.index_select(0, rows)

    # Granite divides its logits by config.logits_scaling before any temperature.
    divisor = temperature * logits_divisor(model)
    lp_parts, ent_parts = head_chunks(
        lm_head, states, targets, divisor, with_entropy, chunk_size, head
    )
    out_dtype = torch.float32 if hidden.dtype in (torch.float16, torch.bfloat16) else hidden.dtype
    logprobs = _scatter_rows(lp_parts, rows, batch, width, out_dtype, hidden.device)
    entropy = (
        _scatter_rows(ent_parts, rows, batch, width, out_dtype, hidden.device)
        if with_entropy
        else None
    )
    if isinstance(model, FSDPModule) and not torch.is_grad_enabled():
        # FSDP keeps the root's weights gathered after its forward, for a backward that a
        # scoring pass never runs; left so, the next forward with gradients registers no
        # reduction for them and their gradients are not summed over the ranks.
        model.reshard()
    return logprobs, entropy


def _scatter_rows(
    parts: list[Tensor],
    rows: Tensor,
    batch: int,
    width: int,
    dtype: torch.dtype,
    device: torch.device,
) -> Tensor:
    """Place per-row values back into a zero [B, T] tensor (differentiably)."""
    out = torch.zeros(batch * width, dtype=dtype, device=device)
    if parts:
        out = out.index_copy(0, rows, torch.cat(parts).to(dtype))
    return out.reshape(batch, width)
