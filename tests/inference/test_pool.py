"""The pool's decisions with stand-in engines (no processes): Busy while starting, eviction
within the budget, Busy memory_budget when the engines in use hold it, a failed start told once,
a dead engine started again, adapters evicted and reloaded; each job's engine in its rollout
dtype and at its base model's revision (the command line built as a CUDA host would run it),
adapters past the tier's rank refused."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import pytest

from app.core.settings import build_settings
from app.gateway.engine_identity import EngineEnsureRequest
from app.gateway.protocol import Busy, EnsureResponse
from inference import pool as pool_module
from inference.engine import EngineFailed, EngineSpec, server_command
from inference.metrics import EngineLoad
from inference.pool import EnginePool
from inference.process import preload_base
from inference.records import EnsureError
from inference.resolve import resolve_base
from inference.settings import build_inference_settings
from jobspec.prompt_format import TemplateTraits
from tests.hub_cache import add_snapshot

T = TypeVar("T")
CONTEXT = 640  # what every stand-in engine says its context is
# The traits the stand-in probe finds in every folder but those named in PROBE_FAILS.
TRAITS = TemplateTraits(native_tools=False, tool_role=True)
PROBE_FAILS: set[str] = set()
WEIGHTS = 1000
ENGINE = WEIGHTS + 100 + 10  # weights + KV cache + overhead, as configured below


class StandInEngine:
    """Engine's surface; class attributes steer every instance."""

    fail_start: ClassVar[bool] = False
    running: ClassVar[dict[str, int]] = {}
    adapters_in_use: ClassVar[frozenset[str]] = frozenset()  # what /metrics says requests use
    instances: ClassVar[list[StandInEngine]] = []

    def __init__(self, spec: EngineSpec, settings: Any, launcher: Any) -> None:
        self.spec = spec
        self.started = self.stopped = False
        self.adapters: list[str] = []
        self.base_url = f"http://engine/{spec.key}"
        self.ready_after_s = 0.0
        StandInEngine.instances.append(self)

    def alive(self) -> bool:
        return self.started and not self.stopped

    def start(self) -> None:
        self.started = True

    async def wait_ready(self, timeout_s: float) -> None:
        if StandInEngine.fail_start:
            raise EngineFailed("exited with 1")

    async def load(self) -> EngineLoad:
        return EngineLoad(
            StandInEngine.running.get(self.spec.key, 0), 0, StandInEngine.adapters_in_use
        )

    async def context_length(self) -> int | None:
        return CONTEXT

    async def load_adapter(self, name: str, folder: Path) -> None:
        self.adapters.append(name)

    async def unload_adapter(self, name: str) -> None:
        self.adapters.remove(name)

    def stop(self) -> None:
        self.stopped = True


@pytest.fixture
def make_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., EnginePool]:
    StandInEngine.fail_start, StandInEngine.running, StandInEngine.instances = False, {}, []
    StandInEngine.adapters_in_use = frozenset()
    monkeypatch.setattr(pool_module, "Engine", StandInEngine)
    base = tmp_path / "base"
    base.mkdir()
    (base / "model.safetensors").write_bytes(b"w" * WEIGHTS)
    monkeypatch.setattr(pool_module, "resolve_base", lambda model, settings, **_: base)
    PROBE_FAILS.clear()
    monkeypatch.setattr(
        pool_module,
        "chat_traits",
        lambda folder, **_: None if folder.parent.name in PROBE_FAILS else TRAITS,
    )
    store = tmp_path / "data" / "checkpoints"
    for job in ("job_f1", "job_f2", "job_f3"):
        folder = store / job / "checkpoint-000001"
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(b"w" * WEIGHTS)
    for job in ("job_a", "job_b", "job_c"):
        folder = store / job / "checkpoint-000001"
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text("{}")

    def make(clock: Callable[[], float] = time.monotonic, **overrides: Any) -> EnginePool:
        given: dict[str, Any] = {
            "bases": "tiny",
            "kv_cache_bytes": 100,
            "engine_overhead_bytes": 10,
            "memory_budget_bytes": 2 * ENGINE,
            "max_adapters": 2,
            "keep_after_ensure_s": 0,
        }
        settings = build_inference_settings(**{**given, **overrides})
        return EnginePool(settings, build_settings(data_dir=tmp_path / "data"), clock=clock)

    return make


def full(job: str) -> EngineEnsureRequest:
    return EngineEnsureRequest(
        base_model="tiny", full={"job_id": job, "folder": "checkpoint-000001"}
    )


def adapter(job: str) -> EngineEnsureRequest:
    return EngineEnsureRequest(
        base_model="tiny", adapter={"job_id": job, "folder": "checkpoint-000001"}
    )


async def until_ready(
    pool: EnginePool, request: EngineEnsureRequest, tries: int = 500
) -> EnsureResponse:
    """Ensure until an answer other than Busy engine_starting (the start runs as a task)."""
    for _ in range(tries):  # the start's steps run in threads: poll, 10 ms apart
        answer = await pool.ensure(request)
        if isinstance(answer, EnsureResponse):
            return answer
        assert answer.reason == "engine_starting", answer
        await asyncio.sleep(0.01)
    raise AssertionError(f"{request} never ready")


def run(work: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(work())  # type: ignore[arg-type]


def test_a_base_is_busy_while_resolving_and_starting_then_ready(
    make_pool: Callable[..., EnginePool],
) -> None:
    async def scenario() -> None:
        pool = make_pool()
        first = await pool.ensure(EngineEnsureRequest(base_model="tiny"))
        assert isinstance(first, Busy) and first.reason == "engine_starting"
        ready = await until_ready(pool, EngineEnsureRequest(base_model="tiny"))
        assert ready.served_model == "tiny" and ready.warm
        state = await pool.state()
        assert [e.key for e in state.engines] == ["tiny"] and state.memory_used_bytes == ENGINE

    run(scenario)


def test_the_idle_engine_used_longest_ago_makes_room(make_pool: Callable[..., EnginePool]) -> None:
    async def scenario() -> None:
        pool = make_pool()
        await until_ready(pool, full("job_f1"))
        await until_ready(pool, full("job_f2"))
        await until_ready(pool, full("job_f1"))  # f1 is now the more recent
        await until_ready(pool, full("job_f3"))
        keys = {e.key for e in (await pool.state()).engines}
        assert keys == {"job_f1/checkpoint-000001", "job_f3/checkpoint-000001"}
        assert [e.spec.key for e in StandInEngine.instances if e.stopped] == [
            "job_f2/checkpoint-000001"
        ]

    run(scenario)


def test_engines_in_use_hold_the_budget(make_pool: Callable[..., EnginePool]) -> None:
    async def scenario() -> None:
        pool = make_pool()
        await until_ready(pool, full("job_f1"))
        await until_ready(pool, full("job_f2"))
        StandInEngine.running = {"job_f1/checkpoint-000001": 1, "job_f2/checkpoint-000001": 3}
        busy = await pool.ensure(full("job_f3"))
        assert isinstance(busy, Busy) and busy.reason == "memory_budget"
        StandInEngine.running = {"job_f1/checkpoint-000001": 1}
        await until_ready(pool, full("job_f3"))  # f2 went idle: it makes room

    run(scenario)


def test_an_engine_larger_than_the_budget_is_refused(make_pool: Callable[..., EnginePool]) -> None:
    async def scenario() -> None:
        pool = make_pool(memory_budget_bytes=ENGINE - 1)
        with pytest.raises(EnsureError) as refused:
            await pool.ensure(full("job_f1"))
        assert refused.value.status == 422

    run(scenario)


def test_a_failed_start_is_told_once_then_tried_again(make_pool: Callable[..., EnginePool]) -> None:
    async def scenario() -> None:
        pool = make_pool()
        StandInEngine.fail_start = True
        assert isinstance(await pool.ensure(full("job_f1")), Busy)
        with pytest.raises(EnsureError) as failed:
            await until_ready(pool, full("job_f1"))
        assert failed.value.status == 502
        StandInEngine.fail_start = False
        await until_ready(pool, full("job_f1"))

    run(scenario)


def test_a_dead_engine_is_started_again(make_pool: Callable[..., EnginePool]) -> None:
    async def scenario() -> None:
        pool = make_pool()
        await until_ready(pool, full("job_f1"))
        StandInEngine.instances[0].stopped = True  # it died
        again = await pool.ensure(full("job_f1"))
        assert isinstance(again, Busy) and again.reason == "engine_starting"
        await until_ready(pool, full("job_f1"))
        assert len(StandInEngine.instances) == 2

    run(scenario)


def test_adapters_past_the_bound_are_unloaded_and_loaded_again(
    make_pool: Callable[..., EnginePool],
) -> None:
    async def scenario() -> None:
        pool = make_pool()
        first = await until_ready(pool, adapter("job_a"))
        assert first.served_model == "job_a/checkpoint-000001" and not first.warm
        assert (await pool.ensure(adapter("job_a"))).warm  # type: ignore[union-attr]
        await pool.ensure(adapter("job_b"))
        await pool.ensure(adapter("job_c"))
        [engine] = StandInEngine.instances
        assert engine.adapters == ["job_b/checkpoint-000001", "job_c/checkpoint-000001"]
        back = await pool.ensure(adapter("job_a"))
        assert isinstance(back, EnsureResponse) and not back.warm
        assert engine.adapters == ["job_c/checkpoint-000001", "job_a/checkpoint-000001"]

    run(scenario)


def test_every_answer_carries_its_engines_chat_traits_and_context(
    make_pool: Callable[..., EnginePool],
) -> None:
    """The gateway writes a chat with tools by the traits, and bounds a chat's tokens by the
    context: each ensure answer of an engine holds them, an adapter's its engine's; a folder
    whose probe failed answers with no traits (the gateway then refuses tools)."""

    async def scenario() -> None:
        pool = make_pool()
        PROBE_FAILS.add("job_f2")
        answers = [
            await until_ready(pool, EngineEnsureRequest(base_model="tiny")),
            await until_ready(pool, adapter("job_a")),  # loaded now
            await until_ready(pool, adapter("job_a")),  # warm
        ]
        for answer in answers:
            assert (answer.chat_traits, answer.max_model_len) == (TRAITS, CONTEXT), answer
        unprobed = await until_ready(pool, full("job_f2"))
        assert (unprobed.chat_traits, unprobed.max_model_len) == (None, CONTEXT)

    run(scenario)


def test_an_adapter_of_a_job_started_from_a_checkpoint_loads_into_that_checkpoints_engine(
    make_pool: Callable[..., EnginePool],
) -> None:
    async def scenario() -> None:
        pool = make_pool()
        request = EngineEnsureRequest(
            base_model="tiny",
            base_weights={"job_id": "job_f1", "folder": "checkpoint-000001"},
            adapter={"job_id": "job_a", "folder": "checkpoint-000001"},
        )
        ready = await until_ready(pool, request)
        assert ready.served_model == "job_a/checkpoint-000001"
        [engine] = StandInEngine.instances
        assert engine.spec.key == "job_f1/checkpoint-000001"
        assert engine.adapters == ["job_a/checkpoint-000001"]

    run(scenario)


def test_a_preloaded_base_is_up_before_its_first_adapter_is_asked_for(
    make_pool: Callable[..., EnginePool],
) -> None:
    """`preload` (what the demo sets): the process starts the base's engine itself, so a LoRA
    job's first request loads its adapter into a running engine instead of answering 503."""

    async def scenario() -> None:
        pool = make_pool(preload="tiny")
        await asyncio.wait_for(preload_base(pool, "tiny", poll_s=0.01), timeout=5)
        assert [(e.key, e.status) for e in (await pool.state()).engines] == [("tiny", "ready")]
        first = await pool.ensure(adapter("job_a"))
        assert isinstance(first, EnsureResponse), first
        assert first.served_model == "job_a/checkpoint-000001" and not first.warm

    run(scenario)


def test_preload_names_only_bases_served_here() -> None:
    with pytest.raises(ValueError, match="preload names bases not in `bases`: other"):
        build_inference_settings(bases="tiny", preload="tiny, other")
    assert build_inference_settings(bases="tiny", preload="tiny").preload_list == ["tiny"]


# ---------------------------------------------------------------- issue 32: served as trained


def _option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_on_a_gpu_each_job_is_served_in_its_rollout_dtype_unless_the_operator_says(
    make_pool: Callable[..., EnginePool],
) -> None:
    """vLLM's `--dtype auto` would serve a float32 checkpoint in bfloat16 on a GPU while the
    job's rollouts ran in float32: each engine runs in its job's rollout dtype (jobs of two
    dtypes get two engines); GRPO_INFERENCE_DTYPE overrides it. The command line is what a
    CUDA host would run (built here, on a CPU)."""

    async def scenario(**settings: Any) -> dict[str, list[str]]:
        StandInEngine.instances = []
        pool = make_pool(devices="cuda:0", worker_devices="none", **settings)
        await until_ready(pool, adapter("job_a"))  # a job of the default rollout dtype
        bf16 = EngineEnsureRequest(
            base_model="tiny",
            adapter={"job_id": "job_b", "folder": "checkpoint-000001"},
            dtype="bfloat16",
        )
        await until_ready(pool, bf16)
        return {
            e.spec.key: server_command(e.spec, pool.settings, 8000) for e in StandInEngine.instances
        }

    commands = run(scenario)
    assert {key: _option(c, "--dtype") for key, c in commands.items()} == {
        "tiny": "float32",
        "tiny#bfloat16": "bfloat16",
    }
    # Sampling defaults are vLLM's, never the folder's generation_config.json.
    assert all(_option(c, "--generation-config") == "vllm" for c in commands.values())
    operator = run(lambda: scenario(dtype="auto"))
    assert {_option(c, "--dtype") for c in operator.values()} == {"auto"}


def test_adapters_of_a_rank_past_the_tiers_are_refused_before_anything_starts(
    make_pool: Callable[..., EnginePool], tmp_path: Path
) -> None:
    folder = tmp_path / "data" / "checkpoints" / "job_r128" / "checkpoint-000001"
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "rank_pattern": {"q": 128}}))

    async def scenario() -> None:
        pool = make_pool(max_lora_rank=64)
        request = EngineEnsureRequest(
            base_model="tiny", adapter={"job_id": "job_r128", "folder": "checkpoint-000001"}
        )
        with pytest.raises(EnsureError) as refused:
            await pool.ensure(request)
        assert refused.value.status == 422
        assert refused.value.detail == (
            "its LoRA rank is 128, larger than the 64 the inference tier serves "
            "(GRPO_INFERENCE_MAX_LORA_RANK)"
        )
        assert StandInEngine.instances == []  # nothing started for it

    run(scenario)


@pytest.mark.process
def test_a_lora_jobs_base_is_resolved_at_the_jobs_revision(
    make_pool: Callable[..., EnginePool], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real resolution (inference.resolve's subprocess, trainer.models.loading) in a real
    Hugging Face cache layout: `main` and `v2` are two commits of one repo, and a job trained
    at `v2` gets an engine of v2's snapshot, not main's."""
    from trainer.models.loading import resolve_model  # torch: only in this test

    hub = tmp_path / "hub"
    tiny = resolve_model("tiny-random-llama")
    main_snapshot = add_snapshot(hub, "acme/tiny", tiny, "a" * 40, branches=["main"], link=True)
    v2_snapshot = add_snapshot(hub, "acme/tiny", tiny, "b" * 40, branches=["v2"], link=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(pool_module, "resolve_base", resolve_base)  # the real one

    async def scenario() -> dict[str, Path]:
        pool = make_pool(bases="acme/tiny", memory_budget_bytes=10**9)
        at_v2 = EngineEnsureRequest(
            base_model="acme/tiny",
            adapter={"job_id": "job_a", "folder": "checkpoint-000001"},
            revision="v2",
        )
        at_main = EngineEnsureRequest(base_model="acme/tiny")
        for request in (at_v2, at_main):
            await until_ready(pool, request, tries=6000)  # each resolution starts a python
        return {e.spec.key: e.spec.model_folder for e in StandInEngine.instances}

    assert run(scenario) == {"acme/tiny@v2": v2_snapshot, "acme/tiny": main_snapshot}
