"""A training run from start to finish: its setup from the job spec (:mod:`trainer.run.setup`),
the step driver (:mod:`trainer.run.loop`, ``train``), its checkpoints
(:mod:`trainer.run.checkpoints`), the callbacks it reports to
(:mod:`trainer.run.callbacks`), its per-step metrics (:mod:`trainer.run.metrics`) and the
``grpo train`` command line (:mod:`trainer.run.cli`).

Nothing is imported here: the worker imports the callbacks without loading torch."""
