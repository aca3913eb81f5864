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

The step driver (``trainer.run``) uses these; what starts the ranks and relays rank 0's
callbacks to the process that started them sits with the other drivers, in ``trainer.run``
(``launch``, ``relay``, ``rank_main``, ``rank_callbacks``), since it calls the loop and this package must not. A
one-device run sees only a single-rank :class:`~trainer.distributed.world.World`, whose
collectives return their input. See docs/scaling.md.
"""
