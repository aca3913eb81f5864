"""The engines of one inference process, and the answer to ``POST /engines/ensure``.

Keys and names (app.gateway.served_kinds, which the gateway reads too): a base model's engine
is keyed by the base model's name, its Hub revision and its dtype; a full fine-tune's
checkpoint, and the full checkpoint a LoRA job started from (``base_weights``), by the
checkpoint's served name and its dtype. The dtype is the job's rollout dtype unless the
operator set one (InferenceSettings.engine_dtype). LoRA adapters load into the engine of their
base; adapters of a rank past ``max_lora_rank`` are refused (422) before anything starts.

- An engine that is not running is started in the background within the memory budget
  (inference.budget); meanwhile every ensure for it answers Busy ``engine_starting``. When the
  budget is held by engines in use, Busy ``memory_budget``.
- Base models are resolved once (inference.resolve, a subprocess of seconds); meanwhile Busy
  ``engine_starting`` too.
- An adapter is loaded into its ready engine during the ensure (inference.records).
- An engine is ready once its server answers, its context is read from it and its chat
  template's traits are probed (inference.resolve, in a subprocess, while the engine starts):
  every answer for it carries both, for the gateway to write a chat as training did.
- An engine an ensure made ready is kept from eviction for ``keep_after_ensure_s``: the
  gateway's request follows the ensure and must find it (eviction never causes a 404).
- An adapter is held by each ensure until the gateway releases the hold (:meth:`release`: its
  request ended), ``keep_after_ensure_s`` at most; it counts against its project's share of
  the engine's adapter slots (``max_adapters_per_project``; the project is the request's,
  a Tinker save's own): inference.adapters says which adapter makes room, and when none may
  (Busy ``adapter_share``, a 429; ``adapter_capacity``, a 503).

Everything runs on the event loop of the control API; process starts and stops, and base
resolution, in threads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from app.core.settings import Settings
from app.gateway.engine_identity import EngineEnsureRequest
from app.gateway.protocol import (
    Busy,
    EngineState,
    EnsureResponse,
    SamplerWeightsRef,
    ServerState,
    WeightsRef,
)
from app.gateway.served_kinds import (
    FULL,
    LORA,
    ServedKind,
    engine_name,
    engine_weights,
    served_name,
)
from inference.adapters import AdapterSlots
from inference.budget import Holder, NeverFits, engine_cost, plan_evictions
from inference.checkpoints import (
    CheckpointMissing,
    CheckpointRefused,
    checkpoint_folder,
    rank_refusal,
    weight_bytes,
)
from inference.engine import Engine, EngineSpec, Launcher, engine_log_name
from inference.records import EnsureError, Record, ensure_adapter
from inference.resolve import BaseAt, BaseModelUnavailable, chat_traits, resolve_base
from inference.settings import InferenceSettings

log = logging.getLogger(__name__)

STARTING_RETRY_S = 5  # Retry-After while an engine starts (the tiny model takes ~20 s on CPU)
BUDGET_RETRY_S = 10
RESOLVE_TIMEOUT_S = 900.0  # a packaged model is built on first use (SmolLM2: a GGUF conversion)
TRAITS_TIMEOUT_S = 120.0  # importing transformers and reading a tokenizer: seconds


@dataclass(frozen=True)
class Target:
    key: str  # also the name the engine serves its weights under
    folder: Path
    dtype: str


def adapter_owner(request: EngineEnsureRequest, adapter: WeightsRef | SamplerWeightsRef) -> str:
    """The project whose share of adapter slots ``adapter`` counts against: a Tinker save's
    own project, else the project asking (a project serves only its own jobs' checkpoints);
    a request naming none (an older gateway) counts against its job alone."""
    if isinstance(adapter, SamplerWeightsRef):
        return adapter.project_id
    return request.project_id or f"job {adapter.job_id}"


class EnginePool:
    def __init__(
        self,
        settings: InferenceSettings,
        app_settings: Settings,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._app = app_settings
        self._clock = clock
        self._store = app_settings.resolved_checkpoint_dir
        self._log_dir = app_settings.data_dir / "inference" / settings.server_id
        self._launcher = Launcher()
        self._records: dict[str, Record] = {}
        self._failures: dict[str, str] = {}  # key -> why its last start failed (told once)
        # (base model, revision) -> its folder, or why it cannot be served (told once)
        self._bases: dict[BaseAt, Path | BaseModelUnavailable] = {}
        self._resolving: dict[BaseAt, asyncio.Task[None]] = {}
        self._lock = asyncio.Lock()  # budget decisions and the records map
        self._tasks: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ ensure

    async def ensure(self, request: EngineEnsureRequest) -> EnsureResponse | Busy:
        """Make the weights of ``request`` ready (or start making them ready: Busy)."""
        adapter = request.adapter
        adapter_folder = None
        if adapter is not None:  # checked before anything starts for it
            adapter_folder = self._servable_adapter(adapter)
        engine_target = await self._engine_target(request)
        if engine_target is None:
            return Busy(
                reason="engine_starting",
                detail=f"resolving base model {request.base_model}",
                retry_after_s=STARTING_RETRY_S,
            )
        ready = await self._ready_engine(engine_target)
        if isinstance(ready, Busy):
            return ready
        record, warm = ready
        if adapter is None or adapter_folder is None:
            return record.answer(engine_target.key, warm=warm)
        return await ensure_adapter(
            record,
            served_name(adapter),
            adapter_folder,
            owner=adapter_owner(request, adapter),
            clock=self._clock,
            hold_s=self.settings.keep_after_ensure_s,
        )

    def release(self, hold: str) -> bool:
        """The request that ensured ``hold`` ended: its adapter is no longer held for it. False
        when no engine knows the hold (released already, lapsed, or its adapter unloaded)."""
        now = self._clock()
        return any(record.adapters.release(hold, now) for record in self._records.values())

    async def _engine_target(self, request: EngineEnsureRequest) -> Target | None:
        """What engine serves the request (None: its base model is still being resolved)."""
        if request.full is not None and request.adapter is not None:
            raise EnsureError(422, "full and adapter exclude each other")
        dtype = self.settings.engine_dtype(request.dtype)
        key = engine_name(request, revision=request.revision, dtype=dtype)
        weights = engine_weights(request)
        if weights is not None:  # a full checkpoint's own engine
            return Target(key, self._checkpoint(weights, FULL), dtype)
        if not self.settings.serves_base(request.base_model):
            raise EnsureError(404, f"base model {request.base_model} is not served here")
        base = self._base_folder(BaseAt(request.base_model, request.revision))
        return None if base is None else Target(key, base, dtype)

    def _servable_adapter(self, adapter: WeightsRef | SamplerWeightsRef) -> Path:
        """The adapter's folder, when an engine here can ever load it (422 otherwise)."""
        folder = self._checkpoint(adapter, LORA)
        refusal = rank_refusal(folder, self.settings.max_lora_rank)
        if refusal is not None:
            raise EnsureError(422, refusal)
        return folder

    def _checkpoint(self, ref: WeightsRef | SamplerWeightsRef, kind: ServedKind) -> Path:
        try:
            return checkpoint_folder(self._store, ref, marker=kind.marker)
        except CheckpointRefused as exc:
            raise EnsureError(403, str(exc)) from exc
        except CheckpointMissing as exc:
            raise EnsureError(404, str(exc)) from exc

    def _base_folder(self, base: BaseAt) -> Path | None:
        found = self._bases.get(base)
        if isinstance(found, BaseModelUnavailable):
            del self._bases[base]  # told once; the next ensure tries again
            raise EnsureError(422, str(found))
        if found is None and base not in self._resolving:
            self._resolving[base] = self._spawn(self._resolve(base))
        return found

    async def _resolve(self, base: BaseAt) -> None:
        try:
            self._bases[base] = await asyncio.to_thread(
                resolve_base,
                base.model,
                self._app,
                revision=base.revision,
                timeout_s=RESOLVE_TIMEOUT_S,
            )
        except BaseModelUnavailable as exc:
            log.warning("inference: %s", exc)
            self._bases[base] = exc
        finally:
            self._resolving.pop(base, None)

    async def _ready_engine(self, target: Target) -> tuple[Record, bool] | Busy:
        """The ready engine of ``target`` and whether it was ready before this call, or Busy
        (it is starting: started now if it was not running)."""
        async with self._lock:
            now = self._clock()
            record = self._records.get(target.key)
            if record is not None and record.status == "ready" and not record.engine.alive():
                log.warning("inference: engine %s died; starting it again", target.key)
                self._records.pop(target.key)
                self._spawn(asyncio.to_thread(record.engine.stop))
                record = None
            if record is None:
                failure = self._failures.pop(target.key, None)
                if failure is not None:
                    raise EnsureError(502, failure)
                return await self._start(target, now)
            if record.status == "stopping":  # evicted: once it is gone, it starts again
                return Busy(
                    reason="draining",
                    detail=f"the engine of {target.key} is stopping",
                    retry_after_s=STARTING_RETRY_S,
                )
            record.last_used, record.kept_until = now, now + self.settings.keep_after_ensure_s
            if record.status == "starting":
                return Busy(
                    reason="engine_starting",
                    detail=f"the engine of {target.key} is starting",
                    retry_after_s=STARTING_RETRY_S,
                )
            return record, True

    async def _start(self, target: Target, now: float) -> Busy:
        """Plan room for the engine, and start it in the background (under ``_lock``)."""
        cost = engine_cost(
            weight_bytes=weight_bytes(target.folder),
            kv_cache_bytes=self.settings.kv_cache_bytes,
            overhead_bytes=self.settings.engine_overhead_bytes,
        )
        try:
            victims = plan_evictions(
                await self._holders(now), need=cost, budget=self.settings.memory_budget_bytes
            )
        except NeverFits as exc:
            raise EnsureError(422, f"{target.key}: {exc}") from exc
        if victims is None:
            return Busy(
                reason="memory_budget",
                detail=f"no room for the engine of {target.key}: the budget is held by engines "
                "in use",
                retry_after_s=BUDGET_RETRY_S,
            )
        stopping = [self._records[key] for key in victims]
        for victim in stopping:
            victim.status = "stopping"
            log.info("inference: evicting idle engine %s", victim.engine.spec.key)
        spec = EngineSpec(
            key=target.key,
            model_folder=target.folder,
            served_model=target.key,
            log_path=self._log_dir / engine_log_name(target.key),
            dtype=target.dtype,
        )
        record = Record(
            engine=Engine(spec, self.settings, self._launcher),
            cost=cost,
            adapters=AdapterSlots(self.settings.max_adapters, self.settings.adapter_share),
            last_used=now,
            kept_until=now + self.settings.keep_after_ensure_s,
        )
        self._records[target.key] = record
        self._spawn(self._run_start(record, stopping))
        return Busy(
            reason="engine_starting",
            detail=f"starting the engine of {target.key}",
            retry_after_s=STARTING_RETRY_S,
        )

    async def _holders(self, now: float) -> list[Holder]:
        """The engines as the budget sees them; only idle ready engines may be evicted (their
        load is read from their /metrics; one that does not answer is not evicted)."""
        holders = []
        for key, record in self._records.items():
            evictable = record.status == "ready" and record.kept_until <= now
            if evictable:
                try:
                    evictable = not (await record.engine.load()).busy
                except Exception:  # an engine that cannot tell its load is kept
                    evictable = False
            holders.append(Holder(key, record.cost, record.last_used, evictable))
        return holders

    async def _run_start(self, record: Record, stopping: list[Record]) -> None:
        key = record.engine.spec.key
        probing = asyncio.ensure_future(  # beside the start, which takes longer
            asyncio.to_thread(
                chat_traits, record.engine.spec.model_folder, timeout_s=TRAITS_TIMEOUT_S
            )
        )
        try:
            await asyncio.gather(*(self._stop(victim) for victim in stopping))
            await asyncio.to_thread(record.engine.start)
            await record.engine.wait_ready(self.settings.engine_start_timeout_s)
            record.max_model_len = await record.engine.context_length()
            record.chat_traits = await probing
        except Exception as exc:  # a start always settles: ready, or gone and its failure kept
            probing.cancel()
            log.error("inference: %s", exc)
            async with self._lock:
                self._records.pop(key, None)
                self._failures[key] = (
                    f"the engine of {key} failed to start ({type(exc).__name__}); its log is in "
                    "the inference process's data folder"
                )
            await asyncio.to_thread(record.engine.stop)
            return
        record.status = "ready"
        log.info(
            "inference: engine %s ready in %.1fs on %s",
            key,
            record.engine.ready_after_s or 0,
            record.engine.base_url,
        )

    async def _stop(self, record: Record) -> None:
        record.status = "stopping"
        await asyncio.to_thread(record.engine.stop)
        async with self._lock:
            key = record.engine.spec.key
            if self._records.get(key) is record:
                del self._records[key]

    # ------------------------------------------------------------------ state and shutdown

    async def state(self) -> ServerState:
        engines = []
        for key, record in list(self._records.items()):
            running = 0
            if record.status == "ready":
                try:
                    running = (await record.engine.load()).running
                except Exception:  # a state report never fails because of one engine
                    running = 0
            engines.append(
                EngineState(
                    key=key,
                    base_url=record.engine.base_url,
                    status=record.status,
                    adapters=record.adapters.names(),
                    memory_bytes=record.cost,
                    running_requests=running,
                )
            )
        return ServerState(
            engines=engines,
            memory_budget_bytes=self.settings.memory_budget_bytes,
            memory_used_bytes=sum(e.memory_bytes for e in engines),
            max_adapters_per_engine=self.settings.max_adapters,
            max_adapters_per_project=self.settings.adapter_share,
            max_lora_rank=self.settings.max_lora_rank,
            dtype=self.settings.dtype,
        )

    async def close(self) -> None:
        """Stop every engine (in parallel) and the background work."""
        for task in list(self._tasks):
            task.cancel()
        records = list(self._records.values())
        await asyncio.gather(*(asyncio.to_thread(r.engine.stop) for r in records))
        self._records.clear()
        self._launcher.close()

    def _spawn(self, work: Awaitable[None]) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
