"""The async spec's warnings (jobspec.async_warnings): which settings warn, that each names its
field, and that every figure quoted is the one docs/trainer.md gives."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from jobspec import JobSpec
from jobspec.async_warnings import async_warnings
from tests.conftest import tiny_spec

DOCS = Path(__file__).resolve().parents[2] / "docs" / "trainer.md"
EXACT: dict[str, Any] = {
    "sampler_correction": {"mode": "sequence_truncate", "cap": 100.0},
    "advantage_scale": "none",
    "loss_aggregation": "seq_mean_token_sum_norm",
}


def _spec(staleness: int = 1, **grpo: Any) -> JobSpec:
    return JobSpec.model_validate(tiny_spec(**{"async": {"max_staleness": staleness}}, **grpo))


def _fields(spec: JobSpec) -> list[str]:
    """The field each async warning names first."""
    return [w.split(" ", 1)[0] for w in async_warnings(spec.grpo)]


def test_a_synchronous_spec_gets_none_whatever_its_settings() -> None:
    spec = _spec(0, kl={"beta": 0.1}, sampler_correction={"mode": "none"})
    assert async_warnings(spec.grpo) == []


def test_the_exact_setting_gets_none() -> None:
    spec = _spec(2, kl={"beta": 0.1, "placement": "reward", "estimator": "k1"}, **EXACT)
    assert async_warnings(spec.grpo) == []
    assert spec.warnings() == []


def test_the_defaults_warn_about_the_token_level_correction_and_aggregation() -> None:
    spec = _spec()
    assert _fields(spec) == ["grpo.sampler_correction.mode", "grpo.loss_aggregation"]
    mode, aggregation = async_warnings(spec.grpo)
    assert "token_truncate (the default)" in mode and "5.6%" in mode and "9.2%" in mode
    assert "token_mean (the default)" in aggregation and "3.6%" in aggregation
    assert all(w in spec.warnings() for w in async_warnings(spec.grpo))


def test_an_explicit_token_level_choice_is_not_called_the_default() -> None:
    spec = _spec(sampler_correction={"mode": "token_mask"}, loss_aggregation="seq_mean_token_mean")
    mode, aggregation = async_warnings(spec.grpo)
    assert "token_mask with" in mode and "(the default)" not in mode
    assert "seq_mean_token_mean with" in aggregation and "9.5%" in aggregation


def test_no_correction_warns_with_its_figure() -> None:
    spec = _spec(sampler_correction={"mode": "none"}, loss_aggregation="seq_mean_token_sum_norm")
    (warning,) = async_warnings(spec.grpo)
    assert warning.startswith("grpo.sampler_correction.mode none with grpo.async.max_staleness 1")
    assert "55.7%" in warning and "40%" in warning


@pytest.mark.parametrize(
    ("estimator", "figure"),
    [
        ("k1", "-grad KL(pi_b || pi_theta)"),
        ("k2", "87%"),
        ("k3", "146%"),
        ("k3_unbiased", "87%"),
        ("k1_causal", "57%"),
    ],
)
def test_a_kl_in_the_loss_warns_with_its_estimators_figure(estimator: str, figure: str) -> None:
    spec = _spec(3, kl={"beta": 0.1, "estimator": estimator}, **EXACT)
    (warning,) = async_warnings(spec.grpo)
    assert warning.startswith("grpo.kl.placement 'loss' with grpo.async.max_staleness 3")
    assert f"({estimator}: " in warning and figure in warning
    assert "kl.placement 'reward'" in warning


def test_a_kl_with_beta_zero_is_no_kl() -> None:
    assert async_warnings(_spec(kl={"beta": 0.0}, **EXACT).grpo) == []


def test_every_quoted_figure_is_the_documented_one() -> None:
    """Each percentage a warning quotes is in docs/trainer.md's section on staleness."""
    text = DOCS.read_text(encoding="utf-8")
    section = text[text.index("## Async GRPO: what staleness changes in the gradient") :]
    section = section[: section.index("\n## ", 1)]
    specs = [
        _spec(),
        _spec(sampler_correction={"mode": "none"}, loss_aggregation="seq_mean_token_mean"),
        *(
            _spec(kl={"beta": 0.1, "estimator": e})
            for e in ("k2", "k3", "k3_unbiased", "k1_causal")
        ),
    ]
    quoted = {p for s in specs for w in async_warnings(s.grpo) for p in re.findall(r"[\d.]+%", w)}
    assert quoted >= {"3.6%", "5.6%", "9.2%", "9.5%", "40%", "55.7%", "87%", "146%", "57%"}
    for figure in quoted:
        assert figure in section, figure
