"""The engine side of a rollout server (:mod:`trainer.rollout.rollout_server`): its config
(:class:`RolloutServerConfig`, the JSON file the client writes), the engine built as the run
builds its own, and the rule by which each call gets the policy version it names. Apart from
HTTP so the rule reads (and is tested) on its own.

Version rule: the engine starts with the model folder's weights, version ``base_version``. A
call naming ``v`` loads the published files of ``v`` (:mod:`trainer.rollout.weight_versions`)
when the engine holds another version, or holds ``v`` from the folder (published files win);
the folder's weights again for ``base_version`` when nothing of it was published; any other
version is :class:`VersionUnavailable` (409). The load and the generation run under one lock,
so callers interleaving versions (a producer on an older one, evaluation of the newest) each
get the version they name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer.rollout.base import PrefillCounts, RolloutEngine, torch_dtype
from trainer.rollout.weight_versions import (
    MANIFEST,
    adapter_config,
    published_buckets,
    version_folder,
)

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "RolloutServerConfig",
    "RolloutService",
    "VersionUnavailable",
    "build_engine",
]

DEFAULT_MAX_BODY_BYTES = 64 << 20  # a step's prompts as JSON token ids fit many times over


@dataclass
class RolloutServerConfig:
    """What the server builds its engine from (the arguments of
    :func:`trainer.rollout.registry.make_engine`), and, filled in by the client at each start,
    where it finds the published weights, where it says it is ready and its secret."""

    engine: str  # a key of trainer.rollout.registry.ROLLOUT_ENGINES
    model_path: str
    tokenizer_path: str
    dtype: str
    max_model_len: int
    kv_cache_bytes: int | None = None
    kv_block_tokens: int | None = None
    stop_token_ids: list[int] | None = None  # None: every end token the model declares
    lora_rank: int | None = None  # serve LoRA adapters (vllm, rollout.lora_sync "adapter")
    engine_options: dict[str, Any] = field(default_factory=dict)  # JSON values; not "device"
    device: str = "cpu"
    threads: int | None = None  # torch (and OpenMP) threads of the server
    cpus: list[int] | None = None  # the cores the server may run on (None: any)
    base_version: int | None = 0  # the version the model folder's weights are (None: none)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    weights_dir: str = ""
    ready_file: str = ""
    secret: str = ""
    parent_pid: int | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RolloutServerConfig:
        return cls(**json.loads(text))


class VersionUnavailable(Exception):
    """A call named a version the server can neither find published nor has loaded."""


def build_engine(config: RolloutServerConfig) -> RolloutEngine:
    """The engine of ``config``, built as the run builds its own (make_engine); an engine that
    generates with a module (transformers) gets the folder's model, loaded in its dtype."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jobspec.traits import ROLLOUT_ENGINE_TRAITS
    from trainer.rollout.registry import make_engine

    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path, local_files_only=True)
    tokenizer.padding_side = "left"  # as trainer.models.loading.load_policy sets it
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    device = torch.device(config.device)
    policy = None
    if not ROLLOUT_ENGINE_TRAITS[config.engine].loads_folder:  # type: ignore[index]
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            config.model_path, dtype=torch_dtype(config.dtype), local_files_only=True
        )
        policy = loaded.to(device)
    return make_engine(
        config.engine,  # type: ignore[arg-type]
        Path(config.model_path),
        tokenizer,
        dtype=config.dtype,
        max_model_len=config.max_model_len,
        policy_model=policy,
        kv_cache_bytes=config.kv_cache_bytes,
        kv_block_tokens=config.kv_block_tokens,
        stop_token_ids=config.stop_token_ids,
        lora_rank=config.lora_rank,
        engine_options={**config.engine_options, "device": device},
    )


class RolloutService:
    """The engine behind the HTTP layer: one engine call at a time (its lock), each at the
    version the call names. Kept apart from HTTP so the version rule reads on its own."""

    def __init__(self, config: RolloutServerConfig, engine: RolloutEngine) -> None:
        self.config = config
        self.engine = engine
        self.version = config.base_version  # what the engine holds; None while loading
        self._from_files = False  # the held version came from published files
        self._lock = threading.Lock()
        self._counts = threading.Lock()
        self.in_flight = 0
        self.generate_calls = 0
        self._block: str | None = None
        self._block_scope = contextlib.ExitStack()

    def health(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "pid": os.getpid(),
            "max_model_len": getattr(self.engine, "max_model_len", self.config.max_model_len),
            "stop_token_ids": getattr(self.engine, "stop_token_ids", None),
            "prefill": isinstance(getattr(self.engine, "prefill", None), PrefillCounts),
            "threads": torch.get_num_threads(),
            "cpus": sorted(os.sched_getaffinity(0)),
            "in_flight": self.in_flight,
            "generate_calls": self.generate_calls,
        }

    def load(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self._ensure_version(_int(body, "version"))
            return {"version": self.version}

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        """Load the named version when another is held, then generate (one lock for both)."""
        prompts = body.get("prompts")
        if not isinstance(prompts, list) or not all(
            isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompts
        ):
            raise ValueError("prompts must be a list of lists of token ids")
        block = body.get("cache_block")
        with self._lock:
            version = self._ensure_version(_int(body, "version"))
            self._enter_block(block if isinstance(block, str) else None)
            prefill = getattr(self.engine, "prefill", None)
            before = dataclasses.replace(prefill) if isinstance(prefill, PrefillCounts) else None
            groups = self.engine.generate(
                prompts,
                _int(body, "n"),
                max_new_tokens=_int(body, "max_new_tokens"),
                temperature=float(body["temperature"]),
                seed=_int(body, "seed"),
                greedy=bool(body.get("greedy", False)),
            )
        completions = [
            [{**asdict(c), "policy_version": version} for c in group] for group in groups
        ]
        counted = None
        if isinstance(prefill, PrefillCounts) and before is not None:
            counted = {
                "prompt_tokens": prefill.prompt_tokens - before.prompt_tokens,
                "cached_tokens": prefill.cached_tokens - before.cached_tokens,
            }
        return {"completions": completions, "policy_version": version, "prefill": counted}

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Counts a generate call from its arrival to its answer (``in_flight`` in health)."""
        with self._counts:
            self.in_flight += 1
            self.generate_calls += 1
        try:
            yield
        finally:
            with self._counts:
                self.in_flight -= 1

    def close(self) -> None:
        """Close the engine unless a call still runs (the process is ending either way)."""
        if self._lock.acquire(timeout=5.0):
            self._block_scope.close()
            self.engine.close()

    def _ensure_version(self, version: int) -> int:
        """Make the engine hold ``version``: its published files (which win over the folder's
        weights), else the folder's weights for ``base_version``; else VersionUnavailable."""
        folder = version_folder(Path(self.config.weights_dir), version)
        if (folder / MANIFEST).is_file():
            if self.version != version or not self._from_files:
                self._load(version, True, lambda: self._load_folder(folder))
        elif self.version != version:
            if version != self.config.base_version:
                raise VersionUnavailable(f"version {version} is not published")
            self._load(version, False, self._load_base)
        return version

    def _load(self, version: int, from_files: bool, load: Callable[[], None]) -> None:
        self.version = None  # a load that fails half-way leaves no version claimed
        load()
        self.version, self._from_files = version, from_files

    def _load_folder(self, folder: Path) -> None:
        self._streamed().load_weight_buckets(published_buckets(folder), adapter_config(folder))

    def _load_base(self) -> None:
        """The model folder's own weights again (the base version after another was loaded):
        the folder's model in the engine's dtype, every state_dict name (a tied head too)."""
        from jobspec.traits import ROLLOUT_ENGINE_TRAITS

        traits = ROLLOUT_ENGINE_TRAITS[self.config.engine]  # type: ignore[index]
        if self.config.lora_rank is not None and traits.serves_lora_adapters:
            raise VersionUnavailable(
                "an adapter engine cannot drop its adapter: publish the base version's adapter"
            )
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            self.config.model_path, dtype=torch_dtype(self.config.dtype), local_files_only=True
        )
        self._streamed().load_weight_buckets([list(model.state_dict().items())])

    def _streamed(self) -> Any:
        load = getattr(self.engine, "load_weight_buckets", None)
        if not callable(load):
            raise RuntimeError(f"{type(self.engine).__name__} does not take weight buckets")
        return self.engine

    def _enter_block(self, block: str | None) -> None:
        """Keep the engine's prefix cache between calls of one block (one client scope)."""
        if block == self._block:
            return
        self._block_scope.close()
        self._block = block
        keep = getattr(self.engine, "keep_prefix_cache", None)
        if block is not None and callable(keep):
            self._block_scope.enter_context(keep())


def _int(body: dict[str, Any], key: str) -> int:
    value = body.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    return value
