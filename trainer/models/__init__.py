"""The models a run trains and compares against: resolving a model name to a folder under the
operator's rules (:mod:`jobspec.paths`, torch-free: the API imports it; Hub repos in
:mod:`trainer.models.hub`), loading the policy and tokenizer (:mod:`trainer.models.loading`),
LoRA adapters (:mod:`trainer.models.lora`), the frozen KL reference
(:mod:`trainer.models.reference`), compute precision (:mod:`trainer.models.precision`) and
device memory (:mod:`trainer.models.memory`).

Nothing is imported here, so that the torch-free modules stay importable without torch."""
