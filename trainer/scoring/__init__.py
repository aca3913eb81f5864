"""A step's rollouts and their rewards: the scorer that turns completions into rewards (graders
or a reward function, :mod:`trainer.scoring.rewards`), how a step's groups are sampled (one
completion per sample, or an agent's episodes: :mod:`trainer.scoring.sampling`), and the
collection of a step's groups from the rollout engine, with DAPO dynamic sampling
(:mod:`trainer.scoring.collect`). The subprocess pool that runs isolated graders under a
deadline is :mod:`grading.graders.pool` (torch-free: the API runs graders too).

Nothing is imported here, so that the torch-free modules stay importable without torch."""
