"""The async rollout pipeline's schedule (trainer.run.async_rollouts): which version each step
samples with, how far ahead the producer runs, the stale-sample guard, and the batches a
checkpoint keeps."""

from __future__ import annotations

import threading

import pytest

from trainer.rollout.base import Completion
from trainer.run.async_rollouts import (
    RolloutPipeline,
    behaviour_version,
    drop_stale,
    pending_from_json,
    pending_to_json,
    staleness_metrics,
)
from trainer.scoring.collect import Collected, Group


def _group(row: int, versions: list[int | None]) -> Group:
    completions = [
        Completion([row, 2], [-0.5, -0.25], f"c{row}", "stop", policy_version=v) for v in versions
    ]
    return Group(
        row=row,
        prompt_ids=[1, row],
        completions=completions,
        rewards=[float(i) for i in range(len(versions))],
        per_grader={"exact": [0.0] * len(versions)},
        zero_std=False,
    )


def _collected(groups: list[Group]) -> Collected:
    return Collected(groups=groups, kept=list(groups), rounds=1, generated_tokens=4)


@pytest.mark.parametrize(
    ("k", "expected"), [(0, [0, 1, 2, 3]), (1, [0, 0, 1, 2]), (2, [0, 0, 0, 1])]
)
def test_step_t_samples_with_version_t_minus_1_minus_k(k: int, expected: list[int]) -> None:
    assert [behaviour_version(t, k) for t in (1, 2, 3, 4)] == expected


def test_samples_older_than_k_versions_never_reach_the_update() -> None:
    fresh, edge, stale = _group(0, [4, 4]), _group(1, [3, 4]), _group(2, [4, 2])
    collected = _collected([fresh, edge, stale])
    # Step 6 with K = 2 starts from version 5; version 3 is 2 behind, version 2 is 3 behind.
    dropped = drop_stale(collected, step=6, max_staleness=2)
    assert collected.kept == [fresh, edge]
    assert dropped == 2  # the stale group goes whole: its advantages are over all of it
    assert collected.groups == [fresh, edge, stale]  # still counted as sampled


def test_staleness_metrics_count_each_lag() -> None:
    collected = _collected([_group(0, [5, 4]), _group(1, [4, None])])
    metrics = staleness_metrics(collected, step=6, max_staleness=1)
    # Lags behind version 5: 0, 1, 1, and 0 for the sample without a version.
    assert metrics["async/staleness_max"] == 1.0
    assert metrics["async/staleness_mean"] == pytest.approx(0.5)
    assert metrics["async/staleness_count/0"] == 2.0
    assert metrics["async/staleness_count/1"] == 2.0


class _Recorder:
    """A produce function that records each (step, version) it was asked for."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def __call__(self, step: int, version: int) -> Collected:
        self.calls.append((step, version))
        return _collected([_group(step, [version, version])])


def _run_loop(k: int, steps: int) -> list[tuple[int, int]]:
    produce = _Recorder()
    pipeline = RolloutPipeline(produce, max_staleness=k, first_step=1, last_step=steps, published=0)
    pipeline.start()
    try:
        for step in range(1, steps + 1):
            collected, _ = pipeline.take(step)
            versions = {c.policy_version for g in collected.kept for c in g.completions}
            assert versions == {behaviour_version(step, k)}
            # The producer is never more than K steps ahead of the update.
            assert max(s for s, _ in produce.calls) <= step + k
            pipeline.publish(step)
    finally:
        pipeline.stop()
    return produce.calls


@pytest.mark.parametrize("k", [1, 2, 3])
def test_each_step_is_made_once_in_order_with_its_version(k: int) -> None:
    calls = _run_loop(k, steps=7)
    assert calls == [(s, behaviour_version(s, k)) for s in range(1, 8)]


def test_settle_waits_for_the_steps_ahead_and_returns_them() -> None:
    made = threading.Event()
    calls: list[int] = []

    def produce(step: int, version: int) -> Collected:
        calls.append(step)
        if step == 3:
            made.set()
        return _collected([_group(step, [version])])

    pipeline = RolloutPipeline(produce, max_staleness=2, first_step=1, last_step=10, published=0)
    pipeline.start()
    try:
        pipeline.take(1)
        pending = pipeline.settle(1)  # after step 1: steps 2 and 3 made, 4 waits for version 1
        assert sorted(pending) == [2, 3]
        assert calls == [1, 2, 3]
        pipeline.publish(1)
        pipeline.take(2)
        assert sorted(pipeline.settle(2)) == [3, 4]
    finally:
        pipeline.stop()


def test_a_resumed_pipeline_starts_after_the_kept_batches() -> None:
    calls: list[tuple[int, int]] = []

    def produce(step: int, version: int) -> Collected:
        calls.append((step, version))
        return _collected([_group(step, [version])])

    kept = {5: _collected([_group(5, [3])]), 6: _collected([_group(6, [4])])}
    pipeline = RolloutPipeline(
        produce, max_staleness=2, first_step=5, last_step=7, published=4, pending=kept
    )
    pipeline.start()
    try:
        assert pipeline.take(5)[0].kept[0].completions[0].policy_version == 3
        assert pipeline.take(6)[0].kept[0].completions[0].policy_version == 4
        pipeline.publish(5)
        assert pipeline.take(7)[0].kept[0].row == 7
    finally:
        pipeline.stop()
    assert calls == [(7, 4)]


def test_a_producer_error_reaches_the_loop() -> None:
    def produce(step: int, version: int) -> Collected:
        raise RuntimeError("the rollout server could not restart")

    pipeline = RolloutPipeline(produce, max_staleness=1, first_step=1, last_step=3, published=0)
    pipeline.start()
    with pytest.raises(RuntimeError, match="could not restart"):
        pipeline.take(1)
    pipeline.stop()


def test_kept_batches_round_trip_through_json() -> None:
    first = _collected([_group(0, [1, 2]), _group(1, [2, None])])
    first.kept = [first.groups[1]]
    first.grader_errors = {"exact": 1}
    first.rollout_metrics = [(2, {"episode/turns": 1.5})]
    second = _collected([_group(3, [2, 2])])
    import json

    data = json.loads(json.dumps(pending_to_json({4: first, 5: second})))
    back = pending_from_json(data)
    assert sorted(back) == [4, 5]
    assert back[4].groups == first.groups
    assert back[4].kept == [first.groups[1]]
    assert back[4].kept[0] is back[4].groups[1]
    assert back[4].grader_errors == {"exact": 1}
    assert back[4].rollout_metrics == [(2, {"episode/turns": 1.5})]
    assert back[5].groups == second.groups
