"""The rollout engine interface shared by the vLLM and transformers engines.

Sampling semantics every engine follows, so that the trainer can treat them alike:

- ``temperature`` T > 0 samples from softmax(logits / T) over the full vocabulary (no top-k,
  top-p or penalties); ``greedy=True`` (or T == 0) takes the argmax.
- ``Completion.logprobs[i]`` is log_softmax(logits / T)[token_ids[i]] for sampled generation and
  log_softmax(logits)[token_ids[i]] (T = 1) for greedy generation: the same quantity a trainer
  computes with its own forward pass at the sampling temperature.
- Generation stops at the first end token (kept as the last token, finish "stop") or after
  ``max_new_tokens`` tokens (finish "length"). The end tokens are every one the model declares
  (the tokenizer's eos, the generation config's eos list, the chat template's end-of-turn
  token), computed once by :func:`trainer.rollout.stop_tokens.stop_token_ids` in
  :func:`trainer.rollout.registry.make_engine` and handed to the engine.
- ``seed`` fixes the samples of one call: same seed, same weights and same prompts give the same
  completions, regardless of what the engine generated before. Inside
  :func:`prefix_cache_kept` an engine with a prefix cache (vLLM) reuses the KV blocks of the
  block's earlier calls (a multi-turn rollout's next prompt extends the last one's context):
  the block starts from an empty cache, so a whole block's samples still depend only on its
  calls.
- The context limit: an engine that has one says it as ``max_model_len`` (both engines here),
  at most the model's own (:func:`model_context_tokens`) for vLLM, which refuses more.

Adding an engine: its module under ``trainer/rollout/`` (built on this interface), a factory in
:data:`trainer.rollout.registry.ROLLOUT_ENGINES` that imports that module lazily, and its name
in ``jobspec.RolloutEngineName`` (a test checks the keys equal the spec's names).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class Completion:
    """One sampled continuation of one prompt."""

    token_ids: list[int]  # sampled completion tokens, the end token included if one was sampled
    logprobs: list[float] | None  # the engine's logprob of each sampled token (temperature applied)
    text: str  # decoded without special tokens and without the end token
    finish_reason: FinishReason
    # 1 on tokens the model sampled, 0 on tokens injected between turns (an agent episode's
    # tool results and environment messages); None: every token was sampled.
    loss_mask: list[int] | None = None
    # The policy version whose weights sampled it (the number of updates applied to them), as
    # the engine that served the call reports it; None for an engine that does not count
    # versions (the in-process engines of the synchronous step, always the current weights).
    policy_version: int | None = None


def check_generate_args(
    prompts: list[list[int]], temperature: float, greedy: bool, max_model_len: int
) -> bool:
    """Validate a generate call the same way on every engine; returns whether it is greedy
    (asked for, or temperature 0)."""
    greedy = greedy or temperature == 0.0
    if not greedy and temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    for prompt in prompts:
        if not prompt or len(prompt) >= max_model_len:
            raise ValueError(
                f"prompt of {len(prompt)} tokens does not fit max_model_len "
                f"{max_model_len} (needs 1 to max_model_len - 1 tokens)"
            )
    return greedy


class RolloutEngine(Protocol):
    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        *,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        greedy: bool = False,
    ) -> list[list[Completion]]:
        """Sample ``n`` completions for each prompt (token ids); result is [len(prompts)][n]."""
        ...

    def sync_weights(self, model: nn.Module) -> float:
        """Make the engine generate with ``model``'s current parameters; returns seconds spent."""
        ...

    def close(self) -> None:
        """Release the engine's memory; the engine is unusable afterwards."""
        ...


@runtime_checkable
class StreamedSync(Protocol):
    """An engine that takes a sharded policy's weights as they are gathered, bucket by bucket
    (``trainer.distributed.weights.engine_buckets``; several ranks, no whole copy anywhere).

    ``buckets`` yields lists of ``(name, tensor)``: whole tensors in the engine's dtype, under
    the names the run's weight view gives (``trainer.run.engine_sync.engine_view``): the base
    model's Hugging Face names with LoRA merged ("merged", ``lm_head.*`` included even when
    tied), or a LoRA adapter's own tensors under the policy's state_dict names (keys with
    ``.lora_A.default.``/``.lora_B.default.``; "adapter"). The engine must copy a bucket into
    place (or out of the tensors) before it asks for the next one: asking for the next runs
    the next bucket's gathers, collectives every rank runs in the same order, and a bucket's
    tensors may be freed once the next is asked for. The engine must not call the trainer's
    process group. Once every bucket is in, caches computed with the old weights are dropped
    (a prefix cache). ``adapter_config``: the adapter's ``peft.LoraConfig`` with the "adapter"
    view (an engine that loads adapter folders writes it beside the tensors), else None.
    Returns the seconds spent, gathers included."""

    def load_weight_buckets(
        self,
        buckets: Iterable[Sequence[tuple[str, torch.Tensor]]],
        adapter_config: Any = None,
    ) -> float: ...


def streamed_sync(engine: object) -> StreamedSync | None:
    """``engine`` when it takes weight buckets (:class:`StreamedSync`), else None."""
    return engine if isinstance(engine, StreamedSync) else None


@dataclass
class PrefillCounts:
    """Prompt tokens an engine was given and how many of them it read from its prefix cache
    instead of computing them (cumulative; vLLM's ``num_cached_tokens``)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0

    def cached_share_since(self, earlier: PrefillCounts) -> float:
        """The share of the prompt tokens since ``earlier`` (a copy taken then) that came from
        the cache (0.0 when there were none)."""
        prompts = self.prompt_tokens - earlier.prompt_tokens
        return (self.cached_tokens - earlier.cached_tokens) / prompts if prompts else 0.0


@contextmanager
def prefix_cache_kept(engine: object) -> Iterator[None]:
    """Within the block, ``engine`` keeps its prefix cache from one ``generate`` call to the
    next (reset once, on entry); an engine without one (its ``keep_prefix_cache`` method)
    runs as ever. Weights must not change inside the block (a sync resets the cache anyway)."""
    keep = getattr(engine, "keep_prefix_cache", None)
    with keep() if callable(keep) else nullcontext():
        yield


# The config keys that bound a model's positions, as transformers' configs name them (GPT-2's
# n_positions, Falcon's max_sequence_length, ChatGLM's seq_length).
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
# A tokenizer without a stated limit reports a huge sentinel (transformers' VERY_LARGE_INTEGER).
_NO_TOKENIZER_LIMIT = 10**9


def model_context_tokens(
    config: Any, tokenizer: PreTrainedTokenizerBase | None = None
) -> int | None:
    """The longest sequence the model was built for: the smallest of ``config``'s position
    limits (a transformers config) and ``tokenizer``'s ``model_max_length``; None when neither
    states one. vLLM derives its own limit from the same values (and may stretch it for scaled
    RoPE), so this is never above what vLLM accepts."""
    limits = [getattr(config, key, None) for key in _CONTEXT_KEYS]
    limits.append(getattr(tokenizer, "model_max_length", None))
    found = [
        int(v)
        for v in limits
        if isinstance(v, int) and not isinstance(v, bool) and 0 < v < _NO_TOKENIZER_LIMIT
    ]
    return min(found) if found else None


def torch_dtype(name: str) -> torch.dtype:
    """Map an engine dtype name ("float32", "bfloat16", "float16") to the torch dtype."""
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"unsupported engine dtype {name!r}; expected one of {sorted(dtypes)}")
    return dtypes[name]


@contextmanager
def seeded_rng(seed: int, device: torch.device) -> Iterator[None]:
    """Seed torch's global generators for one rollout call, then put them back as they were.

    A rollout samples from the global generator of the device it runs on (CPU, or the CUDA
    device). Forking that device's generator too, not only the CPU one, keeps the trainer's own
    random stream (dropout, minibatch order) where it was, so a rollout consumes none of it."""
    devices = [device.index if device.index is not None else 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def default_enforce_eager(device_type: str) -> bool:
    """vLLM's ``enforce_eager`` when ``rollout.enforce_eager`` is unset: off on CUDA, where
    captured CUDA graphs decode faster; on elsewhere (vLLM on CPU runs eagerly anyway)."""
    return device_type != "cuda"


def completion_from_tokens(
    token_ids: list[int],
    logprobs: list[float] | None,
    *,
    stop_token_ids: Collection[int],
    max_new_tokens: int,
    tokenizer: PreTrainedTokenizerBase,
) -> Completion:
    """Cut a raw continuation at its first end token (any of ``stop_token_ids``, kept) and
    decide the finish reason: "stop" when an end token was sampled within ``max_new_tokens``,
    else "length" (truncated: what overlong shaping and ``mask_truncated`` act on).

    Anything after the first end token (padding of finished rows in a batch) is dropped,
    together with its logprobs. The text leaves the end token out even when the tokenizer does
    not mark it special, so graders never see it.
    """
    stops = set(stop_token_ids)
    raw = token_ids[:max_new_tokens]
    end = next((i for i, token in enumerate(raw) if token in stops), None)
    reason: FinishReason = "length" if end is None else "stop"
    kept = raw if end is None else raw[: end + 1]
    kept_logprobs = None if logprobs is None else logprobs[: len(kept)]
    content = kept if end is None else kept[:-1]
    text = str(tokenizer.decode(content, skip_special_tokens=True))
    return Completion(token_ids=kept, logprobs=kept_logprobs, text=text, finish_reason=reason)
