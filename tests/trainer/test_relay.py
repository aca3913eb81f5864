"""The channel between rank 0 and its launcher (trainer.run.relay), and the launcher's
pieces that need no process: the failure message read from torchrun's report, the timeout
setting, the defaults it copies from modules that load torch. Fast: a Pipe, no ranks."""

from __future__ import annotations

import threading
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from tests.trainer.ranks_support import Recorder
from trainer.errors import TrainerError
from trainer.run import launch
from trainer.run.callbacks import Callbacks, CompletionSample, RolloutSample, RunInfo
from trainer.run.launch import dist_timeout_s, failure_message
from trainer.run.rank_main import pid_file
from trainer.run.relay import (
    Failed,
    Finished,
    RankException,
    RelayCallbacks,
    RelayTimeout,
    deliver,
)


def serve(conn: Connection, callbacks: Callbacks, last: list[object]) -> None:
    """The launcher's loop, reduced to the channel: deliver until the run's last message."""
    while conn.poll(30):
        message = conn.recv()
        if deliver(message, callbacks, conn):
            last.append(message)
            return


def test_every_hook_reaches_the_launchers_callbacks_in_order_and_stop_is_answered() -> None:
    rank_end, launcher_end = Pipe()
    parent = Recorder(stop_after=2)
    last: list[object] = []
    server = threading.Thread(target=serve, args=(launcher_end, parent, last))
    server.start()
    relay = RelayCallbacks(rank_end, applies_retention=True, answer_timeout_s=30)
    info = RunInfo(3, 0, Path("/m"), Path("/out"), "cpu", "transformers")
    sample = RolloutSample("p", "7", [CompletionSample("7", 1.0, {"g": 1.0}, 0.5, 2, "stop")])
    relay.on_start(info)
    answers = []
    for step in (1, 2):
        relay.on_samples(step, [sample])
        relay.on_step(step, {"reward/mean": step / 2})
        answers.append(relay.should_stop())
    relay.on_event("stop", "stopping", "warning", {"step": 2})
    relay.on_checkpoint(2, Path("/out/checkpoint-000002"))
    relay.finish(Finished(2, {"reward/mean": 1.0}, Path("/out/checkpoint-000002"), True))
    server.join(30)

    assert answers == [False, True]  # the launcher's callbacks decide, after the step ran there
    assert relay.applies_retention  # the launcher's callbacks prune, so the trainer does not
    assert parent.calls == [
        ("start", info),
        ("samples", 1, [sample]),
        ("step", 1, {"reward/mean": 0.5}),
        ("should_stop",),
        ("samples", 2, [sample]),
        ("step", 2, {"reward/mean": 1.0}),
        ("should_stop",),
        ("event", "stop", "stopping", "warning", {"step": 2}),
        ("checkpoint", 2, Path("/out/checkpoint-000002")),
    ]
    assert last == [Finished(2, {"reward/mean": 1.0}, Path("/out/checkpoint-000002"), True)]


def test_rank_0_stops_waiting_for_an_answer_after_the_timeout() -> None:
    rank_end, _launcher_end = Pipe()
    relay = RelayCallbacks(rank_end, applies_retention=False, answer_timeout_s=0.2)
    with pytest.raises(RelayTimeout) as raised:
        relay.should_stop()
    assert raised.value.reason == "distributed_timeout"  # retried by the worker, like a peer


def test_a_failure_is_raised_in_the_launcher_with_its_reason() -> None:
    error = Failed("prompts_too_long", "no training row fits").exception()
    assert isinstance(error, TrainerError)
    assert (error.reason, str(error)) == ("prompts_too_long", "no training row fits")
    # Any other error is a bug, not the job's fault: the runner reports it as internal.
    other = Failed(None, "boom", "KeyError").exception()
    assert isinstance(other, RankException) and not isinstance(other, TrainerError)
    assert str(other) == "rank 0 failed: KeyError: boom"


TORCHRUN_REPORT = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=======================================================
trainer.run.rank_main FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-26_14:06:58
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 12804)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 12804
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-26_14:06:58
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : {code} (pid: 12805){signal}
  error_file: <N/A>
  traceback : {traceback}
======================================================="""


def test_the_failure_names_the_root_cause_rank_and_how_it_ended() -> None:
    killed = TORCHRUN_REPORT.format(
        code=-9, signal="  (SIGKILL)", traceback="Signal 9 (SIGKILL) received by PID 12805"
    )
    assert failure_message(1, killed.splitlines()) == (
        "rank 1 failed (killed by signal 9 (SIGKILL)) before the run ended; "
        "torchrun's agent exited with code 1"
    )
    crashed = TORCHRUN_REPORT.format(code=1, signal="", traceback="To enable traceback see: …")
    assert failure_message(1, crashed.splitlines()).startswith("rank 1 failed (exit code 1)")
    # No report (the agent itself was killed): the exit code alone, and no other output.
    assert failure_message(-9, ["Traceback", "/srv/secret/path"]) == (
        "a rank failed before rank 0 reported the end of the run "
        "(torchrun's agent exited with code -9)"
    )


def test_the_timeout_comes_from_the_environment() -> None:
    assert dist_timeout_s({}) == 600.0
    assert dist_timeout_s({"GRPO_DIST_TIMEOUT_S": "12.5"}) == 12.5
    with pytest.raises(ValueError, match="GRPO_DIST_TIMEOUT_S"):
        dist_timeout_s({"GRPO_DIST_TIMEOUT_S": "0"})


def test_the_launchers_copies_of_torch_side_defaults_agree() -> None:
    from trainer.distributed.world import DEFAULT_TIMEOUT_S
    from trainer.run.setup import DEFAULT_SAMPLE_GROUPS

    assert launch.DEFAULT_TIMEOUT_S == DEFAULT_TIMEOUT_S
    assert launch.DEFAULT_SAMPLE_GROUPS == DEFAULT_SAMPLE_GROUPS


def test_ranks_write_where_they_cannot_collide(tmp_path: Path) -> None:
    assert pid_file(tmp_path, 3) == tmp_path / "ranks" / "3.pid"


def test_launch_ranks_refuses_a_single_rank(tmp_path: Path) -> None:
    from jobspec import JobSpec
    from tests.conftest import tiny_spec

    spec = JobSpec.model_validate(tiny_spec())
    with pytest.raises(ValueError, match="nproc >= 2"):
        launch.launch_ranks(
            spec, Callbacks(), nproc=1, output_dir=tmp_path, resume_from=None, device="cpu"
        )


@pytest.mark.parametrize(
    "recipe", ["tiny-smoke.yaml", "smollm2-arithmetic.yaml", "smollm2-arithmetic-lora.yaml"]
)
def test_a_spec_survives_its_trip_to_the_ranks_as_json(recipe: str) -> None:
    from jobspec import JobSpec
    from trainer.run.cli import load_recipe

    spec = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / recipe)
    # As the worker hands it over: generated rows inline, a validation set appended.
    dataset = spec.dataset.with_rows(spec.dataset.all_rows())
    spec = spec.model_copy(update={"dataset": dataset})
    assert JobSpec.model_validate_json(spec.model_dump_json()) == spec
