"""The ``grpo.kl`` section of the job spec and what its estimators are: each estimator's name,
and how exactly it follows the gradient of KL(pi || ref) in each placement (its traits, read
by ``JobSpec.warnings``; the derivations are ``trainer.update.kl``'s). A new estimator is its
name and its traits here, and its function in ``trainer.update.kl.KL_ESTIMATORS`` (the keys
must equal the names: tests/trainer/test_registries.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from specbase import StrictModel

__all__ = [
    "KL_ESTIMATOR_TRAITS",
    "KL_REWARD_PENALTY",
    "KLEstimatorName",
    "KLEstimatorTraits",
    "KLLossGradient",
    "KLPlacement",
    "KLSpec",
]

KLEstimatorName = Literal["none", "k1", "k2", "k3", "k3_unbiased", "k1_causal"]
KLPlacement = Literal["loss", "reward"]


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


class KLSpec(StrictModel):
    estimator: KLEstimatorName = Field(
        default="k3_unbiased",
        description=(
            "Per-token KL estimator against the reference model: k1 (-d), k2 (d^2/2), "
            "k3 (exp(d)-d-1), k3_unbiased (importance-weighted k3, DeepSeek-V3.2), k1_causal "
            "(k1 whose gradient gives each token the KL still to come), or none. In the loss, "
            "k2 and k3_unbiased follow the per-position gradient of KL(pi || ref) (each "
            "position's prefix held fixed), k3 that of KL(ref || pi), k1 none; only k1_causal "
            "follows the gradient of the whole completion's KL (docs/trainer.md)."
        ),
    )
    beta: float = Field(
        default=0.0,
        ge=0.0,
        le=10.0,
        description="KL coefficient; 0 (or estimator none) loads no reference model.",
    )
    placement: KLPlacement = Field(
        default="loss",
        description=(
            "Add beta*KL to the loss, or put it in the reward: there the penalty is always k1 "
            "summed over the completion (log pi - log ref), centred on the other completions "
            "of its group and NOT scaled by advantage_scale, so its expected update is exactly "
            "beta * grad KL(pi || ref) in every group; the estimator above then only names "
            "the reported kl metric."
        ),
    )
    flat_groups: Literal["skip", "keep"] = Field(
        default="skip",
        description=(
            "Deprecated and ignored: the reward-side penalty is no longer scaled by the group "
            "std, so it applies in every group, flat or not. Accepted so older specs validate."
        ),
    )

    @property
    def active(self) -> bool:
        return self.beta > 0 and self.estimator != "none"

    @property
    def in_loss(self) -> bool:
        """A KL term is added to the loss (a reference model is loaded)."""
        return self.active and self.placement == "loss"

    @property
    def in_reward(self) -> bool:
        """A KL penalty enters the advantages (a reference model is loaded)."""
        return self.active and self.placement == "reward"
