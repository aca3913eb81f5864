"""What an async GRPO spec (``grpo.async.max_staleness`` K >= 1) is warned about: the legal
settings whose expected update, with stale samples, is measurably not the on-policy one.

Each warning names its field and quotes the relative error docs/trainer.md ("Async GRPO: what
staleness changes in the gradient") gives for it: ``tests/trainer/update/test_async_exact.py``
enumerates every group of short completions of a tabular policy whose sampler (pi_b) is
pi_theta's table plus 0.5 * N(0, 1), and compares the expected update with the on-policy one.
``tests/jobspec/test_async_warnings.py`` holds each quoted figure to that page.

Warnings, never errors: each setting is a legitimate trade (the token-level correction bounds
the variance that a sequence weight can have; a KL in the loss is what many recipes use).
"""

from __future__ import annotations

from jobspec.grpo import GRPOSpec

__all__ = ["DOCS", "async_warnings"]

DOCS = "docs/trainer.md, 'Async GRPO: what staleness changes in the gradient'"
_EXACT = (
    "exact: sampler_correction.mode sequence_truncate (cap above every weight), "
    "advantage_scale none, loss_aggregation seq_mean_token_sum_norm"
)

# The loss-side KL with stale samples: how far each estimator's part of the update is from its
# on-policy part (k1's on-policy part is 0: with stale samples it is -grad KL(pi_b || pi)).
_KL_IN_LOSS = {
    "k1": "its gradient becomes -grad KL(pi_b || pi_theta), 0 on-policy: a push away from the "
    "version that sampled, whatever the reference",
    "k2": "87% off its on-policy gradient",
    "k3": "146% off its on-policy gradient",
    "k3_unbiased": "87% off its on-policy gradient",
    "k1_causal": "57% off its on-policy gradient",
}
_TOKEN_CORRECTION = {"token_truncate": "5.6%", "token_mask": "5.6%"}
_TOKEN_AGGREGATION = {"token_mean": "3.6%", "seq_mean_token_mean": "9.5%"}


def async_warnings(grpo: GRPOSpec) -> list[str]:
    """The warnings of ``grpo``'s async settings; none for a synchronous spec (K = 0)."""
    if not grpo.async_.enabled:
        return []
    out: list[str] = []
    k = grpo.async_.max_staleness
    lag = f"grpo.async.max_staleness {k}"
    kl = grpo.kl
    if kl.in_loss:
        out.append(
            f"grpo.kl.placement 'loss' with {lag}: the loss-side KL is not weighted by the "
            "sampler correction, so its expected gradient is the estimator averaged over the "
            f"stale sampler's completions ({kl.estimator}: {_KL_IN_LOSS[kl.estimator]}; by "
            f"enumeration at 0.5 behaviour drift, {DOCS}). kl.placement 'reward' with "
            "sampler_correction.mode sequence_truncate is exact"
        )
    mode = grpo.sampler_correction.mode
    default = "" if "mode" in grpo.sampler_correction.model_fields_set else " (the default)"
    if mode == "none":
        out.append(
            f"grpo.sampler_correction.mode none with {lag}: stale samples are trained as if "
            "the current policy had sampled them; the expected update is 55.7% off the "
            f"on-policy one (40% with the other defaults, against 9.2% corrected; by "
            f"enumeration at 0.5 behaviour drift, {DOCS}). Use sequence_truncate"
        )
    elif mode in _TOKEN_CORRECTION:
        out.append(
            f"grpo.sampler_correction.mode {mode}{default} with {lag}: a token's weight "
            "corrects the token, not its prefix; the expected update is "
            f"{_TOKEN_CORRECTION[mode]} off the on-policy one (the defaults together 9.2%; by "
            f"enumeration at 0.5 behaviour drift, {DOCS}); {_EXACT}"
        )
    aggregation = grpo.loss_aggregation
    if aggregation in _TOKEN_AGGREGATION:
        default = "" if "loss_aggregation" in grpo.model_fields_set else " (the default)"
        out.append(
            f"grpo.loss_aggregation {aggregation}{default} with {lag}: its length factor keeps "
            "the stale sampler's mean reward in the baseline's cross terms; the expected update "
            f"is {_TOKEN_AGGREGATION[aggregation]} off the on-policy one even with the sequence "
            f"correction (by enumeration at 0.5 behaviour drift, {DOCS}); {_EXACT}"
        )
    return out
