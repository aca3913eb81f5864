"""The policy update of a step, in the order it runs (:mod:`trainer.update.phases` lists the
phases): packing the kept groups into a batch (:mod:`~trainer.update.step`), reward shaping
(:mod:`~trainer.update.shaping`), scoring logprobs (:mod:`~trainer.update.logprobs`), the KL
estimators (:mod:`~trainer.update.kl`), advantages (:mod:`~trainer.update.advantages`), the
clipped surrogate losses (:mod:`~trainer.update.losses`), sampler-mismatch correction
(:mod:`~trainer.update.sampler_correction`), the optimizer (:mod:`~trainer.update.optim`), and
the update passes themselves with their non-finite guard (:mod:`~trainer.update.passes`)."""
