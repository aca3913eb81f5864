"""The job spec's `checkpoint` section and its retention rule (CheckpointSpec.kept_steps), which
the trainer (as a library) and the service's worker both apply; and the trainer applying it to
real checkpoints in an output folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from jobspec import CheckpointSpec, JobSpec
from jobspec.checkpoint_files import folder_bytes, remove_folder
from tests.conftest import tiny_spec
from trainer.checkpoint.store import (
    RETENTION_METRIC,
    list_checkpoints,
    prune_checkpoints,
    save_checkpoint,
    sweep_temp_dirs,
)
from trainer.models.loading import load_policy, resolve_model


def test_keeps_the_newest_n_and_the_best_by_the_metric() -> None:
    spec = CheckpointSpec(keep_last=2, keep_best_by="eval/accuracy")
    values = {1: None, 2: 0.25, 3: 0.75, 4: 0.5, 5: 0.5, 6: 0.6}
    assert spec.kept_steps(values.items()) == {3, 5, 6}
    # min: the lowest; a value of None never ranks (the metric was not reported yet).
    low = CheckpointSpec(keep_last=1, keep_best_by="loss/policy", best_mode="min")
    assert low.kept_steps(values.items()) == {2, 6}
    # Equal best values: the oldest of them (the one that reached it).
    assert spec.kept_steps([(1, 0.9), (2, 0.9), (3, 0.1), (4, 0.1)]) == {1, 3, 4}
    # Non-finite values never rank either.
    assert spec.kept_steps([(1, float("nan")), (2, 0.1), (3, 0.0)]) == {2, 3}


def test_without_a_metric_or_a_limit() -> None:
    assert CheckpointSpec(keep_last=3).kept_steps((s, None) for s in range(1, 8)) == {5, 6, 7}
    assert CheckpointSpec(keep_last=None).kept_steps((s, 1.0) for s in (4, 2, 9)) == {2, 4, 9}
    assert CheckpointSpec().kept_steps([]) == set()
    # The newest checkpoint (a resume starts from it) is always kept.
    best_first = CheckpointSpec(keep_last=1, keep_best_by="eval/accuracy")
    assert best_first.kept_steps([(1, 1.0), (2, 0.0), (3, None)]) == {1, 3}


def test_old_specs_keep_working_and_the_section_is_strict() -> None:
    old = JobSpec.model_validate(tiny_spec() | {"checkpoint_interval": 4})
    assert old.checkpoint_interval == 4
    assert old.checkpoint == CheckpointSpec(keep_last=3, keep_best_by=None, best_mode="max")
    spec = JobSpec.model_validate(
        tiny_spec() | {"checkpoint": {"keep_last": 2, "keep_best_by": "reward/Exact match/mean"}}
    )
    assert spec.checkpoint.keep_best_by == "reward/Exact match/mean"
    assert (
        JobSpec.model_validate(
            tiny_spec() | {"checkpoint": {"keep_last": None}}
        ).checkpoint.keep_last
        is None
    )
    bad: list[tuple[dict[str, Any], str]] = [
        ({"keep_last": 0}, "keep_last"),
        ({"keep_last": 10**9}, "keep_last"),
        ({"keep_best_by": ""}, "keep_best_by"),
        ({"keep_best_by": "eval//accuracy"}, "keep_best_by"),
        ({"keep_best_by": "../etc/passwd"}, "keep_best_by"),
        ({"keep_best_by": "a\nb"}, "keep_best_by"),
        ({"keep_best_by": "x" * 201}, "keep_best_by"),
        ({"best_mode": "median"}, "best_mode"),
        ({"keep_lats": 2}, "keep_lats"),
    ]
    for section, field in bad:
        with pytest.raises(ValidationError) as caught:
            JobSpec.model_validate(tiny_spec() | {"checkpoint": section})
        assert [e["loc"] for e in caught.value.errors()] == [("checkpoint", field)], section


# --------------------------------------------------------------------------- on disk


@pytest.fixture(scope="module")
def tiny() -> Any:
    model, tokenizer = load_policy(resolve_model("tiny-random-llama"))
    return model, tokenizer, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _save(out: Path, step: int, tiny: Any, **kw: Any) -> Path:
    model, tokenizer, optimizer = tiny
    return save_checkpoint(
        out,
        step,
        model=model,
        tokenizer=tokenizer,
        optimizer=optimizer,
        scheduler=None,
        sampler={"epoch": 0, "index": step},
        **kw,
    )


def test_the_trainer_prunes_its_folder_by_the_rule(tmp_path: Path, tiny: Any) -> None:
    keep = CheckpointSpec(keep_last=2, keep_best_by="eval/accuracy")
    accuracy = {3: 0.2, 6: 0.7, 9: 0.4, 12: 0.5}  # evaluated every 3 steps
    latest: float | None = None
    seen: list[tuple[int, float | None]] = []
    for step in range(1, 13):
        latest = accuracy.get(step, latest)  # the value at or before the step
        extra = {RETENTION_METRIC: {"name": "eval/accuracy", "value": latest}}
        _save(tmp_path, step, tiny, extra=extra, retention=keep)
        seen.append((step, latest))
        # After every save the folder holds exactly what the rule keeps of all saved so far.
        assert {s for s, _ in list_checkpoints(tmp_path)} == keep.kept_steps(seen)
    # The newest two, and step 6 (the first with the best accuracy, 0.7; steps 7 and 8 carry
    # the same value until the next evaluation, and went as newer checkpoints came).
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-000006",
        "checkpoint-000011",
        "checkpoint-000012",
    ]


def test_a_checkpoint_without_a_recorded_value_never_ranks(tmp_path: Path, tiny: Any) -> None:
    for step in (1, 2, 3):
        _save(tmp_path, step, tiny)  # no retention value in the manifest
    manifest = json.loads((tmp_path / "checkpoint-000003" / "manifest.json").read_text())
    assert RETENTION_METRIC not in manifest["extra"]
    removed = prune_checkpoints(tmp_path, CheckpointSpec(keep_last=1, keep_best_by="eval/accuracy"))
    assert sorted(p.name for p in removed) == ["checkpoint-000001", "checkpoint-000002"]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3]


def test_a_removal_renames_first_and_measures_sizes(tmp_path: Path, tiny: Any) -> None:
    path = _save(tmp_path, 1, tiny)
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    assert folder_bytes(path) == size > 0
    link = tmp_path / "checkpoint-000002"
    link.symlink_to(path, target_is_directory=True)
    assert folder_bytes(link) == 0 and remove_folder(link) is False and link.is_symlink()
    link.unlink()
    assert remove_folder(path) is True and not path.exists()
    assert remove_folder(path) is False
    # What a crash mid-removal leaves is a hidden trash folder, which the next start sweeps.
    (tmp_path / ".trash-checkpoint-000001-0badf00d").mkdir()
    assert list_checkpoints(tmp_path) == []
    assert [p.name for p in sweep_temp_dirs(tmp_path)] == [".trash-checkpoint-000001-0badf00d"]
