"""Graders: scores, RE2 regex semantics, and failures (errors, time limits) that score 0 and
are counted. This module must not import torch or the app at import time: the isolated-grader
tests' subprocesses import it to unpickle the test graders defined here."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from grading.graders import (
    MAX_GRADED_CHARS,
    GraderSet,
    RegexMatch,
    ScoreBatch,
    build_graders,
    grade_one,
    last_number,
)
from grading.graders.pool import IsolatedGrader
from jobspec import GraderSpec, JobSpec
from trainer.scoring.rewards import RewardFunction, score_batch

_SPEC = TypeAdapter(GraderSpec)


def rows(*answers: str | None) -> list[dict[str, object]]:
    """Dataset rows as graders see them (PromptRow.item): the answer when there is one."""
    return [{"answer": a} if a is not None else {} for a in answers]


def graders(*specs: dict[str, object]) -> GraderSet:
    return build_graders([_SPEC.validate_python(s) for s in specs])


def regex(pattern: str, full: bool = False) -> GraderSet:
    return graders({"type": "regex", "pattern": pattern, "full_match": full})


def matches(pattern: str, text: str, full: bool = False) -> bool:
    return regex(pattern, full).score([text], rows(None))[0] == [1.0]


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
    totals, per = g.score([completion], rows(answer))
    assert totals == [score]
    assert per["numeric_match"] == [score]


def test_numeric_tolerance() -> None:
    g = graders({"type": "numeric_match", "tolerance": 0.01})
    totals, _ = g.score(["3.141", "3.2"], rows("3.14", "3.14"))
    assert totals == [1.0, 0.0]


def test_exact_match_normalisation() -> None:
    loose = graders({"type": "exact_match"})
    strict = graders({"type": "exact_match", "case_sensitive": True, "strip": False})
    texts, answers = ["  Paris\n", "paris", "Lyon"], rows("paris", "Paris", None)
    assert loose.score(texts, answers)[0] == [1.0, 1.0, 0.0]
    assert strict.score(texts, answers)[0] == [0.0, 0.0, 0.0]
    assert strict.score(["Paris"], rows("Paris"))[0] == [1.0]


def test_regex_search_and_full_match() -> None:
    search = graders({"type": "regex", "pattern": r"\d+"})
    full = graders({"type": "regex", "pattern": r"\d+", "full_match": True})
    texts = ["abc 12", "12", ""]
    assert search.score(texts, rows(*[None] * 3))[0] == [1.0, 1.0, 0.0]
    assert full.score(texts, rows(*[None] * 3))[0] == [0.0, 1.0, 0.0]


def test_length_grader_ramps() -> None:
    g = graders({"type": "length", "min_chars": 10, "max_chars": 20, "slack_chars": 10})
    texts = ["x" * n for n in (0, 5, 10, 15, 20, 25, 30, 40)]
    assert g.score(texts, rows(*[None] * len(texts)))[0] == [0.0, 0.5, 1.0, 1.0, 1.0, 0.5, 0.0, 0.0]


def test_weighted_combination_and_names() -> None:
    g = graders(
        {"type": "numeric_match", "name": "correct", "weight": 1.0},
        {"type": "regex", "name": "fmt", "pattern": r"^\d+$", "weight": 0.5},
        {"type": "length", "name": "short", "max_chars": 3, "slack_chars": 1, "weight": -0.25},
    )
    totals, per = g.score(["7", "it is 7", "8"], rows("7", "7", "7"))
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
    totals, per = g.score(weird, rows(None, "", "٣", None, "x"))
    assert totals == [0.0] * len(weird)
    assert all(v == [0.0] * len(weird) for v in per.values())
    # Wrong types from a careless caller are odd text too.
    totals, _ = g.score([None, 5], rows("1", None))  # type: ignore[list-item]
    assert totals == [0.0, 0.0]


def test_score_checks_lengths() -> None:
    with pytest.raises(ValueError, match="items"):
        graders({"type": "exact_match"}).score(["a", "b"], rows("a"))


def test_failures_are_zero_and_counted_per_grader() -> None:
    g = graders({"type": "exact_match"}, {"type": "regex", "pattern": "a"})
    batch = g.score_batch(["a", None, 5], rows("a", "a", None))  # type: ignore[list-item]
    assert batch.totals == [2.0, 0.0, 0.0]
    assert batch.errors == {"exact_match": 2, "regex": 2}  # the two non-text completions
    assert batch.timeouts == {"exact_match": 0, "regex": 0}


# --------------------------------------------------------------------------- RE2 regexes

# Python's re backtracks exponentially on this pattern when the text ends in a non-word
# character: minutes for 49 characters, holding the GIL (it hung three workers).
CATASTROPHIC = r"(\w+\s?)+$"
PROSE_49 = "Graders never stall a worker, whatever you write!"


@pytest.mark.timeout(60, method="thread")
def test_catastrophic_backtracking_pattern_is_graded_at_once() -> None:
    assert len(PROSE_49) == 49
    g = graders(
        {"type": "regex", "name": "search", "pattern": CATASTROPHIC},
        {"type": "regex", "name": "full", "pattern": CATASTROPHIC, "full_match": True},
    )
    long_prose = (PROSE_49 + " ") * (MAX_GRADED_CHARS // 50) + "!"
    texts = [PROSE_49, PROSE_49[:-1], long_prose] * 8
    started = time.monotonic()
    batch = g.score_batch(texts, rows(*[None] * len(texts)))
    assert time.monotonic() - started < 5.0  # RE2: milliseconds; Python's re: minutes
    # The "!" at the end is what makes backtracking explode: there is no match to find.
    assert batch.components["search"] == [0.0, 1.0, 0.0] * 8  # "...you write" matches
    assert batch.components["full"] == [0.0, 0.0, 0.0] * 8  # the comma is neither \w nor \s
    assert batch.errors == {"search": 0, "full": 0}


@pytest.mark.parametrize(
    ("pattern", "text", "full", "expected"),
    [
        # \d, \w, \s and \b are ASCII in RE2 (Python's are Unicode); \pL, \p{Nd} are Unicode.
        (r"^\d+$", "42", False, True),
        (r"\d", "٣", False, False),
        (r"\p{Nd}", "٣", False, True),
        (r"^\w+$", "héllo", False, False),
        (r"^\pL+$", "héllo", False, True),
        (r"^[\pL\pN_]+$", "naïve_42", False, True),
        (r"\bcat\b", "a cat!", False, True),
        (r"a\sb", "a\tb", False, True),
        # $ is the end of the text only (Python's $ also matches before a final newline).
        (r"^\d+$", "42\n", False, False),
        (r"^\d+\s*$", "42\n", False, True),
        (r"\d\z", "4\n", False, False),
        (r"(?m)^answer: \d+$", "think...\nanswer: 7\nbye", False, True),
        # . stops at newlines unless (?s); (?i) folds Unicode case.
        (r"a.b", "a\nb", False, False),
        (r"(?s)a.b", "a\nb", False, True),
        (r"(?i)ÉTÉ", "un été", False, True),
        # search finds the pattern anywhere; full_match needs all of the text.
        (r"\d+", "abc 12", False, True),
        (r"\d+", "abc 12", True, False),
        (r"a|ab", "ab", True, True),
        (r"^\s*-?\d+\s*$", "  -12 \n", True, True),
        (r"(?P<num>\d+)", "x 3", False, True),
        (r"🙂+", "ok 🙂🙂", False, True),
        (r"x*", "", True, True),
    ],
)
def test_re2_semantics(pattern: str, text: str, full: bool, expected: bool) -> None:
    assert matches(pattern, text, full) is expected


def test_regex_on_text_re2_cannot_encode_scores_instead_of_failing() -> None:
    g = regex("b")
    batch = g.score_batch(["a\ud800b", "\ud800"], rows(None, None))
    assert batch.totals == [1.0, 0.0]
    assert batch.errors == {"regex": 0}


@pytest.mark.parametrize(
    ("pattern", "words"),
    [
        (r"foo(?=bar)", "linear time"),
        (r"(?<!x)y", "linear time"),
        (r"(a)\1", "linear time"),
        (r"(?P<n>a)(?P=n)", "linear time"),
        (r"a++", "linear time"),
        (r"(?>ab)", "linear time"),
        (r"end\Z", "write \\z"),
        (r"(", "missing )"),
        (r"(?:\pL{0,200}Q){2}", "MiB"),
    ],
)
def test_patterns_re2_cannot_run_are_rejected_naming_the_field(pattern: str, words: str) -> None:
    body = {
        "dataset": {"rows": [{"prompt": "p"}]},
        "graders": [{"type": "regex", "pattern": pattern}],
    }
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate(body)
    (error,) = info.value.errors()
    assert error["loc"] == ("graders", 0, "regex", "pattern")
    assert words in error["msg"]
    if words == "linear time":
        assert "lookaround" in error["msg"] and "backreferences" in error["msg"]


# --------------------------------------------------------------------------- failures, limits


@dataclass(frozen=True)
class Misbehaving:
    """A test grader (module level, so a subprocess can unpickle it): the completion says what
    to do. "hang" spins in pure Python holding the GIL, "sleep" sleeps, "raise" raises, "nan"
    and "big" return non-scores, "exit" kills its process; anything else scores 1."""

    name: str = "misbehaving"
    weight: float = 1.0

    def __call__(self, completion: str, item: object) -> float:
        if completion == "hang":
            while True:
                pass
        if completion == "sleep":
            time.sleep(3600)
        if completion == "raise":
            raise RuntimeError("boom")
        if completion == "exit":
            os._exit(3)
        return {"nan": float("nan"), "big": 2.0}.get(completion, 1.0)


@pytest.mark.parametrize("text", ["raise", "nan", "big"])
def test_inline_failures_score_zero_and_are_errors(text: str) -> None:
    assert grade_one(Misbehaving(), text, None) == (0.0, "error")
    batch = GraderSet([Misbehaving()]).score_batch(["ok", text], rows(None, None))
    assert batch.totals == [1.0, 0.0]
    assert batch.errors == {"misbehaving": 1} and batch.timeouts == {"misbehaving": 0}


@pytest.fixture
def isolated() -> Any:
    made: list[IsolatedGrader] = []

    def make(**limits: Any) -> IsolatedGrader:
        made.append(IsolatedGrader(Misbehaving(), **limits))
        return made[-1]

    yield make
    for grader in made:
        grader.close()


@pytest.mark.process  # spawned grader workers
@pytest.mark.timeout(120, method="thread")
def test_a_hanging_grader_is_cut_off_at_its_time_limit(isolated: Any) -> None:
    grader = isolated(timeout_s=1.0)
    texts = ["ok", "hang", "ok", "sleep", "raise", "exit", "ok"]
    started = time.monotonic()
    batch = GraderSet([grader]).score_batch(texts, rows(*[None] * len(texts)))
    elapsed = time.monotonic() - started
    assert batch.totals == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert batch.timeouts == {"misbehaving": 2}  # hang, sleep
    assert batch.errors == {"misbehaving": 4}  # and raise, exit
    # Two 1 s limits and the restarts of killed workers: seconds, never the hour of "sleep".
    assert elapsed < 60
    # The grader keeps working after it killed and replaced its workers.
    assert grader.grade_batch(["ok"], rows(None)) == [(1.0, None)]


@pytest.mark.process  # spawned grader workers
@pytest.mark.timeout(120, method="thread")
def test_the_batch_budget_bounds_a_grader_that_always_hangs(isolated: Any) -> None:
    grader = isolated(timeout_s=1.0, batch_timeout_s=2.5)
    texts = ["hang"] * 20
    started = time.monotonic()
    batch = GraderSet([grader]).score_batch(texts, rows(*[None] * len(texts)))
    assert time.monotonic() - started < 30  # one batch budget (+ a kill), not 20 timeouts
    assert batch.totals == [0.0] * 20
    assert batch.timeouts == batch.errors == {"misbehaving": 20}


@pytest.mark.process  # spawned grader workers
@pytest.mark.timeout(120, method="thread")
def test_isolated_workers_share_a_batch_and_are_reused_then_closed(isolated: Any) -> None:
    grader = isolated(timeout_s=5.0, processes=2)
    texts = ["ok", "big", "ok", "ok", "raise"]
    assert [g.score for g in grader.grade_batch(texts, rows(*[None] * 5))] == [1, 0, 1, 1, 0]
    pids = [w.process.pid for w in grader._workers]
    assert len(set(pids)) == 2
    assert grader("ok", {}) == 1.0
    assert [w.process.pid for w in grader._workers] == pids  # no restart without a failure
    processes = [w.process for w in grader._workers]
    grader.close()
    assert not any(p.is_alive() for p in processes)


@pytest.mark.timeout(120, method="thread")
def test_a_builtin_grader_runs_the_same_isolated() -> None:
    inner = RegexMatch.of("fmt", r"^\d+$", weight=0.5)
    wrapped = IsolatedGrader(inner, timeout_s=5.0)
    try:
        texts, answers = ["12", "x", "٣"], rows(None, None, None)
        assert GraderSet([wrapped]).score_batch(texts, answers) == GraderSet([inner]).score_batch(
            texts, answers
        )
        assert wrapped.name == "fmt" and wrapped.weight == 0.5
    finally:
        wrapped.close()


def test_score_batch_of_a_reward_function_counts_nothing() -> None:
    fn = RewardFunction(lambda c, a: [float(len(x)) for x in c], name="chars")
    assert score_batch(fn, ["ab", ""], rows(None, None)) == ScoreBatch(
        [2.0, 0.0], {"chars": [2.0, 0.0]}, {"chars": 0}, {"chars": 0}
    )


def test_step_metrics_count_grader_failures() -> None:
    # torch comes with these: imported here, not at the top (see the module docstring).
    from jobspec import GRPOSpec
    from trainer.data.dataset import Example, PromptSampler
    from trainer.rollout.base import Completion
    from trainer.run.metrics import rollout_metrics
    from trainer.scoring.collect import collect_groups

    texts = iter(["ok", "raise", "nan", "ok"])

    class Engine:
        def generate(self, prompts: list[list[int]], n: int, **_: Any) -> list[list[Completion]]:
            return [[Completion([1], None, next(texts), "stop") for _ in range(n)] for _ in prompts]

    scorer = GraderSet([Misbehaving(), Misbehaving("plain", 0.5)])
    spec = GRPOSpec(prompts_per_step=2, group_size=2)
    col = collect_groups(
        Engine(),  # type: ignore[arg-type]
        scorer,
        PromptSampler(2, seed=0),
        [[1], [2]],
        [Example("p", None), Example("q", None)],
        spec,
        seed=0,
        step=1,
        should_stop=lambda: False,
    )
    metrics = rollout_metrics(col, scorer.names)
    assert metrics["reward/misbehaving/errors"] == 2
    assert metrics["reward/plain/errors"] == 2
    assert metrics["reward/errors"] == 4
    assert metrics["reward/timeouts"] == 0
    assert metrics["reward/misbehaving/mean"] == 0.5


def test_validating_patterns_keeps_none_of_them_in_re2s_cache() -> None:
    import re2

    from jobspec import compile_regex

    before = re2._Regexp._make.cache_info().currsize
    for i in range(20):
        compile_regex(rf"\pL{{{i}}}x")
    assert re2._Regexp._make.cache_info().currsize == before
