"""What an in-process vLLM engine must leave of the trainer's process: its random streams and
its default process group.

- Starting: ``LLM(seed=...)`` calls vLLM's ``set_random_seed``, which reseeds python's
  ``random``, numpy and torch (CPU and every CUDA device) for the whole process. A run that
  resumed restored those streams from its checkpoint first; without :func:`rng_state_kept`
  around the start, the rest of the run would draw from the engine's seed instead and a
  resumed run would not match the straight one.
- Closing: ``EngineCore.shutdown`` runs vLLM's ``cleanup_dist_env_and_memory``, whose
  ``destroy_distributed_environment`` ends with ``torch.distributed.destroy_process_group()``:
  the DEFAULT group, which on a rank is the trainer's (vLLM joined it rather than making its
  own). :func:`default_group_kept` lets vLLM destroy its own groups but not that one, while an
  engine that made the default group itself (a single-rank run) still tears it down as before.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["default_group_joined", "default_group_kept", "rng_state_kept"]


@contextmanager
def rng_state_kept() -> Iterator[None]:
    """Put python's, numpy's and torch's generators (CPU, and every CUDA device once CUDA is
    initialised: before that the trainer has drawn nothing from them) back as they were."""
    python_state = random.getstate()
    numpy_state = np.random.get_state()
    cpu_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        torch.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


def default_group_joined() -> bool:
    """Whether this process is in a default process group now (the trainer's, when asked
    before the engine starts)."""
    return dist.is_available() and dist.is_initialized()


@contextmanager
def default_group_kept(keep: bool) -> Iterator[None]:
    """Within the block, ``torch.distributed.destroy_process_group`` leaves the default group
    alone when ``keep`` (the trainer owns it) and destroys any other group as asked."""
    if not keep or not dist.is_available():
        yield
        return
    destroy = dist.destroy_process_group

    def destroy_other_groups(group: Any = None) -> None:
        if group is None or group is dist.GroupMember.WORLD:
            return  # the trainer's default group: it outlives the engine
        destroy(group)

    dist.destroy_process_group = destroy_other_groups
    try:
        yield
    finally:
        dist.destroy_process_group = destroy
