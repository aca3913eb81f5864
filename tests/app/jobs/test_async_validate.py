"""POST /v1/jobs/validate warns about the async settings whose stale update is measurably not
the on-policy one (jobspec.async_warnings): each warning names its field and quotes the
figure docs/trainer.md gives; a warning, never a refusal."""

from __future__ import annotations

from typing import Any

from tests.conftest import Api, tiny_spec


def _validate(api: Api, **grpo: Any) -> list[str]:
    response = api.client.post("/v1/jobs/validate", json=tiny_spec(**grpo), headers=api.headers)
    assert response.status_code == 200, response.text
    assert response.json()["valid"] is True
    return list(response.json()["warnings"])


def _starting(warnings: list[str], field: str) -> list[str]:
    return [w for w in warnings if w.startswith(field + " ")]


def test_validate_warns_about_each_async_setting(api: Api) -> None:
    warnings = _validate(
        api,
        **{"async": {"max_staleness": 2}},
        kl={"beta": 0.1, "estimator": "k3_unbiased", "placement": "loss"},
    )
    (kl,) = _starting(warnings, "grpo.kl.placement")
    assert "max_staleness 2" in kl and "87%" in kl and "docs/trainer.md" in kl
    (mode,) = _starting(warnings, "grpo.sampler_correction.mode")
    assert "token_truncate (the default)" in mode and "5.6%" in mode
    (aggregation,) = _starting(warnings, "grpo.loss_aggregation")
    assert "token_mean (the default)" in aggregation and "3.6%" in aggregation

    off = _validate(api, **{"async": {"max_staleness": 1}}, sampler_correction={"mode": "none"})
    (mode,) = _starting(off, "grpo.sampler_correction.mode")
    assert "none with grpo.async.max_staleness 1" in mode and "55.7%" in mode


def test_validate_says_nothing_of_staleness_for_a_synchronous_or_exact_spec(api: Api) -> None:
    synchronous = _validate(api, kl={"beta": 0.1}, sampler_correction={"mode": "none"})
    assert not [w for w in synchronous if "max_staleness" in w]
    exact = _validate(
        api,
        **{"async": {"max_staleness": 1}},
        kl={"beta": 0.1, "estimator": "k1", "placement": "reward"},
        sampler_correction={"mode": "sequence_truncate", "cap": 100.0},
        advantage_scale="none",
        loss_aggregation="seq_mean_token_sum_norm",
    )
    assert not [w for w in exact if "max_staleness" in w]
