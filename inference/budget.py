"""The memory arithmetic of an inference process (pure: no processes, no clocks).

An engine's cost is estimated before it starts, from what it will hold: its weights (the bytes
of the safetensors files it loads), its KV cache (``--kv-cache-memory-bytes``, fixed per engine)
and a per-process overhead (Python, torch, the server, vLLM's buffers; measured, see
inference.settings.DEFAULT_ENGINE_OVERHEAD_BYTES). The engines' costs must sum to at most the
budget. To make room, the least recently used engines that may go (no running or waiting
requests, not starting, not just ensured) are stopped, oldest first, until the new one fits.
"""

from __future__ import annotations

from dataclasses import dataclass


def engine_cost(*, weight_bytes: int, kv_cache_bytes: int, overhead_bytes: int) -> int:
    return weight_bytes + kv_cache_bytes + overhead_bytes


@dataclass(frozen=True)
class Holder:
    """An engine as the budget sees it."""

    key: str
    cost: int
    last_used: float  # a monotonic time: smaller is older
    evictable: bool  # idle, ready and not kept by a recent ensure


class NeverFits(Exception):
    """The engine alone costs more than the whole budget."""


def plan_evictions(holders: list[Holder], *, need: int, budget: int) -> list[str] | None:
    """The keys to stop, least recently used first, so that ``need`` more bytes fit in
    ``budget``; [] when they fit already; None when even stopping every evictable engine would
    not make room (the caller answers Busy memory_budget). Raises NeverFits when ``need``
    exceeds the budget itself."""
    if need > budget:
        raise NeverFits(f"an engine estimated at {need} bytes exceeds the budget of {budget}")
    free = budget - sum(h.cost for h in holders)
    victims: list[str] = []
    for holder in sorted((h for h in holders if h.evictable), key=lambda h: h.last_used):
        if free >= need:
            break
        victims.append(holder.key)
        free += holder.cost
    return victims if free >= need else None
