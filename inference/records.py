"""One engine as the pool keeps it (:class:`Record`): its process, its share of the budget, its
LoRA adapters, and what the gateway must know of it to write a request (its chat template's
traits and its context, read once it is up); and loading an adapter into it
(:func:`ensure_adapter`).

An adapter is loaded during the ensure (milliseconds to seconds), into a slot of the engine
within its project's share; when there is none, one that no request uses is unloaded first,
the project's own past its share, else the heaviest holder's (inference.adapters), to be
loaded again on its next ensure. Each ensure of an adapter holds it until the gateway releases
the hold (its request ended), or ``hold_s`` at most."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx

from app.gateway.protocol import Busy, EnsureResponse
from inference.adapters import AdapterSlots, AllPinned, Evict, OverShare
from inference.engine import Engine, EngineFailed, EngineRefused
from jobspec.prompt_format import TemplateTraits

log = logging.getLogger(__name__)

# Retry-After when every adapter slot the request could take is in use: requests end within
# seconds (a chat of the tiny model in milliseconds), and the openai SDK waits it out itself.
ADAPTER_RETRY_S = 2


class EnsureError(Exception):
    """An ensure that no retry will fix; ``status`` is its HTTP status."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


@dataclass
class Record:
    engine: Engine
    cost: int
    adapters: AdapterSlots
    status: Literal["starting", "ready", "stopping"] = "starting"
    last_used: float = 0.0
    kept_until: float = 0.0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    chat_traits: TemplateTraits | None = None  # set before the engine is ready
    max_model_len: int | None = None  # likewise

    def answer(self, served_model: str, *, warm: bool, hold: str | None = None) -> EnsureResponse:
        """The ensure answer for ``served_model`` (the engine's own weights, or an adapter
        held by ``hold``)."""
        return EnsureResponse(
            base_url=self.engine.base_url,
            served_model=served_model,
            warm=warm,
            chat_traits=self.chat_traits,
            max_model_len=self.max_model_len,
            hold=hold,
        )


async def ensure_adapter(
    record: Record,
    name: str,
    folder: Path,
    *,
    owner: str,
    clock: Callable[[], float],
    hold_s: float,
) -> EnsureResponse | Busy:
    """Adapter ``name`` (at ``folder``, of project ``owner``) loaded into ``record``'s ready
    engine and held for the request that asked (the answer's ``hold``); Busy when the slots
    it could take are all in use (``adapter_share``: its project's, a 429;
    ``adapter_capacity``: the engine's, a 503); EnsureError when the engine refuses it (422)
    or fails (502)."""
    slots = record.adapters
    async with record.lock:
        warm = name in slots
        if warm:
            slots.use(name, slots.owner_of(name) or owner, clock())
        else:
            busy = await _make_room(record, owner, clock())
            if busy is not None:
                return busy
            await _load(record.engine, name, folder)
            slots.use(name, owner, clock())
        hold = secrets.token_hex(16)
        slots.hold(name, hold, until=clock() + hold_s)
        return record.answer(name, warm=warm, hold=hold)


async def _make_room(record: Record, owner: str, now: float) -> Busy | None:
    """Unload the adapter the slot policy picks, if one must go; Busy when none may."""
    slots, engine = record.adapters, record.engine
    in_use: frozenset[str] = frozenset()
    if slots.needs_eviction(owner):
        try:
            in_use = (await engine.load()).adapters_in_use
        except (httpx.HTTPError, ValueError) as exc:  # nothing is unloaded blind
            log.warning("inference: %s did not tell its load: %r", engine.spec.key, exc)
            return Busy(
                reason="adapter_capacity",
                detail=f"the engine of {engine.spec.key} did not say which adapters its "
                "requests use; retry after the wait",
                retry_after_s=ADAPTER_RETRY_S,
            )
    decision = slots.make_room(owner, now=now, in_use=in_use)
    if isinstance(decision, OverShare):
        return Busy(
            reason="adapter_share",
            detail=f"this project holds {decision.held} of the {slots.capacity} adapter slots "
            f"of the engine of {engine.spec.key}, its share "
            f"(GRPO_INFERENCE_MAX_ADAPTERS_PER_PROJECT={decision.share}), and its requests in "
            "flight use every one; retry when one of them ends",
            retry_after_s=ADAPTER_RETRY_S,
        )
    if isinstance(decision, AllPinned):
        return Busy(
            reason="adapter_capacity",
            detail=f"requests in flight use every one of the {decision.capacity} adapter slots "
            f"of the engine of {engine.spec.key} (GRPO_INFERENCE_MAX_ADAPTERS); retry when one "
            "ends",
            retry_after_s=ADAPTER_RETRY_S,
        )
    if isinstance(decision, Evict):
        await _unload(engine, decision.name)
        slots.remove(decision.name)
        log.info(
            "inference: unloaded adapter %s (project %s) from %s",
            decision.name,
            decision.owner,
            engine.spec.key,
        )
    return None


async def _unload(engine: Engine, name: str) -> None:
    try:
        await engine.unload_adapter(name)
    except EngineRefused as exc:  # vLLM does not have it (any more): its slot is free anyway
        log.warning("inference: %s refused to unload %s: %s", engine.spec.key, name, exc)
    except (EngineFailed, httpx.HTTPError) as exc:
        log.warning("inference: unloading %s from %s failed: %r", name, engine.spec.key, exc)
        raise EnsureError(502, f"the engine failed to unload adapter {name}") from exc


async def _load(engine: Engine, name: str, folder: Path) -> None:
    try:
        await engine.load_adapter(name, folder)
    except EngineRefused as exc:  # for good (adapters of another architecture)
        # vLLM's message names the folder: the client sees the adapter's name instead.
        why = str(exc).replace(str(folder), name)
        raise EnsureError(422, f"vLLM refused the adapters: {why}") from exc
    except (EngineFailed, httpx.HTTPError) as exc:  # the engine failed: a retry may not
        log.warning("inference: loading %s into %s failed: %r", name, engine.spec.key, exc)
        raise EnsureError(502, f"the engine failed to load adapter {name}") from exc
