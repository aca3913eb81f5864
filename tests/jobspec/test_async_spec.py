"""``grpo.async``: hostile values are 422s naming the field, and the alias round-trips."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from jobspec import JobSpec


def _spec(grpo_async: dict[str, Any], devices: int = 1) -> dict[str, Any]:
    return {
        "model": "tiny-random-llama",
        "dataset": {"rows": [{"prompt": "say a"}, {"prompt": "say b"}]},
        "graders": [{"type": "regex", "name": "seven", "pattern": "7"}],
        "grpo": {"prompts_per_step": 2, "group_size": 2, "async": grpo_async},
        "resources": {"devices": devices},
    }


@pytest.mark.parametrize(
    ("grpo_async", "field"),
    [
        ({"max_staleness": 9}, "max_staleness"),
        ({"max_staleness": -1}, "max_staleness"),
        ({"max_mismatch": 1.0}, "max_mismatch"),
        ({"max_mismatch": float("inf")}, "max_mismatch"),
        ({"server_threads": 0}, "server_threads"),
        ({"server_threads": 10_000}, "server_threads"),
        ({"max_staleness": 1, "in_flight": True}, "in_flight"),
    ],
)
def test_hostile_async_values_name_their_field(grpo_async: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as caught:
        JobSpec.model_validate(_spec(grpo_async))
    locations = [".".join(str(p) for p in e["loc"]) for e in caught.value.errors()]
    assert any(loc.startswith("grpo.async.") and loc.endswith(field) for loc in locations)


def test_an_async_job_of_several_devices_is_accepted_with_an_even_split() -> None:
    spec = JobSpec.model_validate(_spec({"max_staleness": 1}, devices=2))
    assert spec.resources.devices == 2 and spec.grpo.async_.max_staleness == 1
    with pytest.raises(ValidationError) as caught:  # 2 prompts per step do not split over 4
        JobSpec.model_validate(_spec({"max_staleness": 1}, devices=4))
    assert "resources" in [str(p) for e in caught.value.errors() for p in e["loc"]]


def test_the_section_is_async_in_specs_and_round_trips() -> None:
    spec = JobSpec.model_validate(_spec({"max_staleness": 2}))
    dumped = spec.model_dump(mode="json")
    assert dumped["grpo"]["async"]["max_staleness"] == 2 and "async_" not in dumped["grpo"]
    assert JobSpec.model_validate(dumped).grpo.async_.max_staleness == 2
