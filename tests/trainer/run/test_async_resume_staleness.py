"""Resuming an async run with another ``grpo.async.max_staleness`` (issue 45): the checkpoint
records K and the data position before each batch made ahead; a resume with another K samples
those steps again from there, so no prompt is dropped or skipped and no step asks for a version
the resumed run does not hold.

The run's own pieces (:class:`AsyncRollouts` with its pipeline, :class:`RunCheckpoints`, the
data sampler) driven step by step as ``trainer.run.loop`` drives them, with a fake rollout
server that, like the real one, refuses a version it was never given, and a fake sampling
call that draws each step's prompts from the real data sampler. The same through ``train()``
and a real rollout server: tests/trainer/run/test_async_resume_loop.py."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from jobspec import JobSpec
from trainer.checkpoint.store import TrainState
from trainer.data.dataset import PromptSampler
from trainer.distributed.world import World
from trainer.errors import TrainerError
from trainer.rollout.base import Completion
from trainer.run import async_run, checkpoints
from trainer.run.async_rollouts import SAMPLER_BEFORE_KEY, STALENESS_KEY
from trainer.run.async_run import VERSIONS_DIR, AsyncRollouts
from trainer.run.checkpoints import RunCheckpoints
from trainer.scoring.collect import Collected, Group
from trainer.update.schedule import lr_factor, make_scheduler

ROWS, PER_STEP, STEPS, PAUSED_AT = 5, 2, 8, 4  # 5 rows, 2 a step: epochs end mid-step


class FakeServer:
    """The rollout server's client as the run sees it: versions published by the weight sync,
    forgotten when retired, and a generate naming any other version refused, as
    ``trainer.rollout.weight_versions.PublishedVersions.resolve`` refuses it."""

    def __init__(self) -> None:
        self.publish_version = 1
        self.published: set[int] = set()
        self.restarts = 0

    def at_version(self, version: int) -> int:
        if version not in self.published:
            raise ValueError(f"version {version} is not published (or was forgotten)")
        return version

    def forget_versions_below(self, version: int) -> None:
        self.published = {v for v in self.published if v >= version}

    def close(self) -> None:
        pass


def fake_sync(setup: Any, sink: FakeServer) -> float:
    sink.published.add(sink.publish_version)
    sink.publish_version += 1
    return 0.0


def fake_collect(version: int, sampler: PromptSampler, spec: Any, **_: Any) -> Collected:
    """A step's batch: the next prompts of the data sampler, sampled with ``version``."""
    rows = sampler.next(spec.prompts_per_step)
    groups = [
        Group(
            row=row,
            prompt_ids=[row],
            completions=[Completion([1], [-0.5], "7", "stop", policy_version=version)] * 2,
            rewards=[0.0, 1.0],
            per_grader={},
            zero_std=False,
        )
        for row in rows
    ]
    return Collected(groups=groups, kept=list(groups), rounds=1)


class Disk:
    """The checkpoints a run wrote, as ``trainer.checkpoint.store`` keeps what these tests
    read: the sampler state, the manifest's extra, the optimizer and scheduler states."""

    def __init__(self) -> None:
        self.saved: dict[int, TrainState] = {}
        self.states: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}

    def save(self, output_dir: Path, step: int, **kw: Any) -> Path:
        self.saved[step] = TrainState(step, dict(kw["sampler"]), copy.deepcopy(kw["extra"]))
        self.states[step] = copy.deepcopy(
            (kw["optimizer"].state_dict(), kw["scheduler"].state_dict())
        )
        return output_dir / f"checkpoint-{step}"

    def load(self, path: Path, model: Any, optimizer: Any, scheduler: Any) -> TrainState:
        step = int(path.name.rsplit("-", 1)[1])
        optimizer.load_state_dict(self.states[step][0])
        scheduler.load_state_dict(self.states[step][1])
        return copy.deepcopy(self.saved[step])


@pytest.fixture
def disk(monkeypatch: pytest.MonkeyPatch) -> Disk:
    disk = Disk()
    monkeypatch.setattr(checkpoints, "save_checkpoint", disk.save)
    monkeypatch.setattr(checkpoints, "load_checkpoint", disk.load)
    monkeypatch.setattr("trainer.rollout.remote_start.start_remote_engine", _start_fake)
    monkeypatch.setattr(async_run, "sync_engine", fake_sync)
    monkeypatch.setattr(
        async_run,
        "collect_groups",
        lambda engine, scorer, sampler, ids, rows, spec, **kw: fake_collect(engine, sampler, spec),
    )
    return disk


def _start_fake(setup: Any, **kw: Any) -> FakeServer:
    setup.server_root = kw.get("root")
    return FakeServer()


def run_spec(k: int, steps: int = STEPS, learning_rate: float = 1e-3, **grpo: Any) -> JobSpec:
    return JobSpec.model_validate(
        {
            "model": "tiny-random-llama",
            "dataset": {"rows": [{"prompt": f"say {i}"} for i in range(ROWS)]},
            "graders": [{"type": "regex", "pattern": "7"}],
            "grpo": {
                "steps": steps,
                "prompts_per_step": PER_STEP,
                "group_size": 2,
                "learning_rate": learning_rate,
                "async": {"max_staleness": k},
                **grpo,
            },
        }
    )


def fake_setup(spec: JobSpec, output_dir: Path) -> Any:  # a RunSetup, as far as it is read
    model = nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.grpo.learning_rate)
    events: list[tuple[str, str]] = []
    return SimpleNamespace(
        config=spec,
        given_engine=None,
        model_path=Path("model"),
        world=World(),
        device=torch.device("cpu"),
        output_dir=output_dir,
        sampler=PromptSampler(ROWS, seed=0),
        scorer=None,
        train_ids=[],
        train_rows=[],
        shares=1,
        guard=SimpleNamespace(streak=0),
        mirror=None,
        model=model,
        rollout_model=model,
        tokenizer=None,
        optimizer=optimizer,
        scheduler=make_scheduler(optimizer, spec.grpo),
        events=events,
        callbacks=SimpleNamespace(
            applies_retention=False,
            on_checkpoint=lambda step, path: None,
            on_event=lambda kind, message, level="info", data=None: events.append((kind, message)),
        ),
    )


class Trained:
    """What each step trained on: its prompts (rows) and the version that sampled them."""

    def __init__(self) -> None:
        self.rows: dict[int, list[int]] = {}
        self.versions: dict[int, int] = {}

    def add(self, step: int, collected: Collected) -> None:
        self.rows[step] = [g.row for g in collected.kept]
        versions = {c.policy_version for g in collected.kept for c in g.completions}
        assert len(versions) <= 1, versions  # a step samples with one version
        self.versions[step] = versions.pop() if versions else None  # type: ignore[assignment]


def drive(setup: Any, trained: Trained, *, resume_at: int | None, stop_at: int | None) -> None:
    """``trainer.run.loop._Run.execute``'s order: restore, open, then per step collect,
    finish, checkpoint (at ``stop_at``), release."""
    cps = RunCheckpoints(setup)
    start = 0 if resume_at is None else cps.restore(setup.output_dir / f"checkpoint-{resume_at}")[0]
    k = setup.config.grpo.async_.max_staleness
    runner = AsyncRollouts(setup, rollout=None, seed=0) if k else None  # type: ignore[arg-type]
    if runner is not None:
        runner.open(start, cps.restored_extra if resume_at is not None else None)
    try:
        for step in range(start + 1, setup.config.grpo.steps + 1):
            if runner is None:  # the synchronous step: sampled now, with the current weights
                trained.add(step, fake_collect(step - 1, setup.sampler, setup.config.grpo))
            else:
                trained.add(step, runner.collect(step)[0])
                assert runner.finish_step(step, {}) is None
            if step == stop_at:
                extra = runner.checkpoint_state(step) if runner is not None else None
                cps.save(step, {}, extra_state=extra)
            if runner is not None:
                runner.release(step)
            if step == stop_at:
                return
    finally:
        if runner is not None:
            runner.close()


def straight_rows() -> dict[int, list[int]]:
    """The prompts of each step of any run (fixed batches: one round a step, whatever K)."""
    sampler = PromptSampler(ROWS, seed=0)
    return {step: sampler.next(PER_STEP) for step in range(1, STEPS + 1)}


def resumed_run(tmp_path: Path, k_before: int, k_after: int) -> tuple[Trained, SimpleNamespace]:
    trained = Trained()
    drive(fake_setup(run_spec(k_before), tmp_path), trained, resume_at=None, stop_at=PAUSED_AT)
    setup = fake_setup(run_spec(k_after), tmp_path)
    drive(setup, trained, resume_at=PAUSED_AT, stop_at=None)
    return trained, setup


@pytest.mark.parametrize(
    ("k_before", "k_after", "versions_after"),
    [
        # Steps 5..8 after a pause at step 4. The steps made ahead are sampled again; the
        # resumed run holds version 4 and up, so the first ones sample with version 4.
        (2, 1, [4, 4, 5, 6]),  # was dropped as too stale: rows of steps 5-6 lost
        (1, 2, [4, 4, 4, 5]),  # was "version 3 is not published"
        (0, 1, [4, 4, 5, 6]),  # a synchronous checkpoint: was "version 3 is not published"
        (0, 2, [4, 4, 4, 5]),
        (1, 0, [4, 5, 6, 7]),  # was the rows of step 5 skipped: the sampler was past them
        (2, 0, [4, 5, 6, 7]),  # was the rows of steps 5-6 skipped
    ],
)
def test_a_resume_with_another_k_trains_every_prompt_once_in_order(
    tmp_path: Path, disk: Disk, k_before: int, k_after: int, versions_after: list[int]
) -> None:
    trained, setup = resumed_run(tmp_path, k_before, k_after)
    assert trained.rows == straight_rows()  # no prompt dropped, skipped or trained twice
    assert [trained.versions[s] for s in range(5, STEPS + 1)] == versions_after
    assert disk.saved[PAUSED_AT].extra[STALENESS_KEY] == k_before
    if k_before:  # the batches made ahead are sampled again, and the run says so
        kind, note = setup.events[-1]
        assert kind == "resume" and f"max_staleness {k_before} -> {k_after}" in note


def test_a_resume_with_the_same_k_keeps_the_batches_made_ahead(tmp_path: Path, disk: Disk) -> None:
    trained, setup = resumed_run(tmp_path, 2, 2)
    assert trained.rows == straight_rows()
    # Steps 5 and 6 were made before the pause with versions 2 and 3, and trained as made.
    assert [trained.versions[s] for s in range(1, STEPS + 1)] == [0, 0, 0, 1, 2, 3, 4, 5]
    assert sorted(disk.saved[PAUSED_AT].extra[SAMPLER_BEFORE_KEY]) == ["5", "6"]
    assert setup.events == []


def _legacy(disk: Disk) -> None:
    """Step 4's checkpoint as written before K and the data positions were recorded."""
    extra = disk.saved[PAUSED_AT].extra
    del extra[STALENESS_KEY], extra[SAMPLER_BEFORE_KEY]


def test_an_older_checkpoint_that_cannot_be_resampled_is_refused_with_why(
    tmp_path: Path, disk: Disk
) -> None:
    drive(fake_setup(run_spec(2), tmp_path), Trained(), resume_at=None, stop_at=PAUSED_AT)
    _legacy(disk)
    for k in (1, 0):  # its batches are 2 versions behind: too stale for K = 1, none for K = 0
        with pytest.raises(TrainerError) as refused:
            drive(fake_setup(run_spec(k), tmp_path), Trained(), resume_at=PAUSED_AT, stop_at=None)
        assert refused.value.reason == "resume_refused"
        assert "resume it with grpo.async.max_staleness 2 or more" in str(refused.value)
    trained = Trained()  # a larger K keeps them (they fit), and goes on from version 4
    drive(fake_setup(run_spec(3), tmp_path), trained, resume_at=PAUSED_AT, stop_at=None)
    assert trained.versions == {5: 2, 6: 3, 7: 4, 8: 4}
    assert trained.rows == {s: r for s, r in straight_rows().items() if s > PAUSED_AT}


def test_the_weight_versions_live_in_the_runs_folder_and_leave_with_it(
    tmp_path: Path, disk: Disk
) -> None:
    setup = fake_setup(run_spec(1), tmp_path)
    leftover = tmp_path / VERSIONS_DIR / "rollout-server-dead" / "versions" / "v3"
    leftover.mkdir(parents=True)  # a killed attempt's version
    runner = AsyncRollouts(setup, rollout=None, seed=0)  # type: ignore[arg-type]
    assert setup.server_root == tmp_path / VERSIONS_DIR  # not the system's temporary folder
    assert not leftover.exists()
    runner.open(0, None)
    runner.close()
    assert not (tmp_path / VERSIONS_DIR).exists()


def test_a_resume_trains_at_the_specs_learning_rate_and_schedule(
    tmp_path: Path, disk: Disk
) -> None:
    """A paused job resumed with another learning rate or length trains at the new rate, at
    the schedule's restored position; unchanged, the rate is exactly the one written."""
    schedule: dict[str, Any] = {"warmup_steps": 2, "lr_schedule": "cosine"}
    first = fake_setup(run_spec(0, learning_rate=1e-2, **schedule), tmp_path)
    for _ in range(PAUSED_AT):  # four steps trained
        first.optimizer.step()
        first.scheduler.step()
    RunCheckpoints(first).save(PAUSED_AT, {})
    as_written = first.optimizer.param_groups[0]["lr"]

    def resumed_lr(spec: JobSpec) -> float:
        setup = fake_setup(spec, tmp_path)
        RunCheckpoints(setup).restore(tmp_path / f"checkpoint-{PAUSED_AT}")
        return float(setup.optimizer.param_groups[0]["lr"])

    assert resumed_lr(run_spec(0, learning_rate=1e-2, **schedule)) == as_written
    changed = run_spec(0, learning_rate=1e-3, steps=20, **schedule)
    assert resumed_lr(changed) == 1e-3 * lr_factor(changed.grpo, PAUSED_AT + 1)
    assert resumed_lr(changed) != as_written / 10  # the new length moved the cosine too
