"""A rank's place in its job's process group, and the collectives the trainer runs in it.

Every collective goes through :class:`World` with the name of the phase it belongs to
("collect", "update", "sync", ...). It waits at most ``timeout_s`` (``GRPO_DIST_TIMEOUT_S``,
also the process group's own timeout, which bounds FSDP's internal collectives); when it fails
or times out, :class:`DistributedTimeout` names the rank and the phase, so a rank that died or
hung ends its peers with an error a person can act on. A wait known to outlast that bound
(rank 0 writing a large checkpoint) runs in a group of its own with a longer timeout
(:meth:`World.patient_group`); a phase rank 0 runs alone while the others wait for its result
is watched by its heartbeat instead (:meth:`World.main_alone`). A single-rank world runs none
of them: each call returns its input.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from trainer.distributed.solo import main_alone
from trainer.distributed.timeout import DEFAULT_TIMEOUT_S, dist_timeout_s
from trainer.errors import DistributedTimeout

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DistributedTimeout",
    "PatientGroup",
    "World",
    "init_world",
    "process_group_backend",
    "process_group_kwargs",
    "single_world",
    "world_from_env",
]

T = TypeVar("T")


@dataclass(frozen=True)
class PatientGroup:
    """A process group over every rank whose collectives may take ``timeout_s``, longer
    than the world's (:meth:`World.patient_group`)."""

    group: Any  # a dist.ProcessGroup
    timeout_s: float


@dataclass(frozen=True)
class World:
    """This process's rank among ``size`` ranks of one job (``size`` 1: not distributed)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one rank that talks to whoever started the job."""
        return self.rank == 0

    def device(self, requested: str) -> torch.device:
        """The rank's device: ``cuda:<local rank>`` when ``requested`` is a CUDA device and the
        world is distributed, else ``requested`` as given."""
        device = torch.device(requested)
        if self.distributed and device.type == "cuda":
            return torch.device("cuda", self.local_rank)
        return device

    def share(self, count: int) -> range:
        """This rank's contiguous share of ``count`` items (whole groups per rank): the first
        ``count % size`` ranks take one more."""
        base, extra = divmod(count, self.size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (1 if self.rank < extra else 0))

    # ---------------------------------------------------------------- collectives

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Run collectives of phase ``name``: any failure (a peer gone, a timeout) becomes a
        DistributedTimeout naming this rank and the phase."""
        try:
            yield
        except DistributedTimeout:
            raise
        except (RuntimeError, dist.DistBackendError) as exc:
            raise DistributedTimeout(self.rank, name, str(exc).splitlines()[0][:300]) from exc

    @contextmanager
    def patient_group(self, timeout_s: float) -> Iterator[PatientGroup | None]:
        """A gloo group over every rank for collectives that may wait up to ``timeout_s``
        (rank 0 writing a large checkpoint while the others wait at its barrier): the default
        group's backend would abort such a wait at the world's timeout, whatever ``wait`` is
        given, so the bound must be the group's own. Created on entry, a collective every rank
        enters at the same point, before the slow part begins; destroyed on exit. None for a
        single rank."""
        if not self.distributed:
            yield None
            return
        bound = max(timeout_s, self.timeout_s)
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=bound))
        try:
            yield PatientGroup(group=group, timeout_s=bound)
        finally:
            dist.destroy_process_group(group)

    def _wait(self, work: Any, phase: str, timeout_s: float | None = None) -> None:
        bound = self.timeout_s if timeout_s is None else timeout_s
        with self.phase(phase):
            if not work.wait(timeout=timedelta(seconds=bound)):
                raise DistributedTimeout(self.rank, phase, f"no answer in {bound:g}s")

    def all_reduce(self, tensor: torch.Tensor, phase: str, *, op: str = "sum") -> torch.Tensor:
        """``tensor`` reduced over the ranks in place (``op``: sum, max or min); returned."""
        if not self.distributed:
            return tensor
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        self._wait(dist.all_reduce(tensor, op=ops[op], async_op=True), phase)
        return tensor

    def sum_floats(self, values: list[float], phase: str) -> list[float]:
        """Elementwise sums over the ranks of a list of floats (float64, the same length on
        every rank)."""
        if not self.distributed:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64)
        return [float(v) for v in self.all_reduce(tensor, phase)]

    def gather_objects(self, obj: T, phase: str) -> list[T]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.size
        with self.phase(phase):
            dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: T, phase: str) -> T:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box: list[Any] = [obj]
        with self.phase(phase):
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def main_alone(self, phase: str) -> AbstractContextManager[None]:
        """A phase rank 0 runs alone (starting the rollout server, a step's rollouts, an
        evaluation) while the others wait on its heartbeat, not in a collective bounded by
        the world's timeout (:func:`trainer.distributed.solo.main_alone`)."""
        return main_alone(self, phase)

    def barrier(self, phase: str, patient: PatientGroup | None = None) -> None:
        """Wait for every rank: in the default group within the world's timeout, or in a
        ``patient`` group (:meth:`patient_group`) within its longer one."""
        if not self.distributed:
            return
        if patient is None:
            self._wait(dist.barrier(async_op=True), phase)
        else:
            work = dist.barrier(group=patient.group, async_op=True)
            self._wait(work, phase, patient.timeout_s)


def single_world() -> World:
    """The world of a run on one device."""
    return World()


def world_from_env(environ: dict[str, str] | None = None) -> World:
    """The world torchrun describes in the environment (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``), with ``GRPO_DIST_TIMEOUT_S``; a single-rank world without them."""
    env = os.environ if environ is None else environ
    timeout = dist_timeout_s(env)
    size = int(env.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World(timeout_s=timeout)
    return World(
        rank=int(env["RANK"]),
        size=size,
        local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
        timeout_s=timeout,
    )


def process_group_backend(device: torch.device) -> str:
    """The default group's backend for a rank computing on ``device``.

    On CUDA, a map with a CPU backend beside NCCL: the trainer also reduces host tensors
    (:meth:`World.sum_floats`' float64 sums, object gathers), which an NCCL-only group refuses
    ("No backend type associated with device type cpu"). Elsewhere gloo alone."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def process_group_kwargs(world: World, device: torch.device) -> dict[str, Any]:
    """The arguments of ``dist.init_process_group`` for ``world`` on ``device``: the backend
    (:func:`process_group_backend`), the rank, the size and the world's timeout; on an indexed
    CUDA device its ``device_id`` too, which binds the group to the rank's own GPU so NCCL
    builds its communicator there at once (not on whatever device is current at the first
    collective)."""
    kwargs: dict[str, Any] = {
        "backend": process_group_backend(device),
        "rank": world.rank,
        "world_size": world.size,
        "timeout": timedelta(seconds=world.timeout_s),
    }
    if device.type == "cuda" and device.index is not None:
        kwargs["device_id"] = device
    return kwargs


def init_world(world: World, device: torch.device) -> None:
    """Join the default process group (:func:`process_group_kwargs`), making ``device`` the
    current CUDA device first; nothing for a single rank or a group already joined."""
    if not world.distributed or dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(**process_group_kwargs(world, device))
