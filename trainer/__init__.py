"""The GRPO trainer: a plain library with no database, queue or web code (docs/trainer.md). The
worker runs it, and so does ``grpo train recipe.yaml``.

- ``run``: a training run from start to finish: setup, the step driver, checkpoints, callbacks,
  metrics, ``grpo train``, async runs and runs on several devices;
- ``data``: where a run's prompts come from: dataset rows, the held-out split, the sampler;
- ``models``: the policy, its tokenizer, LoRA, the KL reference, precision and host memory;
- ``rollout``: the rollout engines (vLLM, transformers) and the rollout server of async runs;
- ``agents``: multi-turn episodes with tools and environments;
- ``scoring``: a step's rollouts collected and scored into rewards;
- ``update``: the policy update of a step: batch, log-probabilities, KL, advantages, losses;
- ``distributed``: one job on several devices of one machine: ranks, FSDP2 shards, weights;
- ``checkpoint``: checkpoint folders written, read, retained and exported;
- ``primitives``: the Tinker training primitives: a resident LoRA model driven call by call;
- ``errors``: the errors a run can end with, each with its stable ``reason``;
- ``seeding``: seeds derived from the run's seed, one stream per rollout call and split.

Nothing is imported here, so that the torch-free modules stay importable without torch.
"""
