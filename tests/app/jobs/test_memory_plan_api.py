"""POST /v1/jobs/validate answers the job's memory plan; POST /v1/jobs refuses a job whose plan
does not fit the workers' device (GRPO_WORKER_DEVICE_MEMORY_GIB), naming the numbers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import Api, tiny_spec

pytestmark = pytest.mark.parametrize("backend", ["postgres"], indirect=True)


def smollm2_full(**grpo: object) -> dict[str, Any]:
    spec = tiny_spec(micro_batch_size=4, **grpo)
    return {**spec, "model": "smollm2-135m-instruct"}


def test_full_smollm2_does_not_fit_one_gib_and_lora_r8_does(make_api: Callable[..., Api]) -> None:
    api = make_api(worker_device_memory_gib=1)
    answer = api.client.post("/v1/jobs/validate", json=smollm2_full(), headers=api.headers)
    assert answer.status_code == 200, answer.text
    plan = answer.json()["plan"]
    assert plan["fits"] is False
    assert plan["device_memory"] == 1 << 30
    assert plan["parameters"] == 134_515_008
    parts = plan["per_device"]
    assert parts["weights"] == parts["gradients"] == 4 * 134_515_008
    assert parts["optimizer"] == 8 * 134_515_008
    assert plan["total"] > plan["usable"]
    assert {"lora.rank": 8} in [s["change"] for s in plan["suggestions"]] or {"lora.rank": 16} in [
        s["change"] for s in plan["suggestions"]
    ]
    assert any("does not fit" in w for w in answer.json()["warnings"])

    created = api.client.post("/v1/jobs", json=smollm2_full(), headers=api.headers)
    assert created.status_code == 422, created.text
    error = created.json()["error"]
    assert error["param"] == "model"
    assert "GiB per device" in error["message"] and "1.00 GiB" in error["message"]
    assert "optimizer" in error["message"] and "lora.rank" in error["message"]

    lora = {**smollm2_full(), "lora": {"rank": 8}}
    answer = api.client.post("/v1/jobs/validate", json=lora, headers=api.headers)
    assert answer.status_code == 200, answer.text
    assert answer.json()["plan"]["fits"] is True
    assert answer.json()["plan"]["trainable_parameters"] == 2_442_240
    created = api.client.post("/v1/jobs", json=lora, headers=api.headers)
    assert created.status_code == 201, created.text


def test_unknown_hub_model_has_no_plan(make_api: Callable[..., Api]) -> None:
    api = make_api(worker_device_memory_gib=1)
    spec = {**tiny_spec(), "model": "acme/not-cached-here"}
    answer = api.client.post("/v1/jobs/validate", json=spec, headers=api.headers)
    assert answer.status_code == 200, answer.text
    assert answer.json()["plan"] is None
    assert "config.json" in answer.json()["plan_unavailable"]
    assert api.client.post("/v1/jobs", json=spec, headers=api.headers).status_code == 201


def test_model_folder_config_is_read(make_api: Callable[..., Api], tmp_path: Any) -> None:
    folder = tmp_path / "models" / "m"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(
        '{"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, '
        '"num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, '
        '"vocab_size": 151936, "tie_word_embeddings": true}'
    )
    api = make_api(model_roots=str(tmp_path / "models"), worker_device_memory_gib=64)
    spec = {**tiny_spec(), "model": str(folder)}
    answer = api.client.post("/v1/jobs/validate", json=spec, headers=api.headers)
    assert answer.status_code == 200, answer.text
    assert answer.json()["plan"]["parameters"] == 494_032_768


def test_validate_shows_the_micro_batch_auto_chooses_for_the_workers_device(
    make_api: Callable[..., Api],
) -> None:
    """grpo.micro_batch_size auto: the plan reports the largest power of two (at most the 64
    completions of an update) that fits the workers' device, smaller on a smaller one; the
    resolved spec keeps auto (the worker chooses again for its own device)."""
    spec = {
        **smollm2_full(prompts_per_step=8, group_size=8, max_new_tokens=256),
        "lora": {"rank": 16},
    }
    spec["grpo"]["micro_batch_size"] = "auto"  # type: ignore[index]
    chosen = {}
    for gib in (64, 3):
        api = make_api(worker_device_memory_gib=gib)
        answer = api.client.post("/v1/jobs/validate", json=spec, headers=api.headers)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["spec"]["grpo"]["micro_batch_size"] == "auto"
        plan = body["plan"]
        assert plan["micro_batch_auto"] is True and plan["fits"] is True
        chosen[gib] = plan["micro_batch_size"]
    assert chosen[64] == 64 and chosen[3] < chosen[64], chosen
    assert chosen[3] & (chosen[3] - 1) == 0  # a power of two

    fixed = {**spec, "grpo": {**spec["grpo"], "micro_batch_size": 8}}  # type: ignore[dict-item]
    answer = api.client.post("/v1/jobs/validate", json=fixed, headers=api.headers)
    assert answer.json()["plan"]["micro_batch_size"] == 8
    assert answer.json()["plan"]["micro_batch_auto"] is False
