"""One job on several devices of one machine: the "several devices" wing.

What it owns:

- ``world``: the rank's place in the job's process group (rank, world size, device), its
  initialisation from torchrun's environment, and the collectives the trainer calls, each with
  a timeout (``GRPO_DIST_TIMEOUT_S``) whose expiry raises :class:`DistributedTimeout` naming the
  rank and the phase, never a hang.
- ``sharding``: the policy (and reference) as FSDP2 shards on a device mesh, with gradients
  summed rather than averaged over ranks (the loss is already normalised by the global count).
- ``weights``: every parameter gathered whole, one tensor at a time and in the same order on
  every rank, for the rank's own rollout engine and for checkpoints.

Starting the ranks is not in here: :mod:`trainer.run.launch` (torchrun's elastic agent, shared
by the worker and ``grpo train --nproc``; only rank 0 relays the run's callbacks, through
:mod:`trainer.run.relay`, to the process that started it) wraps a whole run of the loop, and
the loop imports this package, so the launcher sits above both, in ``trainer.run``.

The rest of the trainer sees only a :class:`~trainer.distributed.world.World` (a single-rank one
when nothing is distributed), so a one-device run takes no path of this package but ``world``.
See docs/scaling.md.
"""
