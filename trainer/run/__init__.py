"""A training run from start to finish:

- ``setup``: everything built from the job spec before the first step;
- ``placement``: where the policy and its KL reference go once loaded (one device, or sharded);
- ``loop``: the step driver, ``train``;
- ``step_update``: the update half of a step;
- ``engine_sync``: the rollout engine around an update: asleep, then woken with the new weights;
- ``episodes``: an agent job's rollout, every sample a multi-turn episode;
- ``evaluation``: the held-out evaluation at a step;
- ``checkpoints``: writing a checkpoint after a step and restoring one before the first;
- ``callbacks``: the hooks a run reports progress to (the worker implements them);
- ``metrics``: the per-step metrics and rollout samples;
- ``cli``: the ``grpo train`` command line;
- ``async_run``: what an asynchronous run adds to the loop (its rollout server, versions, guard);
- ``async_rollouts``: its rollout pipeline, the steps ahead generated while a step updates;
- ``launch``: one job on several ranks of this machine, started through torchrun;
- ``rank_main``: the entry point of one rank;
- ``relay``: the channel between rank 0 and the launching process;
- ``rank_callbacks``: the callbacks as every rank sees them (rank 0 calls the real ones);
- ``rank_batch``: a step's batch across the ranks: which kept groups train, and whose.

Nothing is imported here: the worker imports the callbacks without loading torch."""
