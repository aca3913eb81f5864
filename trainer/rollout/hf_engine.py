"""Rollout with transformers ``generate``: the fallback engine and the reference for vLLM.

The engine generates with the policy model object itself when the requested dtype is the
policy's dtype (then ``sync_weights`` has nothing to do and returns 0.0). When another dtype is
requested it keeps its own copy in that dtype and ``sync_weights`` copies the policy's current
parameters into it.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedTokenizerBase,
)

from jobspec import memory_plan
from trainer.distributed.weights import copy_bucket
from trainer.rollout.base import (
    Completion,
    check_generate_args,
    completion_from_tokens,
    seeded_rng,
    torch_dtype,
)
from trainer.rollout.stop_tokens import stop_token_ids as declared_stop_token_ids


class _SampledLogprobRecorder(LogitsProcessor):
    """Records log_softmax(logits / T) of each sampled token without keeping per-step scores.

    ``generate`` calls this once per step with the rows' raw next-token logits (custom
    processors run before the temperature warper) and the ids generated so far. The newest id
    was drawn from the distribution stored at the previous call, so its logprob is gathered then;
    only one [rows, vocab] tensor is alive at a time instead of ``output_scores``' one per step.
    """

    def __init__(self, temperature: float) -> None:
        self._inv_temperature = 1.0 / temperature
        self._previous: torch.Tensor | None = None  # [rows, vocab]
        self._gathered: list[torch.Tensor] = []  # each [rows]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._previous is not None:
            self._gathered.append(self._gather(input_ids[:, -1]))
        self._previous = torch.log_softmax(scores.float() * self._inv_temperature, dim=-1)
        return scores

    def _gather(self, token_ids: torch.Tensor) -> torch.Tensor:
        assert self._previous is not None
        return self._previous.gather(1, token_ids.unsqueeze(1).to(self._previous.device))[:, 0]

    def finish(self, last_token_ids: torch.Tensor) -> torch.Tensor:
        """Logprobs of all generated positions, [rows, steps]; ``last_token_ids`` is [rows]."""
        self._gathered.append(self._gather(last_token_ids))
        return torch.stack(self._gathered, dim=1)


class HFEngine:
    """``RolloutEngine`` backed by ``model.generate`` (see module docstring for weight handling)."""

    def __init__(
        self,
        policy_model: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        *,
        dtype: str,
        max_model_len: int,
        max_batch_rows: int = memory_plan.HF_GENERATE_ROWS,
        stop_token_ids: Sequence[int] | None = None,
    ) -> None:
        target = torch_dtype(dtype)
        # Generating with the policy itself needs every weight in the engine's dtype (a LoRA
        # base stored in bfloat16 for autocast, under float32 rollouts, takes a copy).
        if all(p.dtype == target for p in policy_model.parameters()):
            self._model = policy_model
            self._owns_copy = False
        else:
            self._model = copy.deepcopy(policy_model).to(target).eval().requires_grad_(False)
            self._owns_copy = True
        if stop_token_ids is None:  # every end token the model declares (make_engine's default)
            stop_token_ids = declared_stop_token_ids(tokenizer, model=policy_model)
        if not stop_token_ids:
            raise ValueError("no stop token ids: generation could never stop")
        self._tokenizer = tokenizer
        self._stop_ids: list[int] = sorted({int(t) for t in stop_token_ids})
        pad = tokenizer.pad_token_id
        if pad is None:  # finished rows are padded with an end token, cut off afterwards
            pad = (
                tokenizer.eos_token_id if tokenizer.eos_token_id is not None else self._stop_ids[0]
            )
        self._pad: int = int(pad)
        self._max_model_len = max_model_len
        self._max_batch_rows = max_batch_rows

    @property
    def stop_token_ids(self) -> list[int]:
        """The token ids a completion ends at (sorted)."""
        return list(self._stop_ids)

    @property
    def max_model_len(self) -> int:
        """The longest prompt and completion together the engine takes."""
        return self._max_model_len

    # ------------------------------------------------------------------ interface

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
        """Sample ``n`` completions per prompt; [len(prompts)][n]. Deterministic given ``seed``."""
        greedy = check_generate_args(prompts, temperature, greedy, self._max_model_len)
        # Greedy samples are all alike: decode each prompt once and copy the result.
        copies, n = (n, 1) if greedy else (1, n)
        rows = [prompt for prompt in prompts for _ in range(n)]
        completions: list[Completion] = []
        with self._generation_mode(), torch.no_grad(), seeded_rng(seed, self._device()):
            for start in range(0, len(rows), self._max_batch_rows):
                chunk = rows[start : start + self._max_batch_rows]
                completions.extend(self._generate_chunk(chunk, max_new_tokens, temperature, greedy))
        return [completions[i * n : (i + 1) * n] * copies for i in range(len(prompts))]

    def sync_weights(self, model: nn.Module) -> float:
        """No-op when generating with the policy itself, else copy (and cast) its parameters."""
        if not self._owns_copy:
            return 0.0
        start = time.perf_counter()
        with torch.no_grad():
            self._model.load_state_dict(model.state_dict())
        return time.perf_counter() - start

    def load_weight_buckets(
        self,
        buckets: Iterable[Sequence[tuple[str, torch.Tensor]]],
        adapter_config: Any = None,
    ) -> float:
        """Copy whole tensors, bucket by bucket, into the module the engine generates with,
        by its ``state_dict`` names (:class:`trainer.rollout.base.StreamedSync`; the "state_dict"
        weight view), casting each to the module's dtype. Unknown names are an error."""
        start = time.perf_counter()
        target = self._model.state_dict()
        for bucket in buckets:
            copy_bucket(target, bucket)
        return time.perf_counter() - start

    def close(self) -> None:
        if self._owns_copy:
            del self._model

    # ------------------------------------------------------------------ internals

    def _device(self) -> torch.device:
        return next(self._model.parameters()).device

    @contextmanager
    def _generation_mode(self) -> Iterator[None]:
        # generate needs eval mode (no dropout, KV cache even with gradient checkpointing);
        # the caller's train/eval state is restored afterwards.
        was_training = self._model.training
        self._model.eval()
        try:
            yield
        finally:
            self._model.train(was_training)

    def _generate_chunk(
        self, rows: list[list[int]], max_new_tokens: int, temperature: float, greedy: bool
    ) -> list[Completion]:
        device = self._device()
        width = max(len(row) for row in rows)
        input_ids = torch.full((len(rows), width), self._pad, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):  # left padding: prompts end where generation starts
            input_ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            attention_mask[i, width - len(row) :] = 1
        # Like vLLM, a row stops when prompt + completion reaches max_model_len.
        caps = [min(max_new_tokens, self._max_model_len - len(row)) for row in rows]
        recorder = _SampledLogprobRecorder(1.0 if greedy else temperature)
        sequences = self._model.generate(  # type: ignore[operator]
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            generation_config=self._generation_config(max(caps), temperature, greedy),
            logits_processor=LogitsProcessorList([recorder]),
        )
        new_tokens = sequences[:, width:]  # [rows, steps]
        logprobs = recorder.finish(new_tokens[:, -1])  # [rows, steps]
        out = []
        for i, cap in enumerate(caps):
            out.append(
                completion_from_tokens(
                    new_tokens[i, :cap].tolist(),
                    logprobs[i, :cap].tolist(),
                    stop_token_ids=self._stop_ids,
                    max_new_tokens=cap,
                    tokenizer=self._tokenizer,
                )
            )
        return out

    def _generation_config(
        self, max_new_tokens: int, temperature: float, greedy: bool
    ) -> GenerationConfig:
        # Every field that could reshape the distribution is set explicitly: generate fills the
        # unset ones from the model's generation_config and global defaults (top_k=50).
        common = {
            "max_new_tokens": max_new_tokens,
            "min_new_tokens": 0,
            # Every end token stops a row (generate takes a list), as in the vLLM engine.
            "eos_token_id": self._stop_ids,
            "pad_token_id": self._pad,
            "num_beams": 1,
            "repetition_penalty": 1.0,
            "no_repeat_ngram_size": 0,
            "renormalize_logits": False,
        }
        if greedy:
            return GenerationConfig(do_sample=False, **common)
        return GenerationConfig(
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            typical_p=1.0,
            epsilon_cutoff=0.0,
            eta_cutoff=0.0,
            **common,
        )
