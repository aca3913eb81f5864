"""The job spec bounds everything a tenant can ask for: every number has a minimum and a maximum,
floats are finite, text is storable in Postgres (no NUL, no lone surrogate), and the products
that size a job (completions, tokens) can be checked against a service's limits."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError

from app.core.error_handlers import install
from app.core.field_paths import field_path
from jobspec import JobSpec, spec_limits_violations

BASE: dict[str, Any] = {
    "name": "job",
    "dataset": {"rows": [{"prompt": "2+2?", "answer": "4"}, {"prompt": "3+3?", "answer": "6"}]},
    "graders": [
        {"type": "numeric_match", "tolerance": 0.5},
        {"type": "regex", "pattern": r"\d"},
        {"type": "length"},
    ],
    "grpo": {"kl": {"beta": 0.1}},
    "rollout": {"kv_cache_gib": 1.0},
    "metadata": {"team": "rl"},
}


def job(**paths: Any) -> dict[str, Any]:
    """BASE with values set at dotted paths ("grpo.kl.beta", "graders.1.pattern")."""
    body = copy.deepcopy(BASE)
    for path, value in paths.items():
        *parents, last = path.split(".")
        node: Any = body
        for part in parents:
            node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
        if last.isdigit():
            node[int(last)] = value
        else:
            node[last] = value
    return body


def error_paths(body: Any) -> dict[str, str]:
    """{API param path: message} of the errors validating ``body`` (which must fail)."""
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate(body)
    return {field_path(("body", *e["loc"])): e["msg"] for e in info.value.errors()}


def test_the_base_job_is_valid() -> None:
    JobSpec.model_validate(BASE)


# --------------------------------------------------------------------------- numeric bounds


def numeric_nodes(schema: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, node) for every integer or number in the schema, its $defs included."""

    def walk(node: Any, where: str) -> Iterator[tuple[str, dict[str, Any]]]:
        if isinstance(node, dict):
            if node.get("type") in ("integer", "number"):
                yield where, node
            for key, value in node.items():
                yield from walk(value, f"{where}/{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                yield from walk(value, f"{where}/{i}")

    yield from walk(schema, "#")


def test_every_number_in_the_spec_has_a_minimum_and_a_maximum() -> None:
    schema = JobSpec.model_json_schema()
    nodes = list(numeric_nodes(schema))
    assert len(nodes) >= 35, "the walk no longer finds the spec's numbers"
    unbounded = [
        where
        for where, node in nodes
        if not ({"minimum", "exclusiveMinimum"} & set(node))
        or not ({"maximum", "exclusiveMaximum"} & set(node))
    ]
    assert not unbounded, f"numeric fields without both bounds: {unbounded}"


@pytest.mark.parametrize(
    "path",
    [
        "seed",
        "checkpoint_interval",
        "eval.interval",
        "grpo.warmup_steps",
        "grpo.max_grad_norm",
        "grpo.micro_batch_size",
        "grpo.mini_batch_size",
        "grpo.overlong.cache_tokens",
        "dataset.holdout",
        "graders.0.tolerance",
        "graders.2.max_chars",
        "graders.2.slack_chars",
    ],
)
def test_huge_numbers_are_rejected_naming_the_field(path: str) -> None:
    errors = error_paths(job(**{path: 10**29}))
    expected = path.replace(".0.", "[0].").replace(".2.", "[2].")
    assert expected in errors, errors


def test_generator_seed_is_bounded() -> None:
    body = job(dataset={"generator": {"type": "arithmetic", "seed": 10**29}})
    assert "dataset.generator.seed" in error_paths(body)


# --------------------------------------------------------------------------- finite floats


@pytest.mark.parametrize("literal", ["Infinity", "-Infinity", "NaN"])
@pytest.mark.parametrize(
    "path",
    [
        "grpo.learning_rate",
        "grpo.kl.beta",
        "graders.0.weight",
        "graders.0.tolerance",
        "rollout.kv_cache_gib",
        "grpo.steps",
    ],
)
def test_non_finite_numbers_are_rejected_from_json(path: str, literal: str) -> None:
    raw = json.dumps(job(**{path: "__X__"})).replace('"__X__"', literal)
    expected = path.replace(".0.", "[0].")
    # Python's json (what the API's request parsing uses) reads these literals as floats ...
    assert expected in error_paths(json.loads(raw))
    # ... and pydantic's own JSON parser too.
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate_json(raw)
    assert expected in {field_path(("body", *e["loc"])) for e in info.value.errors()}


def test_the_api_answers_non_finite_numbers_with_a_422_naming_the_field() -> None:
    app = FastAPI()
    install(app)

    @app.post("/spec")
    def accept(spec: JobSpec) -> dict[str, str]:
        return {"ok": "yes"}

    raw = json.dumps(job(**{"grpo.kl.beta": "__X__"})).replace('"__X__"', "Infinity")
    with TestClient(app) as client:
        response = client.post("/spec", content=raw, headers={"content-type": "application/json"})
        ok = client.post(
            "/spec", content=json.dumps(BASE), headers={"content-type": "application/json"}
        )
    assert response.status_code == 422, response.text
    assert response.json()["error"]["param"] == "grpo.kl.beta"
    assert ok.status_code == 200, ok.text


# --------------------------------------------------------------------------- storable text


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("name", "name"),
        ("model", "model"),
        ("dataset.rows.0.prompt", "dataset.rows[0].prompt"),
        ("dataset.rows.1.answer", "dataset.rows[1].answer"),
        ("dataset.system_prompt", "dataset.system_prompt"),
        ("graders.1.pattern", "graders[1].pattern"),
        ("graders.1.name", "graders[1].name"),
        ("metadata.team", "metadata"),
    ],
)
@pytest.mark.parametrize("bad", ["a\x00b", "a\ud800b"], ids=["nul", "lone_surrogate"])
def test_unstorable_text_is_rejected_naming_the_field(path: str, expected: str, bad: str) -> None:
    value = "/models/" + bad if path == "model" else bad
    errors = error_paths(job(**{path: value}))
    assert expected in errors, errors
    # pydantic itself refuses lone surrogates ("unable to parse raw data as a unicode string");
    # NUL is valid Python text, refused by the spec's own check (names fail their pattern first).
    if bad == "a\x00b" and path != "graders.1.name":
        assert "NUL" in errors[expected]


def test_unstorable_text_in_a_metadata_key_the_generator_and_file_id() -> None:
    assert "metadata" in error_paths(job(metadata={"te\x00am": "rl"}))
    generated = job(dataset={"generator": {"type": "arithmetic", "template": "{a}+{b}\x00"}})
    assert "dataset.generator.template" in error_paths(generated)
    assert "dataset.file_id" in error_paths(job(dataset={"file_id": "file_\x00"}))


def test_lone_surrogates_from_json_escapes_are_rejected() -> None:
    raw = json.dumps(BASE).replace('"2+2?"', '"2+2?\\ud83d"')
    assert "dataset.rows[0].prompt" in error_paths(json.loads(raw))


def test_assignment_is_checked_too() -> None:
    spec = JobSpec.model_validate(BASE)
    with pytest.raises(ValidationError):
        spec.name = "x\x00"
    with pytest.raises(ValidationError):
        spec.grpo.learning_rate = float("nan")


# --------------------------------------------------------------------------- service limits


def test_products_of_the_spec() -> None:
    spec = JobSpec.model_validate(
        job(
            grpo={
                "steps": 10,
                "prompts_per_step": 4,
                "group_size": 8,
                "max_prompt_tokens": 100,
                "max_new_tokens": 28,
                "num_iterations": 2,
                "dynamic_sampling": {"enabled": True, "max_rounds": 3},
            }
        )
    )
    grpo = spec.grpo
    assert grpo.completions_per_step == 32
    # 4 prompts, then 2 more rounds of at most 2 x 4 prompts (oversample 2): 20 x 8 completions
    assert grpo.sampled_completions_per_step == 160
    assert grpo.tokens_per_step == 160 * 128
    assert grpo.total_tokens == 160 * 128 * 10 * 2
    assert spec_limits_violations(spec) == []
    assert (
        spec_limits_violations(
            spec,
            max_completions_per_step=160,
            max_tokens_per_step=160 * 128,
            max_total_tokens=160 * 128 * 20,
        )
        == []
    )


def test_limits_violations_name_the_field_to_lower() -> None:
    spec = JobSpec.model_validate(
        job(
            grpo={
                "prompts_per_step": 4,
                "group_size": 8,
                "max_new_tokens": 28,
                "max_prompt_tokens": 100,
            }
        )
    )
    found = dict(
        spec_limits_violations(
            spec, max_completions_per_step=31, max_tokens_per_step=4095, max_total_tokens=10
        )
    )
    assert set(found) == {"grpo.prompts_per_step", "grpo.max_new_tokens", "grpo.steps"}
    assert (
        "= 32 completions per step exceeds this service's limit of 31"
        in found["grpo.prompts_per_step"]
    )
    assert "4096 tokens per step" in found["grpo.max_new_tokens"]

    # When only the extra dynamic-sampling rounds break the limit, max_rounds is the culprit.
    dynamic = spec.model_copy(deep=True)
    dynamic.grpo.dynamic_sampling.enabled = True
    (only,) = spec_limits_violations(dynamic, max_completions_per_step=40)
    assert only[0] == "grpo.dynamic_sampling.max_rounds"
    assert "dynamic_sampling.max_rounds (3) - 1)" in only[1] and "= 160 completions" in only[1]
