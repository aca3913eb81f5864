"""One job on several devices of one machine: the "several devices" wing.

What it owns:

- ``world``: the rank's place in the job's process group (rank, world size, device), its
  initialisation from torchrun's environment, and the collectives the trainer calls, each with
  a timeout (``GRPO_DIST_TIMEOUT_S``) whose expiry raises :class:`DistributedTimeout` naming the
  rank and the phase, never a hang.
- ``sharding``: rank 0's initial weights broadcast, then the policy (and reference) as FSDP2
  shards on a device mesh, moved to the device unit by unit, with gradients summed rather
  than averaged over ranks (the loss is already normalised by the global count) and reduced
  once per minibatch.
- ``weights``: every parameter gathered whole, in the same order on every rank and cast to the
  engine's dtype, streamed to the rank's own rollout engine in bounded buckets (no whole copy
  held), and the mirror the transformers engine and checkpoints read.
- ``solo``: phases rank 0 runs alone (an async run's rollout server, its evaluation) while
  the other ranks wait for its result.
- ``timeout``: ``GRPO_DIST_TIMEOUT_S`` and the longer bound of a checkpoint's reads and
  writes, read in one place (torch-free: the launcher reads it too).

The step driver (``trainer.run``) uses these; what starts the ranks and relays rank 0's
callbacks to the process that started them sits with the other drivers, in ``trainer.run``
(``launch``, ``relay``, ``rank_main``, ``rank_callbacks``), since it calls the loop and this
package must not. A one-device run sees only a single-rank
:class:`~trainer.distributed.world.World`, whose collectives return their input. See
docs/scaling.md.
"""
