"""An async job (``grpo.async.max_staleness`` 1) on two ranks: one rollout server on rank 0,
whose producer samples both shares, the batch broadcast, the weights gathered on both ranks
and written once. It trains what one process trains (which samples both shares itself), its
metrics carry the staleness, and a resume on two ranks from a checkpoint that kept a batch
made ahead ends with the straight run's weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from jobspec import JobSpec
from tests.trainer.distributed.test_equivalence import (
    STEPS,
    final_weights,
    run_two_ranks,
    two_device_spec,
)
from trainer.run.callbacks import Callbacks
from trainer.run.loop import train

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def async_spec() -> JobSpec:
    return two_device_spec(
        grpo={
            "async": {"max_staleness": 1, "server_threads": 1},
            "dynamic_sampling": {"enabled": True, "max_rounds": 2},
        },
        dataset={
            "rows": [{"prompt": f"say {w}", "answer": "7"} for w in "abcdefghijk"],
            "holdout": 3,
        },
        eval={"interval": 1, "max_rows": 3},
        checkpoint_interval=1,
    )


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("async-two-ranks") / "straight"
    return out, run_two_ranks(async_spec(), out)


def test_two_async_ranks_train_what_one_async_process_trains(
    straight: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    two_dir, two = straight
    one: dict[int, dict[str, float]] = {}

    class Recorder(Callbacks):
        def on_step(self, step: int, metrics: dict[str, float]) -> None:
            one[step] = metrics

    train(async_spec(), Recorder(), output_dir=tmp_path / "one")
    assert sorted(int(k) for k in two) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        got = two[str(step)]
        # Step 1 trains on version 0 (lag 0); later steps on the weights of step t - 2.
        assert got["async/staleness_max"] == (0.0 if step == 1 else 1.0)
        assert got["async/behaviour_version"] == max(0, step - 2)
        for name in ("reward/mean", "tokens/trained", "loss/policy", "grad_norm", "eval/accuracy"):
            assert got[name] == pytest.approx(one[step][name], rel=1e-5, abs=1e-6), (step, name)
    a, b = final_weights(two_dir), final_weights(tmp_path / "one")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-5, msg=name)


def test_two_async_ranks_resume_exactly_from_a_checkpoint_with_a_batch_made_ahead(
    straight: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    straight_dir, straight_steps = straight
    middle = straight_dir / f"checkpoint-{STEPS - 1:06d}"
    resumed = tmp_path / "resumed"
    steps = run_two_ranks(async_spec(), resumed, resume_from=middle)
    assert sorted(int(k) for k in steps) == [STEPS]
    for name in ("reward/mean", "loss/policy", "grad_norm"):
        assert steps[str(STEPS)][name] == pytest.approx(
            straight_steps[str(STEPS)][name], rel=1e-6, abs=1e-7
        )
    expected, got = final_weights(straight_dir), final_weights(resumed)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)
