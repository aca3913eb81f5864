"""A training run from start to finish: the loop (:mod:`trainer.run.loop`, ``train``), the
callbacks it reports to (:mod:`trainer.run.callbacks`), its per-step metrics
(:mod:`trainer.run.metrics`) and the ``grpo train`` command line (:mod:`trainer.run.cli`).

Nothing is imported here: the worker imports the callbacks without loading torch."""
