"""Which LoRA adapters an engine holds, least recently used first (pure: no HTTP, no clock).

The pool loads an adapter into its engine on the first request for it; past the engine's bound
it unloads the least recently used adapter that no request is using and no recent ensure keeps.
An unloaded adapter is loaded again on its next request, so eviction costs a reload (a few
milliseconds to seconds), never a 404."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container


class AdapterSlots:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("an engine holds at least one adapter")
        self.capacity = capacity
        self._used: OrderedDict[str, float] = OrderedDict()  # name -> last use, oldest first

    def __contains__(self, name: object) -> bool:
        return name in self._used

    def __len__(self) -> int:
        return len(self._used)

    def names(self) -> list[str]:
        """Least recently used first (the order EngineState.adapters reports)."""
        return list(self._used)

    def touch(self, name: str, now: float) -> None:
        """Mark ``name`` used now (adding it)."""
        self._used[name] = now
        self._used.move_to_end(name)

    def remove(self, name: str) -> None:
        self._used.pop(name, None)

    def victim(self, *, in_use: Container[str], kept_since: float) -> str | None:
        """The adapter to unload before one more fits: None when there is room already or
        when every held adapter is in use or was used at or after ``kept_since``."""
        if len(self._used) < self.capacity:
            return None
        for name, last in self._used.items():
            if name not in in_use and last < kept_since:
                return name
        return None

    def full(self) -> bool:
        return len(self._used) >= self.capacity
