"""The resolved spec as tracker params (worker.trackers.params): flat, bounded, and never the
dataset's rows or the integrations themselves."""

from __future__ import annotations

from jobspec import JobSpec
from tests.conftest import tiny_spec
from worker.trackers.params import MAX_PARAMS, MAX_VALUE_CHARS, flatten_spec


def resolved(**changes: object) -> dict[str, object]:
    return JobSpec.model_validate(tiny_spec() | changes).model_dump(mode="json")


def test_the_spec_flattens_to_dotted_keys_with_list_indexes() -> None:
    spec = resolved(metadata={"team/a b": "rl", "odd:key!": "x"})
    params = flatten_spec(spec)
    assert params["grpo.steps"] == "2"
    assert params["grpo.kl.beta"] == str(spec["grpo"]["kl"]["beta"])  # type: ignore[index]
    assert params["graders.0.type"] == "numeric_match"
    assert params["name"] == "null"
    assert params["lora"] == "null"
    assert params["metadata.team/a b"] == "rl"
    assert params["metadata.odd_key_"] == "x"  # only the characters MLflow accepts in keys


def test_rows_are_counted_integrations_left_out_and_long_values_cut() -> None:
    rows = [{"prompt": f"{i}+1?", "answer": str(i + 1)} for i in range(5000)]
    long = "x" * (MAX_VALUE_CHARS + 100)
    spec = resolved(
        dataset={"rows": rows, "system_prompt": long},
        integrations=[{"type": "mlflow", "experiment": "e"}],
    )
    params = flatten_spec(spec)
    assert params["dataset.rows"] == "5000 rows"
    assert not any(k.startswith("dataset.rows.") for k in params)
    assert not any(k.startswith("integrations") for k in params)
    assert len(params["dataset.system_prompt"]) == MAX_VALUE_CHARS
    assert params["dataset.system_prompt"].endswith("...")
    assert len(params) <= MAX_PARAMS
