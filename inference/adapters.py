"""Which LoRA adapters an engine holds, and which one gives up its slot for another (pure: no
HTTP, no clock; the caller passes the time and what vLLM says its requests use).

An engine holds at most ``capacity`` adapters (GRPO_INFERENCE_MAX_ADAPTERS), shared by every
project whose adapters load into it: a Tinker client's sampler saves and a LoRA job's
checkpoints alike. Plain LRU with a keep-window renewed by each request let one busy project
keep every slot and answer everyone else 503. So:

- **Share.** Each adapter has an owner (its project). A project holds at most ``share`` slots
  (GRPO_INFERENCE_MAX_ADAPTERS_PER_PROJECT): past it, its new adapter replaces one of its own,
  and when requests use every one of its own it waits (:class:`OverShare`, a 429), however
  many slots are free. The rest of the engine stays for the other projects.
- **Pins.** An adapter is pinned while a request uses it, and only then: each ensure takes a
  *hold* on it, which the gateway releases when its request ends, however it ends; a hold the
  gateway never releases (it crashed) lapses at its deadline. vLLM's own count of the requests
  it runs with an adapter (``in_use``, from its /metrics) pins it too, so a request that
  outlives its hold's deadline still keeps it. A finished request pins nothing: no window a
  busy project could keep renewing.
- **Eviction.** When the engine is full, the adapter to unload is the least recently used
  unpinned one of the project holding the most slots (among projects with an unpinned
  adapter; a tie goes to the adapter used longest ago): the heaviest holder pays first.
- **All pinned.** When requests use every adapter of the engine there is nothing to unload
  (:class:`AllPinned`, a 503 with Retry-After): a request ending frees one.

An unloaded adapter is loaded again on its next ensure: eviction costs a reload (milliseconds
to seconds), never a 404.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Collection
from dataclasses import dataclass


def default_share(capacity: int) -> int:
    """A project's share when the operator sets none: half the engine's slots, rounded up, so
    two projects can each hold their share and a single project still gets most of a small
    engine (1 of 1, 1 of 2, 2 of 3, 4 of 8)."""
    return max(1, math.ceil(capacity / 2))


@dataclass(frozen=True)
class Fits:
    """A free slot is there for the new adapter, within its project's share."""


@dataclass(frozen=True)
class Evict:
    """Unload ``name`` (of project ``owner``) first; its slot is then the new adapter's."""

    name: str
    owner: str


@dataclass(frozen=True)
class OverShare:
    """``owner`` holds ``held`` slots, its whole ``share``, and requests use every one of its
    adapters: it waits for one of its own requests to end."""

    owner: str
    held: int
    share: int


@dataclass(frozen=True)
class AllPinned:
    """Requests use every one of the engine's ``capacity`` adapters."""

    capacity: int


RoomDecision = Fits | Evict | OverShare | AllPinned


@dataclass
class _Slot:
    owner: str
    last_used: float


class AdapterSlots:
    def __init__(self, capacity: int, share: int | None = None) -> None:
        if capacity < 1:
            raise ValueError("an engine holds at least one adapter")
        share = default_share(capacity) if share is None else share
        if not 1 <= share <= capacity:
            raise ValueError(f"a project's share must be 1 to {capacity} slots, not {share}")
        self.capacity = capacity
        self.share = share
        self._slots: OrderedDict[str, _Slot] = OrderedDict()  # least recently used first
        self._holds: dict[str, tuple[str, float]] = {}  # hold id -> (adapter, deadline)

    def __contains__(self, name: object) -> bool:
        return name in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def names(self) -> list[str]:
        """Least recently used first (the order EngineState.adapters reports)."""
        return list(self._slots)

    def owner_of(self, name: str) -> str | None:
        slot = self._slots.get(name)
        return None if slot is None else slot.owner

    def held_by(self, owner: str) -> int:
        return sum(1 for slot in self._slots.values() if slot.owner == owner)

    def full(self) -> bool:
        return len(self._slots) >= self.capacity

    # ------------------------------------------------------------------ use and holds

    def use(self, name: str, owner: str, now: float) -> None:
        """Mark ``name`` used now, adding it as ``owner``'s (a loaded adapter keeps its
        owner: its served name names its checkpoint, and a checkpoint has one project)."""
        slot = self._slots.get(name)
        if slot is None:
            self._slots[name] = _Slot(owner, now)
        else:
            slot.last_used = now
            self._slots.move_to_end(name)

    def remove(self, name: str) -> None:
        """Forget ``name`` (unloaded) and every hold on it."""
        self._slots.pop(name, None)
        for hold in [h for h, (held, _) in self._holds.items() if held == name]:
            del self._holds[hold]

    def hold(self, name: str, hold: str, *, until: float) -> None:
        """Pin ``name`` for one request, until :meth:`release` of ``hold`` or ``until``."""
        if name not in self._slots:
            raise KeyError(f"adapter {name} is not held here")
        self._holds[hold] = (name, until)

    def release(self, hold: str, now: float) -> bool:
        """End ``hold`` (its request ended at ``now``, which counts as a use); False when it
        is unknown here, lapsed or released already."""
        found = self._holds.pop(hold, None)
        if found is None:
            return False
        name, _ = found
        if name in self._slots:
            self.use(name, self._slots[name].owner, now)
        return True

    def holds_on(self, name: str, now: float) -> int:
        """How many requests hold ``name`` now."""
        return sum(1 for held, until in self._holds.values() if held == name and until > now)

    def pinned(self, now: float, in_use: Collection[str] = ()) -> set[str]:
        """The adapters requests use now: held (lapsed holds are dropped here) or running in
        the engine (``in_use``)."""
        self._holds = {h: (n, until) for h, (n, until) in self._holds.items() if until > now}
        return {name for name, _ in self._holds.values()} | {n for n in in_use if n in self}

    # ------------------------------------------------------------------ room

    def needs_eviction(self, owner: str) -> bool:
        """Whether a new adapter of ``owner`` needs one unloaded first (then the caller reads
        what the engine runs before :meth:`make_room`)."""
        return self.full() or self.held_by(owner) >= self.share

    def make_room(self, owner: str, *, now: float, in_use: Collection[str] = ()) -> RoomDecision:
        """What a new adapter of ``owner`` needs before it loads (see the module docstring)."""
        pinned = self.pinned(now, in_use)
        held = self.held_by(owner)
        if held >= self.share:
            own = self._unpinned_of(owner, pinned)
            if own is None:
                return OverShare(owner, held, self.share)
            return Evict(own, owner)
        if not self.full():
            return Fits()
        victim = self._heaviest_holders_victim(pinned)
        return AllPinned(self.capacity) if victim is None else victim

    def _unpinned_of(self, owner: str, pinned: set[str]) -> str | None:
        """``owner``'s least recently used adapter no request uses."""
        return next(
            (n for n, s in self._slots.items() if s.owner == owner and n not in pinned), None
        )

    def _heaviest_holders_victim(self, pinned: set[str]) -> Evict | None:
        """The least recently used unpinned adapter of the project holding the most slots
        among those with one unpinned; a tie goes to the adapter used longest ago."""
        counts = Counter(slot.owner for slot in self._slots.values())
        best: tuple[int, float, str, str] | None = None  # (-held, last used, name, owner)
        for owner in counts:
            name = self._unpinned_of(owner, pinned)
            if name is None:
                continue
            candidate = (-counts[owner], self._slots[name].last_used, name, owner)
            if best is None or candidate < best:
                best = candidate
        return None if best is None else Evict(best[2], best[3])
