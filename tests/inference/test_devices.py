"""Engines never share the training workers' devices unless the operator says so."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from inference.devices import engine_environment, overlap, parse_devices, sharing_refusal
from inference.settings import build_inference_settings


@pytest.mark.parametrize(
    ("a", "b", "shared"),
    [
        ("cpu", "cpu", True),
        ("cuda:1", "cuda:0", False),
        ("cuda:0,1", "cuda:1,2", True),
        ("cuda", "cuda:3", True),
        ("cuda:0", "cpu", False),
        ("cpu", "none", False),
    ],
)
def test_overlap(a: str, b: str, shared: bool) -> None:
    assert overlap(parse_devices(a), parse_devices(b)) is shared


def test_sharing_is_refused_unless_allowed() -> None:
    cpu = parse_devices("cpu")
    refusal = sharing_refusal(cpu, cpu, share=False)
    assert refusal is not None and "GRPO_INFERENCE_SHARE_DEVICES" in refusal
    assert sharing_refusal(cpu, cpu, share=True) is None
    assert sharing_refusal(parse_devices("cuda:1"), parse_devices("cuda:0"), share=False) is None


def test_the_workers_devices_default_to_what_grpo_device_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GRPO_DEVICE", "cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert str(build_inference_settings().training_devices) == "cuda:0,1"
    monkeypatch.delenv("GRPO_DEVICE")
    assert str(build_inference_settings().training_devices) == "cpu"


def test_engines_see_only_their_devices() -> None:
    assert engine_environment(parse_devices("cuda:2,3")) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert engine_environment(parse_devices("cpu")) == {}


def test_bad_device_sets_and_ranks_are_refused_by_the_settings() -> None:
    with pytest.raises(ValidationError):
        build_inference_settings(devices="gpu0")
    with pytest.raises(ValidationError):
        build_inference_settings(max_lora_rank=12)  # vLLM serves 8, 16, 32, ...
