"""The job spec (jobspec) declares every selectable name once; the name-keyed registries
that implement them, the API's error paths and the CLI's choices must agree with it."""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, get_args

import pytest
import torch
from pydantic import ValidationError

from app.core.field_paths import field_path
from jobspec import (
    GRADER_SPECS,
    GRADER_TYPES,
    AdvantageScale,
    DatasetSpec,
    GraderSpecBase,
    JobSpec,
    KLEstimatorName,
    LossAggregation,
    PromptRow,
    RolloutEngineName,
    SamplerCorrectionMode,
)
from jobspec.kl import KL_ESTIMATOR_TRAITS
from jobspec.traits import ROLLOUT_ENGINE_TRAITS
from trainer.rollout.registry import ROLLOUT_ENGINES, make_engine
from trainer.run.cli import build_parser
from trainer.update.advantages import ADVANTAGE_SCALES, group_advantages
from trainer.update.kl import KL_ESTIMATORS, REWARD_ESTIMATOR, per_token_kl
from trainer.update.losses import LOSS_AGGREGATIONS, aggregate
from trainer.update.sampler_correction import SAMPLER_CORRECTIONS


def _spec_grader_tags() -> set[str]:
    """The grader types the API accepts, read from the published JSON schema (not from the
    helpers in jobspec, so that a union built differently from GRADER_SPECS shows up)."""
    items = JobSpec.model_json_schema()["properties"]["graders"]["items"]
    return set(items["discriminator"]["mapping"])


@pytest.mark.parametrize(
    ("spec_names", "registry"),
    [
        (get_args(KLEstimatorName), KL_ESTIMATORS),
        (get_args(AdvantageScale), ADVANTAGE_SCALES),
        (get_args(LossAggregation), LOSS_AGGREGATIONS),
        (get_args(RolloutEngineName), ROLLOUT_ENGINES),
        (get_args(SamplerCorrectionMode), SAMPLER_CORRECTIONS),
    ],
    ids=[
        "kl_estimators",
        "advantage_scales",
        "loss_aggregations",
        "rollout_engines",
        "sampler_corrections",
    ],
)
def test_registry_keys_equal_the_spec_names(
    spec_names: tuple[str, ...], registry: dict[str, Any]
) -> None:
    assert spec_names, "the spec Literal is empty"
    assert len(set(spec_names)) == len(spec_names)
    assert set(registry) == set(spec_names)


@pytest.mark.parametrize(
    ("spec_names", "traits", "registry"),
    [
        (get_args(KLEstimatorName), KL_ESTIMATOR_TRAITS, KL_ESTIMATORS),
        (get_args(RolloutEngineName), ROLLOUT_ENGINE_TRAITS, ROLLOUT_ENGINES),
    ],
    ids=["kl_estimators", "rollout_engines"],
)
def test_trait_tables_cover_the_spec_names_and_their_registry(
    spec_names: tuple[str, ...], traits: dict[str, Any], registry: dict[str, Any]
) -> None:
    """The torch-free trait tables the spec reads name exactly what the registries implement."""
    assert set(traits) == set(spec_names) == set(registry)


def test_the_reward_penalty_is_an_estimator_exact_in_the_reward() -> None:
    assert KL_ESTIMATOR_TRAITS[REWARD_ESTIMATOR].reward_exact


def test_grader_registry_keys_equal_the_spec_tags() -> None:
    tags = _spec_grader_tags()
    assert tags == set(GRADER_TYPES)
    # Each type builds its own runtime (grading.graders.<type>), none the base's refusal.
    assert all(cls.build is not GraderSpecBase.build for cls in GRADER_SPECS)


def test_unknown_names_are_errors_listing_the_valid_ones() -> None:
    x = torch.zeros(2, 3)
    bad_calls: list[tuple[Callable[[], object], Collection[str]]] = [
        (lambda: per_token_kl("k9", x, x), KL_ESTIMATORS),  # type: ignore[arg-type]
        (lambda: group_advantages(x, "zscore"), ADVANTAGE_SCALES),  # type: ignore[arg-type]
        (
            lambda: aggregate(x, x, "sum", max_completion_len=3),  # type: ignore[arg-type]
            LOSS_AGGREGATIONS,
        ),
        (
            lambda: make_engine(
                "sglang",  # type: ignore[arg-type]
                Path("m"),
                None,  # type: ignore[arg-type]
                dtype="float32",
                max_model_len=8,
            ),
            ROLLOUT_ENGINES,
        ),
    ]
    for call, registry in bad_calls:
        with pytest.raises(ValueError) as info:
            call()
        for name in registry:
            assert name in str(info.value), (name, str(info.value))


def _job(graders: list[dict[str, Any]]) -> dict[str, Any]:
    return {"dataset": {"rows": [{"prompt": "2+2?", "answer": "4"}]}, "graders": graders}


@pytest.mark.parametrize("tag", sorted(_spec_grader_tags()))
def test_api_error_path_of_a_bad_grader_field_drops_the_union_tag(tag: str) -> None:
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate(_job([{"type": tag, "no_such_field": 1}]))
    (loc,) = [e["loc"] for e in info.value.errors() if e["loc"][-1] == "no_such_field"]
    assert tag in loc  # pydantic names the union member in the location ...
    # ... and the API reports the path the user wrote (the request body's locations).
    assert field_path(("body", *loc)) == "graders[0].no_such_field"


def test_api_error_path_of_an_unknown_grader_type() -> None:
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate(_job([{"type": "telepathy"}]))
    (error,) = info.value.errors()
    assert field_path(("body", *error["loc"])) == "graders[0]"


def test_cli_engine_choices_are_the_spec_names() -> None:
    (action,) = [a for a in build_parser()._actions if "--engine" in a.option_strings]
    assert action.choices is not None
    assert list(action.choices) == list(get_args(RolloutEngineName))


# --------------------------------------------------------------------------- dataset helpers


def test_known_row_count() -> None:
    rows = DatasetSpec(rows=[PromptRow(prompt="a"), PromptRow(prompt="b")])
    generated = DatasetSpec.model_validate({"generator": {"type": "arithmetic", "count": 7}})
    assert rows.known_row_count() == 2
    assert generated.known_row_count() == 7 == len(generated.all_rows())
    assert DatasetSpec(file_id="file_x").known_row_count() is None


def test_arithmetic_rows_are_seeded_sums() -> None:
    spec = DatasetSpec.model_validate({"generator": {"type": "arithmetic", "count": 20, "seed": 1}})
    assert spec.generator is not None
    rows = spec.generator.rows()
    assert rows == spec.generator.rows() == spec.all_rows()
    for row in rows:
        a, b = row.prompt.removeprefix("What is ").split("?")[0].split("+")
        assert row.answer == str(int(a) + int(b))


def test_with_rows_replaces_the_source_and_revalidates() -> None:
    spec = DatasetSpec.model_validate(
        {"generator": {"type": "arithmetic"}, "holdout": 1, "system_prompt": "be brief"}
    )
    resolved = spec.with_rows([PromptRow(prompt="p1", answer="1"), PromptRow(prompt="p2")])
    assert resolved.generator is None and resolved.file_id is None
    assert resolved.holdout == 1 and resolved.system_prompt == "be brief"
    assert resolved.all_rows() == [PromptRow(prompt="p1", answer="1"), PromptRow(prompt="p2")]
    with pytest.raises(ValidationError, match="leaves no rows"):
        spec.with_rows([PromptRow(prompt="only")])
    with pytest.raises(ValueError, match="resolved into rows"):
        DatasetSpec(file_id="file_x").all_rows()


# --------------------------------------------------------------------------- the spec modules


def test_trainer_config_re_exports_every_spec_section() -> None:
    import jobspec
    from jobspec import base, dataset, grpo, grpo_options, rows

    for module in (base, dataset, grpo, grpo_options, rows):
        for name in module.__all__:
            assert getattr(jobspec, name) is getattr(module, name), name
            assert name in jobspec.__all__, name


def test_the_spec_and_the_graders_load_no_torch() -> None:
    """The API validates specs (RE2 included) and isolated graders' subprocesses import
    grading.graders: neither may pull in torch, numpy or the model stack."""
    import subprocess
    import sys

    code = (
        "import sys, jobspec, grading.graders, grading.graders.pool; "
        "print(','.join(sorted(m for m in ('torch', 'numpy', 'transformers', 'vllm') "
        "if m in sys.modules)))"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == ""
