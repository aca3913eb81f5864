"""What a run leaves on disk: checkpoint folders written, read and retained
(:mod:`trainer.checkpoint.store`), the names of a checkpoint's files (:mod:`jobspec.checkpoint_files`,
torch-free: the API imports it), and export of a checkpoint as a plain model folder
(:mod:`trainer.checkpoint.export`).

Nothing is imported here, so that the torch-free modules stay importable without torch."""
