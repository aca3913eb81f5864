"""DURATION and requirement parsing, and checking requirements on final metric values."""

from __future__ import annotations

import pytest

from grpo_cli.gates import (
    FinalValue,
    Requirement,
    check,
    final_values,
    format_duration,
    parse_duration,
    parse_requirement,
)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90s", 90),
        ("30m", 1800),
        ("2h", 7200),
        ("1h30m", 5400),
        ("1h30m15s", 5415),
        ("1.5h", 5400),
        ("45", 45),
        ("2.5", 2.5),
        (" 10M ", 600),
        ("1d", 86400),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text", ["", "s", "10x", "h2", "1h 30m", "-5s", "0s", "0", "1m1m", "10s5", "1e3s", "abc"]
)
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("seconds", "text"), [(0.2, "0s"), (59.6, "1m"), (90, "1m30s"), (3725, "1h2m5s"), (7200, "2h")]
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("reward/mean>=0.6", Requirement("reward/mean", ">=", 0.6)),
        ("eval/accuracy > 0.5", Requirement("eval/accuracy", ">", 0.5)),
        ("kl<=1e-3", Requirement("kl", "<=", 0.001)),
        ("loss<-0.25", Requirement("loss", "<", -0.25)),
        ("reward/format/mean==1", Requirement("reward/format/mean", "==", 1.0)),
        ("  completion_len/mean  <  12  ", Requirement("completion_len/mean", "<", 12.0)),
    ],
)
def test_parse_requirement(text: str, expected: Requirement) -> None:
    assert parse_requirement(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "reward/mean",
        "reward/mean=0.6",
        "reward/mean=>0.6",
        "reward/mean!=0.6",
        ">=0.6",
        "reward/mean>=",
        "reward/mean>=high",
        "reward/mean>=nan",
        "reward/mean>=inf",
        "reward mean>=0.6",
        "a>=1>=2",
    ],
)
def test_parse_requirement_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="invalid requirement"):
        parse_requirement(text)


@pytest.mark.parametrize(
    ("op", "value", "holds"),
    [
        (">=", 0.6, True),
        (">=", 0.5999, False),
        (">", 0.6, False),
        (">", 0.61, True),
        ("<=", 0.6, True),
        ("<", 0.6, False),
        ("==", 0.6, True),
        ("==", 0.6000001, False),
    ],
)
def test_operators(op: str, value: float, holds: bool) -> None:
    assert Requirement("m", op, 0.6).holds(value) is holds


def test_final_value_is_the_last_recorded_step_of_each_metric() -> None:
    series = {
        "reward/mean": [
            {"step": 1, "value": 0.2},
            {"step": 3, "value": 0.9},
            {"step": 2, "value": 0.5},
        ],
        "eval/accuracy": [{"step": 5, "value": 0.25}, {"step": 10, "value": 0.75}],
        "never": [],
    }
    finals = final_values(series)
    assert finals == {
        "reward/mean": FinalValue(3, 0.9),
        "eval/accuracy": FinalValue(10, 0.75),
    }
    verdicts = check(
        [
            parse_requirement("reward/mean>=0.6"),
            parse_requirement("eval/accuracy>0.8"),
            parse_requirement("never>0"),
        ],
        finals,
    )
    assert [v.passed for v in verdicts] == [True, False, False]
    assert verdicts[0].as_dict() == {
        "requirement": "reward/mean>=0.6",
        "metric": "reward/mean",
        "op": ">=",
        "threshold": 0.6,
        "value": 0.9,
        "step": 3,
        "passed": True,
    }
    assert verdicts[2].final is None and verdicts[2].as_dict()["value"] is None
