"""Phases rank 0 runs alone while the other ranks wait for its result.

An asynchronous run on several ranks has one rollout server, rank 0's: rank 0 alone starts
it, takes each step's batch from it, evaluates on it and settles the batches made ahead
before a checkpoint, then broadcasts what it got. The other ranks used to wait for that inside
the broadcast, a collective bounded by ``GRPO_DIST_TIMEOUT_S`` (600 s): a rollout, an
evaluation or a server start longer than that ended a healthy job with a timeout, and long
per-rank phases were where gloo crashed.

Here a waiting rank does not sit in a collective. Rank 0 beats from a thread of its own while
it works (a counter in the job's key-value store, the one torchrun's rendezvous set up) and
writes the phase's end; the others wait on that key in the store, looking at the beat every
second. They give up only when the beat stopped
changing for the world's timeout, by their own clock (no clocks compared across machines),
or when the store itself did not answer within it: a rank 0 frozen or on a machine gone
quiet, which no collective would ever report. A rank 0
that crashed ends the others at once through torchrun, as before; one that raised in the
phase writes so, and the others stop naming the phase. The broadcast that follows the phase
finds every rank already there.

Torch-free apart from the store, which is anything with ``set``, ``get``, ``check`` and
``delete_key``, ``wait`` (``torch.distributed.Store``); the tests drive it with two real processes.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from typing import Any, Protocol

from trainer.errors import DistributedTimeout

__all__ = ["Store", "job_store", "main_alone"]

# How long a waiting rank blocks on the phase's end key before it looks at the beat again (the
# end itself wakes it at once: the store answers the wait when the key is written).
POLL_S = 1.0
# Rank 0 beats at most this far apart, and at least four times per timeout.
MAX_BEAT_S = 5.0
DONE, FAILED = b"done", b"failed"

# Each phase's keys are its place in the run's sequence of solo phases, the same on every rank
# (every rank enters the same phases in the same order, as with collectives).
_sequence = itertools.count()


class Store(Protocol):
    def set(self, key: str, value: str | bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def delete_key(self, key: str) -> bool: ...
    def wait(self, keys: list[str], timeout: timedelta) -> None: ...


class _Ranks(Protocol):
    """What a phase needs of :class:`trainer.distributed.world.World`."""

    @property
    def rank(self) -> int: ...
    @property
    def distributed(self) -> bool: ...
    @property
    def is_main(self) -> bool: ...
    @property
    def timeout_s(self) -> float: ...
    def phase(self, name: str) -> AbstractContextManager[None]: ...


@functools.cache
def job_store(timeout_s: float) -> Store:
    """A connection of this rank to the job's store (torchrun's rendezvous store, which the
    default process group uses) whose every call gives up after ``timeout_s``: a store on a
    machine gone quiet must not hang the waiting rank. Its keys are apart from the group's.
    The group's own store where it is not a TCP store (as given)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    store: Any = c10d._get_default_store()
    base = store
    while hasattr(base, "underlying_store"):
        base = base.underlying_store
    if not isinstance(base, dist.TCPStore):
        return store  # type: ignore[no-any-return]
    client = dist.TCPStore(
        base.host,
        base.port,
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    return dist.PrefixStore("grpo-solo", client)  # type: ignore[return-value]


@contextmanager
def main_alone(
    world: _Ranks,
    phase: str,
    *,
    store: Store | None = None,
    poll_s: float = POLL_S,
) -> Iterator[None]:
    """Run the block as phase ``phase`` that rank 0 does alone: on rank 0 the block runs while
    a thread beats; on the other ranks the block runs (it should do nothing of rank 0's) and
    then waits for rank 0's end of the phase, raising :class:`DistributedTimeout` naming the
    phase when rank 0 fell silent for the world's timeout or failed in it. Nothing for a
    single rank. A collective must follow the block on every rank (the broadcast of what
    rank 0 made): rank 0 then knows every rank is past this phase's keys when it deletes
    them, two phases on."""
    if not world.distributed:
        yield
        return
    store = store if store is not None else job_store(world.timeout_s)
    seq = next(_sequence)
    key = f"grpo/solo/{seq}"
    if world.is_main:
        with _beating(store, key, beat_s=min(MAX_BEAT_S, world.timeout_s / 4)):
            yield
        _forget(store, f"grpo/solo/{seq - 2}")  # every rank is past that one's end by now
        return
    yield
    _wait_for_main(store, key, world, phase, poll_s)


@contextmanager
def _beating(store: Store, key: str, *, beat_s: float) -> Iterator[None]:
    """Beat ``<key>/beat`` every ``beat_s`` while the block runs; write ``<key>/end``."""
    stop = threading.Event()
    store.set(f"{key}/beat", "0")

    def beat() -> None:
        for count in itertools.count(1):
            if stop.wait(beat_s):
                return
            try:
                store.set(f"{key}/beat", str(count))
            except Exception:  # the store went away: the job is ending; the others see why
                return

    thread = threading.Thread(target=beat, name=f"grpo-solo-beat-{key}", daemon=True)
    thread.start()
    outcome = FAILED
    try:
        yield
        outcome = DONE
    finally:
        stop.set()
        thread.join()
        store.set(f"{key}/end", outcome)


def _wait_for_main(store: Store, key: str, world: _Ranks, phase: str, poll_s: float) -> None:
    last: bytes | None = None
    changed = time.monotonic()
    # A store gone (rank 0's agent ended) fails its calls: the world's phase names it.
    with world.phase(phase):
        while True:
            # Not written yet raises too (as does a store gone: the check below says which).
            with contextlib.suppress(Exception):
                store.wait([f"{key}/end"], timedelta(seconds=poll_s))
            if store.check([f"{key}/end"]):
                if store.get(f"{key}/end") != DONE:
                    raise DistributedTimeout(world.rank, phase, "rank 0 failed in this phase")
                return
            beat = store.get(f"{key}/beat") if store.check([f"{key}/beat"]) else None
            now = time.monotonic()
            if beat != last:
                last, changed = beat, now
            elif now - changed > world.timeout_s:
                raise DistributedTimeout(
                    world.rank,
                    phase,
                    f"rank 0 gave no sign of life for {world.timeout_s:g}s while it worked "
                    "alone (GRPO_DIST_TIMEOUT_S)",
                )


def _forget(store: Store, key: str) -> None:
    for name in ("beat", "end"):
        with contextlib.suppress(Exception):  # a store without deletes keeps a few bytes
            store.delete_key(f"{key}/{name}")
