"""What a run leaves on disk: checkpoint folders written, read and retained
(:mod:`trainer.checkpoint.store`), a multi-rank run's weights and optimizer state as sharded
files (:mod:`trainer.checkpoint.sharded`), folders written so that a crash leaves them complete
or absent (:mod:`trainer.checkpoint.durable`), and export of a checkpoint as a plain model
folder (:mod:`trainer.checkpoint.export`). The names of a checkpoint's files are
:mod:`jobspec.checkpoint_files` (torch-free: the API imports it).

Nothing is imported here, so that the torch-free modules stay importable without torch."""
