"""OpenAI-style graders (string_check, text_similarity, multi), their templates and formulas,
scored against hand-computed values; grader JSON written as OpenAI's documentation writes it."""

from __future__ import annotations

import time
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from grading.expressions import ExpressionError, check_expression, evaluate
from grading.graders import GraderSet, build_grader, build_graders, grade_one
from grading.graders.text_similarity import SIMILARITY, SIMILARITY_METRICS
from grading.templates import TemplateError, check_template, render, sample_namespace
from jobspec import GraderSpec

SPEC: TypeAdapter[Any] = TypeAdapter(GraderSpec)


def grader(data: dict[str, Any]) -> Any:
    return build_grader(SPEC.validate_python(data))


def score(data: dict[str, Any], completion: str, item: dict[str, Any]) -> tuple[float, Any]:
    return tuple(grade_one(grader(data), completion, item))  # type: ignore[return-value]


# --------------------------------------------------------------------------- templates


def test_templates_read_the_sample_and_nested_item_fields() -> None:
    item = {"answer": "42", "meta": {"tags": ["a", "b"]}, "n": 3, "none": None}
    sample = sample_namespace('{"x": 1}')
    text = (
        "{{ sample.output_text }}|{{item.answer}}|{{ item.meta.tags.1 }}|{{item.n}}|{{item.none}}"
    )
    assert render(text, sample=sample, item=item) == '{"x": 1}|42|b|3|'
    assert render("{{ item.meta }}", sample=sample, item=item) == '{"tags":["a","b"]}'
    assert render("{{ sample.output_json.x }}", sample=sample, item=item) == "1"
    with pytest.raises(TemplateError, match=r"item\.missing is not in the item"):
        render("{{ item.missing }}", sample=sample, item=item)


@pytest.mark.parametrize(
    "bad",
    [
        "{{ item['a'] }}",
        "{{ sample.output_text | upper }}",
        "{{ os.environ }}",
        "{{}}",
    ],
)
def test_a_placeholder_is_a_path_and_nothing_else(bad: str) -> None:
    with pytest.raises(TemplateError):
        check_template(bad)
    with pytest.raises(ValidationError):
        SPEC.validate_python({"type": "string_check", "reference": bad, "operation": "eq"})


def test_a_path_reads_keys_never_attributes() -> None:
    check_template("{{ item.__class__.__mro__ }}")  # a path, so it parses...
    with pytest.raises(TemplateError, match="not in the item"):  # ...but finds no such key
        render("{{ item.__class__.__mro__ }}", sample=sample_namespace("x"), item={"a": 1})


# --------------------------------------------------------------------------- expressions


def test_formulas_compute_and_refuse_what_is_not_arithmetic() -> None:
    assert evaluate("0.7 * correct + 0.3 * format", {"correct": 1.0, "format": 0.5}) == 0.85
    assert evaluate("min(a, b) + abs(-a) / 2 + sqrt(b) ** 2", {"a": 0.2, "b": 0.25}) == 0.55
    for bad in ("__import__('os')", "a.real", "a[0]", "[x for x in a]", "lambda: 1", "c"):
        with pytest.raises(ExpressionError):
            check_expression(bad, {"a", "b"})
    for bad, values in (("a / b", {"a": 1.0, "b": 0.0}), ("a ** 100", {"a": 2.0})):
        with pytest.raises(ExpressionError):
            evaluate(bad, values)
    with pytest.raises(ExpressionError):
        evaluate("(-a) ** 0.5", {"a": 1.0})  # not a real number


# --------------------------------------------------------------------------- string_check


@pytest.mark.parametrize(
    ("operation", "completion", "expected"),
    [
        ("eq", "Paris", 1.0),
        ("eq", "paris", 0.0),
        ("ne", "Lyon", 1.0),
        ("like", "The capital is Paris.", 1.0),
        ("like", "the capital is paris.", 0.0),
        ("ilike", "the capital is PARIS.", 1.0),
        ("ilike", "Lyon", 0.0),
    ],
)
def test_string_check_operations(operation: str, completion: str, expected: float) -> None:
    data = {
        "type": "string_check",
        "name": "Capital check",
        "input": "{{ sample.output_text }}",
        "reference": "{{ item.reference_answer }}",
        "operation": operation,
    }
    assert score(data, completion, {"reference_answer": "Paris"}) == (expected, None)


def test_a_missing_item_field_is_a_counted_failure_not_a_silent_zero() -> None:
    graders = build_graders(
        [
            SPEC.validate_python(
                {"type": "string_check", "reference": "{{ item.label }}", "operation": "eq"}
            )
        ]
    )
    batch = graders.score_batch(["a", "a"], [{"label": "a"}, {}])
    assert batch.totals == [1.0, 0.0] and batch.errors == {"string_check": 1}


# --------------------------------------------------------------------------- text_similarity


def test_similarity_metrics_by_hand() -> None:
    def sim(metric: str, text: str, ref: str) -> float:
        data = {
            "type": "text_similarity",
            "input": "{{ sample.output_text }}",
            "reference": "{{ item.ref }}",
            "evaluation_metric": metric,
        }
        value, failure = score(data, text, {"ref": ref})
        assert failure is None
        return value

    # rapidfuzz's ratio: 2 * matches / total length = 2 * 3 / (4 + 3)
    assert sim("fuzzy_match", "cats", "cat") == pytest.approx(6 / 7)
    # ROUGE-1 F: "the cat sat" vs "the cat ran": P = R = 2/3
    assert sim("rouge_1", "the cat sat", "the cat ran") == pytest.approx(2 / 3)
    # ROUGE-2 F: bigrams {the cat, cat sat} vs {the cat, cat ran}: 1/2
    assert sim("rouge_2", "the cat sat", "the cat ran") == pytest.approx(0.5)
    # ROUGE-L F: LCS "the cat" = 2 tokens of 3 and 4: P = 2/3, R = 1/2 -> F = 4/7
    assert sim("rouge_l", "the cat sat", "the black cat ran") == pytest.approx(4 / 7)
    for metric in SIMILARITY_METRICS:
        same = "the very same sentence is here"  # six words: rouge_5 needs 5-grams
        assert sim(metric, same, same) == pytest.approx(1)
        assert sim(metric, "alpha beta gamma delta", "zzz yyy") == pytest.approx(0, abs=0.2)
    assert sorted(SIMILARITY) == sorted(SIMILARITY_METRICS)


# --------------------------------------------------------------------------- multi


MULTI = {
    "type": "multi",
    "name": "Arithmetic",
    "graders": {
        "correct": {
            "type": "string_check",
            "name": "correct",
            "input": "{{ sample.output_text }}",
            "reference": "{{ item.answer }}",
            "operation": "like",
        },
        "format": {"type": "regex", "name": "format", "pattern": "^[0-9]+$"},
    },
    "calculate_output": "0.7 * correct + 0.3 * format",
}


@pytest.mark.parametrize(
    ("completion", "expected"), [("7", 1.0), ("it is 7", 0.7), ("8", 0.3), ("eight", 0.0)]
)
def test_multi_combines_its_sub_graders(completion: str, expected: float) -> None:
    value, failure = score(MULTI, completion, {"answer": "7"})
    assert failure is None and value == pytest.approx(expected)


def test_multi_formulas_are_checked_when_the_spec_is() -> None:
    for formula, message in (("correct + missing", "unknown name"), ("correct.x", "Attribute")):
        with pytest.raises(ValidationError, match=message):
            SPEC.validate_python({**MULTI, "calculate_output": formula})
    nested = {**MULTI, "graders": {"inner": MULTI}, "calculate_output": "inner"}
    with pytest.raises(ValidationError, match="nest one level"):
        SPEC.validate_python(nested)
    # A result outside [0, 1] is a failed grade, counted, never a silently clipped reward.
    out_of_range = grader({**MULTI, "calculate_output": "correct + format"})
    assert tuple(grade_one(out_of_range, "7", {"answer": "7"})) == (0.0, "error")


# --------------------------------------------------------------------------- math


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("The answer is $\\frac{1}{2}$.", "0.5", 1.0),
        ("so x = \\boxed{2/4}", "\\frac{1}{2}", 1.0),
        ("It is 3.", "\\sqrt{9}", 1.0),
        ("The answer is 0.49", "1/2", 0.0),
        ("no idea", "7", 0.0),
    ],
)
def test_math_equivalence(completion: str, answer: str, expected: float) -> None:
    from grading.graders.math import MathEquivalence

    grader = MathEquivalence("math", 1.0, "{{ sample.output_text }}", "{{ item.answer }}")
    assert grader(completion, {"answer": answer}) == expected


def test_the_math_grader_runs_isolated_with_its_time_limit() -> None:
    from grading.graders.pool import IsolatedGrader

    built = grader({"type": "math", "timeout_s": 3})
    try:
        assert isinstance(built, IsolatedGrader) and built.timeout_s == 3
        batch = build_graders([SPEC.validate_python({"type": "math"})])
        result = batch.score_batch(["$x=\\frac{3}{6}$", "1"], [{"answer": "0.5"}, {"answer": "2"}])
        assert result.totals == [1.0, 0.0] and result.errors == {"math": 0}
        batch.close()
    finally:
        built.close()


@pytest.mark.timeout(120, method="thread")
def test_a_math_check_is_stopped_at_its_own_time_limit_and_counted_as_a_timeout() -> None:
    """math-verify's own 5 s limit used to fire first, inside the check, and answer "not
    equal": a check past the grader's limit scored as a wrong answer, never as a timeout, and
    a timeout_s above 5 s was not the limit. Now the process deadline is the only limit."""
    built = grader({"type": "math", "timeout_s": 10})
    try:
        started = time.monotonic()
        # Expanding (x+y+1)^200 in sympy: minutes, in Python code a SIGALRM interrupts.
        result = GraderSet([built]).score_batch(["$(x+y+1)^{200}$"], [{"answer": "1"}])
        assert result.timeouts == {"math": 1} and result.totals == [0.0]
        assert time.monotonic() - started >= 10  # math-verify's 5 s alarm no longer decides
        assert "time limit (10 s)" in (built.first_error or "")
    finally:
        built.close()
