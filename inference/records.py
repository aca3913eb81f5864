"""One engine as the pool keeps it (:class:`Record`): its process, its share of the budget, its
LoRA adapters, and what the gateway must know of it to write a request (its chat template's
traits and its context, read once it is up); and loading an adapter into it
(:func:`ensure_adapter`).

An adapter is loaded during the ensure (milliseconds to seconds); past the engine's bound the
least recently used one that no request is using, and no recent ensure keeps, is unloaded
first (inference.adapters), to be loaded again on its next ensure."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx

from app.inference.protocol import Busy, EnsureResponse
from inference.adapters import AdapterSlots
from inference.engine import Engine, EngineFailed, EngineRefused
from jobspec.prompt_format import TemplateTraits

log = logging.getLogger(__name__)

ADAPTER_RETRY_S = 1


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

    def answer(self, served_model: str, *, warm: bool) -> EnsureResponse:
        """The ensure answer for ``served_model`` (the engine's own weights, or an adapter)."""
        return EnsureResponse(
            base_url=self.engine.base_url,
            served_model=served_model,
            warm=warm,
            chat_traits=self.chat_traits,
            max_model_len=self.max_model_len,
        )


async def ensure_adapter(
    record: Record, name: str, folder: Path, *, clock: Callable[[], float], keep_s: float
) -> EnsureResponse | Busy:
    """Adapter ``name`` (at ``folder``) loaded into ``record``'s ready engine; Busy when every
    slot is in use; EnsureError when the engine refuses it (422) or fails (502)."""
    engine = record.engine
    async with record.lock:
        now = clock()
        if name in record.adapters:
            record.adapters.touch(name, now)
            return record.answer(name, warm=True)
        if record.adapters.full():
            victim = record.adapters.victim(
                in_use=(await engine.load()).adapters_in_use, kept_since=now - keep_s
            )
            if victim is None:
                return Busy(
                    reason="adapter_loading",
                    detail=f"every adapter slot of {engine.spec.key} is in use",
                    retry_after_s=ADAPTER_RETRY_S,
                )
            await engine.unload_adapter(victim)
            record.adapters.remove(victim)
            log.info("inference: unloaded adapter %s from %s", victim, engine.spec.key)
        try:
            await engine.load_adapter(name, folder)
        except EngineRefused as exc:  # for good (adapters of another architecture)
            # vLLM's message names the folder: the client sees the adapter's name instead.
            why = str(exc).replace(str(folder), name)
            raise EnsureError(422, f"vLLM refused the adapters: {why}") from exc
        except (EngineFailed, httpx.HTTPError) as exc:  # the engine failed: a retry may not
            log.warning("inference: loading %s into %s failed: %r", name, engine.spec.key, exc)
            raise EnsureError(502, f"the engine failed to load adapter {name}") from exc
        record.adapters.touch(name, clock())
        return record.answer(name, warm=False)
