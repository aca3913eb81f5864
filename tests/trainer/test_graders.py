from __future__ import annotations

from decimal import Decimal

import pytest
from pydantic import TypeAdapter

from trainer.config import GraderSpec
from trainer.graders import GraderSet, build_graders, last_number

_SPEC = TypeAdapter(GraderSpec)


def graders(*specs: dict[str, object]) -> GraderSet:
    return build_graders([_SPEC.validate_python(s) for s in specs])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("5", Decimal(5)),
        ("5.0", Decimal(5)),
        ("-3", Decimal(-3)),
        ("1,000", Decimal(1000)),
        ("x = 5.", Decimal(5)),
        ("2 + 3 = 5", Decimal(5)),
        ("The answer is 12, not 13!", Decimal(13)),
        ("x-3", Decimal(3)),
        ("y =-3", Decimal(-3)),
        ("0.5 or .25", Decimal("0.25")),
        ("1e3", Decimal(1000)),
        ("12,34", Decimal(34)),
        ("no digits", None),
        ("", None),
        (None, None),
        ("٣ ٤", None),  # non-ASCII digits are not numbers here
    ],
)
def test_last_number(text: str | None, expected: Decimal | None) -> None:
    assert last_number(text) == expected


@pytest.mark.parametrize(
    ("completion", "answer", "score"),
    [
        ("7", "7", 1.0),
        ("3 + 4 = 7.", "7", 1.0),
        ("7.0", "7", 1.0),
        ("The total is 1,000", "1000", 1.0),
        ("-3", "-3", 1.0),
        ("3", "-3", 0.0),
        ("7 is wrong, 8", "7", 0.0),
        ("seven", "7", 0.0),
        ("7", None, 0.0),
        ("", "7", 0.0),
        ("7", "", 0.0),
        ("7", "answer: 7", 1.0),
        ("9" * 5000, "9" * 5000, 1.0),
        ("1e999999999", "1e-999999999", 0.0),
    ],
)
def test_numeric_match(completion: str, answer: str | None, score: float) -> None:
    g = graders({"type": "numeric_match"})
    totals, per = g.score([completion], [answer])
    assert totals == [score]
    assert per["numeric_match"] == [score]


def test_numeric_tolerance() -> None:
    g = graders({"type": "numeric_match", "tolerance": 0.01})
    totals, _ = g.score(["3.141", "3.2"], ["3.14", "3.14"])
    assert totals == [1.0, 0.0]


def test_exact_match_normalisation() -> None:
    loose = graders({"type": "exact_match"})
    strict = graders({"type": "exact_match", "case_sensitive": True, "strip": False})
    texts, answers = ["  Paris\n", "paris", "Lyon"], ["paris", "Paris", None]
    assert loose.score(texts, answers)[0] == [1.0, 1.0, 0.0]
    assert strict.score(texts, answers)[0] == [0.0, 0.0, 0.0]
    assert strict.score(["Paris"], ["Paris"])[0] == [1.0]


def test_regex_search_and_full_match() -> None:
    search = graders({"type": "regex", "pattern": r"\d+"})
    full = graders({"type": "regex", "pattern": r"\d+", "full_match": True})
    texts = ["abc 12", "12", ""]
    assert search.score(texts, [None] * 3)[0] == [1.0, 1.0, 0.0]
    assert full.score(texts, [None] * 3)[0] == [0.0, 1.0, 0.0]


def test_length_grader_ramps() -> None:
    g = graders({"type": "length", "min_chars": 10, "max_chars": 20, "slack_chars": 10})
    texts = ["x" * n for n in (0, 5, 10, 15, 20, 25, 30, 40)]
    assert g.score(texts, [None] * len(texts))[0] == [0.0, 0.5, 1.0, 1.0, 1.0, 0.5, 0.0, 0.0]


def test_weighted_combination_and_names() -> None:
    g = graders(
        {"type": "numeric_match", "name": "correct", "weight": 1.0},
        {"type": "regex", "name": "fmt", "pattern": r"^\d+$", "weight": 0.5},
        {"type": "length", "name": "short", "max_chars": 3, "slack_chars": 1, "weight": -0.25},
    )
    totals, per = g.score(["7", "it is 7", "8"], ["7", "7", "7"])
    assert per == {
        "correct": [1.0, 1.0, 0.0],
        "fmt": [1.0, 0.0, 1.0],
        "short": [1.0, 0.0, 1.0],
    }
    assert totals == pytest.approx([1.25, 1.0, 0.25])
    assert g.names == ["correct", "fmt", "short"]
    assert g.max_total == 1.5


def test_odd_inputs_score_zero_and_never_raise() -> None:
    g = graders(
        {"type": "numeric_match"},
        {"type": "exact_match"},
        {"type": "regex", "pattern": r"b"},
    )
    weird: list[str] = ["", "\x00\x01", "🙂 ünïcødé ٣", "a" * 1_000_000 + "!", "\ud800"]
    totals, per = g.score(weird, [None, "", "٣", None, "x"])
    assert totals == [0.0] * len(weird)
    assert all(v == [0.0] * len(weird) for v in per.values())
    # Wrong types from a careless caller are odd text too.
    totals, _ = g.score([None, 5], ["1", None])  # type: ignore[list-item]
    assert totals == [0.0, 0.0]


def test_score_checks_lengths() -> None:
    with pytest.raises(ValueError, match="answers"):
        graders({"type": "exact_match"}).score(["a", "b"], ["a"])
