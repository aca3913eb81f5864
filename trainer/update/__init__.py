"""The policy update of a step, in the order it runs (:mod:`trainer.update.inputs` lists the
phases): packing the kept groups into a batch (:mod:`~trainer.update.batch`), reward shaping
(:mod:`~trainer.update.shaping`), scoring logprobs (:mod:`~trainer.update.logprobs`, with the
output head fused with its log-softmax in :mod:`~trainer.update.fused_head`), the KL
estimators (:mod:`~trainer.update.kl`), advantages (:mod:`~trainer.update.advantages`), the
clipped surrogate losses (:mod:`~trainer.update.losses`), sampler-mismatch correction
(:mod:`~trainer.update.sampler_correction`), the optimizer (:mod:`~trainer.update.optim`) and its
learning-rate schedule (:mod:`~trainer.update.schedule`), and the update itself, minibatch by
minibatch, with its non-finite guard (:mod:`~trainer.update.policy_update`). Set up once per
run: the micro-batch ``auto`` chooses (:mod:`~trainer.update.micro_batch`) and the compiled
decoder layers (:mod:`~trainer.update.compiled`)."""
