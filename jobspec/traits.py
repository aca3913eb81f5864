"""What the spec's selectable names are, beyond their names: the traits code reads instead of
comparing names.

A rollout engine's traits say what starting it involves (``trainer.rollout.startup``) and which
spec settings it can serve (``JobSpec``'s validators); a KL estimator's say how exactly it
follows the gradient of KL(pi || ref) in each placement (``JobSpec.warnings``; the derivations
are ``trainer.update.kl``'s). Torch-free, like the rest of the spec. Keys must equal the spec's names
(tests/trainer/test_registries.py), so a new engine or estimator is a row here beside its entry
in its registry (``trainer.rollout.registry.ROLLOUT_ENGINES``, ``trainer.update.kl.KL_ESTIMATORS``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jobspec.grpo import KLEstimatorName, RolloutEngineName

__all__ = [
    "KL_ESTIMATOR_TRAITS",
    "KL_REWARD_PENALTY",
    "ROLLOUT_ENGINE_TRAITS",
    "KLEstimatorTraits",
    "KLLossGradient",
    "RolloutEngineTraits",
]


@dataclass(frozen=True)
class RolloutEngineTraits:
    """What a run asks of one rollout engine besides building it."""

    # Loads the model from a folder: a ready model object is saved into one first.
    loads_folder: bool
    # Allocates its KV cache up front: the run sizes it (rollout.kv_cache_gib, or the batch).
    sizes_kv_cache: bool
    # On a CUDA device, shares it with the trainer: takes a share of its memory (given or
    # derived) and may sleep during updates (trainer.rollout.colocation).
    colocates_on_cuda: bool
    # Hot-swaps LoRA adapters instead of merged weights (rollout.lora_sync 'adapter').
    serves_lora_adapters: bool


ROLLOUT_ENGINE_TRAITS: dict[RolloutEngineName, RolloutEngineTraits] = {
    "vllm": RolloutEngineTraits(
        loads_folder=True, sizes_kv_cache=True, colocates_on_cuda=True, serves_lora_adapters=True
    ),
    # Generates with the policy module itself: nothing to load, size or share.
    "transformers": RolloutEngineTraits(
        loads_folder=False,
        sizes_kv_cache=False,
        colocates_on_cuda=False,
        serves_lora_adapters=False,
    ),
}


# The expected gradient of an estimator's sum over a completion placed in the loss, on-policy,
# against grad KL_seq = grad KL(pi || ref) over whole completions (trainer.update.kl's table):
#   none                  no KL term;
#   zero                  0 (its value estimates the KL, its gradient does not);
#   per_position          sum_t E[grad KL_t] with each position's prefix held fixed;
#   per_position_reverse  the same for KL(ref || pi);
#   sequence              grad KL_seq exactly.
KLLossGradient = Literal["none", "zero", "per_position", "per_position_reverse", "sequence"]


@dataclass(frozen=True)
class KLEstimatorTraits:
    """How exactly one KL estimator follows grad KL(pi || ref), per placement."""

    # Placed in the loss: what its expected gradient follows on-policy ...
    loss: KLLossGradient
    # ... and whether it follows grad KL(pi || ref) on-policy only, biased off-policy (samples
    # from pi_old: num_iterations > 1).
    loss_biased_off_policy: bool
    # As a reward-side penalty (summed over the completion): whether its score-function
    # gradient is exactly grad KL_seq.
    reward_exact: bool


KL_ESTIMATOR_TRAITS: dict[KLEstimatorName, KLEstimatorTraits] = {
    "none": KLEstimatorTraits(loss="none", loss_biased_off_policy=False, reward_exact=False),
    "k1": KLEstimatorTraits(loss="zero", loss_biased_off_policy=False, reward_exact=True),
    "k2": KLEstimatorTraits(loss="per_position", loss_biased_off_policy=True, reward_exact=False),
    # Follows the other KL, KL(ref || pi) (GRPO's original), even on-policy.
    "k3": KLEstimatorTraits(
        loss="per_position_reverse", loss_biased_off_policy=False, reward_exact=False
    ),
    "k3_unbiased": KLEstimatorTraits(
        loss="per_position", loss_biased_off_policy=False, reward_exact=False
    ),
    # Its value is k1's, so as a penalty it is k1.
    "k1_causal": KLEstimatorTraits(loss="sequence", loss_biased_off_policy=True, reward_exact=True),
}

# What placement 'reward' always penalises with, whatever estimator a job names (that one then
# only names the reported kl metric): k1, the estimator the reward's exactness was derived for.
KL_REWARD_PENALTY: KLEstimatorName = "k1"
