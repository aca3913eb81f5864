"""A training run from start to finish: its setup from the job spec (:mod:`trainer.run.setup`),
the step driver (:mod:`trainer.run.loop`, ``train``), its checkpoints
(:mod:`trainer.run.checkpoints`), the callbacks it reports to
(:mod:`trainer.run.callbacks`), its per-step metrics (:mod:`trainer.run.metrics`), the
``grpo train`` command line (:mod:`trainer.run.cli`), and a run on several devices: its ranks
started through torchrun (:mod:`trainer.run.launch`, each rank's entry point
:mod:`trainer.run.rank_main`) with rank 0's callbacks relayed to the launching process
(:mod:`trainer.run.relay`).

Nothing is imported here: the worker imports the callbacks without loading torch."""
