"""The python grader's sandbox against hostile graders, each written to return 1.0 only if its
attack worked: every one is stopped or denied within its limit, the sample scores 0 with the
error reported, and the next sample goes on; a well-behaved grader scores right."""

from __future__ import annotations

import shutil
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from grading.graders import GraderSet
from grading.graders.python import PythonGrade
from grading.python_source import MAX_SOURCE_NESTING
from grading.sandbox import SandboxPool, build_sandbox_settings
from jobspec import PythonGrader as PythonGraderSpec

# Bubblewrap sandboxes, some killed and restarted: processes of their own (marker `process`).
pytestmark = [
    pytest.mark.process,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed"),
]

SETTINGS = build_sandbox_settings(
    processes=2, cpu_s=1.0, call_timeout_s=3.0, memory_mb=256, max_processes=64
)
GOOD = (
    "def grade(sample, item):\n    return 1.0 if sample['output_text'] == item['answer'] else 0.0"
)


def grader(body: str) -> str:
    return "import os, socket, subprocess, sys\n\ndef grade(sample, item):\n" + textwrap.indent(
        textwrap.dedent(body), "    "
    )


ATTACKS = {
    "socket to the broker": """
        s = socket.create_connection(("127.0.0.1", 6379), timeout=1)
        return 1.0
    """,
    "read /etc/passwd": """
        return 1.0 if "root:" in open("/etc/passwd").read() else 0.5
    """,
    "read the worker's environment": """
        assert "GRPO_DATABASE_URL" in os.environ, sorted(os.environ)
        return 1.0
    """,
    "read the worker's data dir": """
        return 1.0 if open(item["secret_path"]).read() else 0.5
    """,
    "write outside its temp dir": """
        open("/usr/evil", "w").write("x")
        return 1.0
    """,
    "fork bomb": """
        while True:
            os.fork()
    """,
    "allocate 8 GiB": """
        block = bytearray(8 << 30)
        return 1.0
    """,
    "infinite loop": """
        while True:
            pass
    """,
    "print 100 MB": """
        print("x" * 100_000_000)
        return 1.0
    """,
    "new namespaces (seccomp)": """
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER
            raise OSError(ctypes.get_errno(), "unshare refused")
        return 1.0
    """,
    "ptrace (seccomp)": """
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.ptrace(0, 0, None, None) != 0:  # PTRACE_TRACEME
            raise OSError(ctypes.get_errno(), "ptrace refused")
        return 1.0
    """,
    "a forged reply nested past the parser": """
        os.write(1, b"[" * 200_000 + b"\\n")
        return 1.0
    """,
    "a forged score no float can hold": """
        os.write(1, b'{"score": 1' + b"0" * 400 + b'}\\n')
        return 1.0
    """,
    "write 100 MB to the protocol pipe": """
        os.write(1, b"x" * 100_000_000)
        return 1.0
    """,
}


@pytest.fixture
def secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("GRPO_DATABASE_URL", "postgresql://user:hunter2@db/grpo")
    path = tmp_path / "data" / "keys.txt"
    path.parent.mkdir()
    path.write_text("sk-secret")
    yield path


@pytest.mark.parametrize("attack", list(ATTACKS), ids=list(ATTACKS))
def test_an_attack_is_stopped_and_the_next_sample_goes_on(attack: str, secret: Path) -> None:
    pool = SandboxPool(grader(ATTACKS[attack]), SETTINGS)
    try:
        started = time.monotonic()
        items = [{"answer": "a", "secret_path": str(secret)}]
        (verdict,) = pool.grade([{"output_text": "a"}], items)
        elapsed = time.monotonic() - started
        assert verdict.score == 0.0 and verdict.failure is not None, verdict
        assert verdict.error, verdict  # the reason reaches the job's events
        assert elapsed < SETTINGS.call_timeout_s + 5, elapsed
        assert "hunter2" not in verdict.error and "sk-secret" not in verdict.error
        # The same pool grades on (a killed sandbox was replaced).
        again = pool.grade([{"output_text": "a"}] * 3, items * 3)
        assert len(again) == 3 and all(v.failure is not None for v in again)
    finally:
        pool.close()


def test_a_well_behaved_grader_scores_right_in_parallel() -> None:
    pool = SandboxPool(GOOD, SETTINGS)
    try:
        samples = [{"output_text": t} for t in ("a", "b", "a", "c", "a", "a")]
        verdicts = pool.grade(samples, [{"answer": "a"}] * 6)
        assert [v.score for v in verdicts] == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
        assert all(v.failure is None for v in verdicts)
    finally:
        pool.close()


def test_errors_are_counted_and_the_first_becomes_the_message() -> None:
    source = "def grade(sample, item):\n    return 1 / int(sample['output_text'])"
    python = PythonGrade("py", 1.0, source, settings=SETTINGS)
    try:
        batch = GraderSet([python]).score_batch(["1", "0", "2"], [{}, {}, {}])
        assert batch.totals == [1.0, 0.0, 0.5]
        assert batch.errors == {"py": 1}
        assert batch.first_errors == {"py": "ZeroDivisionError: division by zero"}
    finally:
        python.close()


def test_a_grader_that_does_not_load_fails_every_sample_with_its_reason() -> None:
    python = PythonGrade(
        "py", 1.0, "raise SystemExit('no')\ndef grade(s, i):\n    return 1", settings=SETTINGS
    )
    batch = GraderSet([python]).score_batch(["a", "b"], [{}, {}])
    assert batch.totals == [0.0, 0.0] and batch.errors == {"py": 2}
    assert "did not load" in batch.first_errors["py"]


def test_the_deepest_source_validation_accepts_loads_and_grades_in_the_sandbox() -> None:
    """Validation bounds how deeply a source nests (grading.python_source) so that what it
    accepts the sandbox compiles too: the deepest accepted source scores like any other."""

    def nested(levels: int) -> str:  # `return 1 - (1 - (... 1))`: a level per parenthesis
        return "def grade(sample, item):\n    return " + "1 - (" * levels + "1" + ")" * levels

    def accepted(levels: int) -> bool:
        try:
            PythonGraderSpec(type="python", source=nested(levels))
        except ValidationError:
            return False
        return True

    deepest = next(n for n in range(MAX_SOURCE_NESTING, 0, -1) if accepted(n))
    assert deepest > MAX_SOURCE_NESTING - 10  # the module, the def and the return count too
    with pytest.raises(ValidationError, match="nests too deeply"):
        PythonGraderSpec(type="python", source=nested(deepest + 1))
    python = PythonGrade("py", 1.0, nested(deepest), settings=SETTINGS)
    try:
        batch = GraderSet([python]).score_batch(["a"], [{}])
        assert batch.errors == {"py": 0} and batch.totals == [1.0 if deepest % 2 == 0 else 0.0]
    finally:
        python.close()


def test_a_training_job_grades_with_a_python_grader_reading_item_fields(tmp_path: Path) -> None:
    """The loop scores with the sandboxed grader: item fields arrive, a raising call scores 0
    and is counted, and its first error of the step becomes an event."""
    from tests.trainer.test_loop import Recorder, tiny_spec
    from trainer.run.loop import train

    source = (
        "def grade(sample, item):\n"
        "    text = sample['output_text']\n"
        "    if len(text) % 3 == 0:\n"
        "        raise ValueError('no multiples of 3 please')\n"
        "    return 1.0 if item['digit'] in text else 0.0\n"
    )
    rows = [{"prompt": f"say {w}", "digit": "7"} for w in "abcdefgh"]
    spec = tiny_spec(
        steps=2,
        dataset={"rows": rows},
        graders=[{"type": "python", "name": "has digit", "source": source}],
    )
    rec = Recorder()
    train(spec, rec, output_dir=tmp_path)
    for metrics in rec.metrics.values():
        assert 0 < metrics["reward/has digit/mean"] < 1
    errors = [m["reward/has digit/errors"] for m in rec.metrics.values()]
    assert all(e > 0 for e in errors), errors  # about a third of the completions
    grader_events = [m for kind, _, m in rec.events if kind == "grader"]
    assert len(grader_events) == 2  # one per step, with the first error
    assert all("ValueError: no multiples of 3 please" in m for m in grader_events)


def test_without_the_seccomp_filter_the_same_calls_get_through() -> None:
    """The control of the two seccomp attacks above: the namespaces alone let them through,
    so it is the filter that refuses them."""
    open_settings = build_sandbox_settings(seccomp=False, cpu_s=1.0, call_timeout_s=3.0)
    for attack in ("new namespaces (seccomp)", "ptrace (seccomp)"):
        pool = SandboxPool(grader(ATTACKS[attack]), open_settings)
        try:
            (verdict,) = pool.grade([{"output_text": "a"}], [{}])
            assert (verdict.score, verdict.failure) == (1.0, None), (attack, verdict)
        finally:
            pool.close()


@pytest.mark.parametrize("attack", list(ATTACKS), ids=list(ATTACKS))
def test_an_attack_inside_a_training_job_scores_zero_and_the_job_goes_on(
    attack: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, secret: Path
) -> None:
    """The same hostile graders as a job's reward: every sample scores 0, each step counts the
    failures and reports the first, and the job finishes its steps."""
    from tests.trainer.test_loop import Recorder, tiny_spec
    from trainer.run.loop import train

    for name, value in (("CALL_TIMEOUT_S", "1.5"), ("CPU_S", "1"), ("MEMORY_MB", "256")):
        monkeypatch.setenv(f"GRPO_SANDBOX_{name}", value)
    rows = [{"prompt": f"say {w}", "answer": "a", "secret_path": str(secret)} for w in "ab"]
    spec = tiny_spec(
        steps=2,
        grpo={"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
        dataset={"rows": rows},
        graders=[{"type": "python", "name": "hostile", "source": grader(ATTACKS[attack])}],
    )
    rec = Recorder()
    result = train(spec, rec, output_dir=tmp_path / "run")
    assert result.final_step == 2
    for metrics in rec.metrics.values():
        assert metrics["reward/hostile/errors"] == 4 and metrics["reward/mean"] == 0.0
    assert len([kind for kind, _, _ in rec.events if kind == "grader"]) == 2
