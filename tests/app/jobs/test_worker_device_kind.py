"""The API plans a job for the workers' device kind, not its own host's (issue 45):
GRPO_WORKER_DEVICE_KIND=cuda with GRPO_WORKER_DEVICE_MEMORY_GIB=80 on an API host without a GPU
plans CUDA (bfloat16 rollouts in 16-token blocks, an engine asleep in the update), where it
planned every job as a CPU job (float32 rollouts, twice the KV cache, no sleep)."""

from __future__ import annotations

from pathlib import Path

import pytest

import jobspec.model_shape as model_shape
from app.core.settings import Settings, build_settings
from app.jobs.service import memory_plan
from jobspec import JobSpec
from jobspec.memory_plan import PlanInputs, plan_memory

GIB = 1 << 30
HOST_RAM = 64 * GIB

# 7B full fine-tune, bfloat16, 64 prompts x 8 completions of 512 + 1024 tokens, KL on, 8 devices.
SEVEN_B = {
    "model": "qwen/qwen2.5-7b",
    "dataset": {"generator": {"type": "arithmetic", "count": 16}},
    "graders": [{"type": "numeric_match"}],
    "grpo": {
        "dtype": "bfloat16",
        "prompts_per_step": 64,
        "group_size": 8,
        "max_prompt_tokens": 512,
        "max_new_tokens": 1024,
        "micro_batch_size": 8,
        "kl": {"beta": 0.04},
    },
    "resources": {"devices": 8},
}


@pytest.fixture(autouse=True)
def host_without_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """This API host has no CUDA device (nvidia-smi finds none): 64 GiB of host memory."""
    monkeypatch.setattr(model_shape, "detected_device_memory", lambda: (HOST_RAM, "cpu"))


def settings(tmp_path: Path, **declared: object) -> Settings:
    return build_settings(data_dir=tmp_path, **declared)


def test_a_declared_cuda_kind_plans_as_cuda_on_a_host_without_a_gpu(tmp_path: Path) -> None:
    spec = JobSpec.model_validate(SEVEN_B)
    plan, reason = memory_plan(
        spec, settings(tmp_path, worker_device_memory_gib=80, worker_device_kind="cuda")
    )
    assert plan is not None and reason is None
    cuda = PlanInputs.from_spec(spec, "cuda")
    assert cuda.rollout_dtype == "bfloat16"
    shape = model_shape.PRESET_SHAPES["qwen/qwen2.5-7b"]
    assert plan == plan_memory(shape, cuda, device_memory=80 * GIB, max_devices=8)
    # Each rank's bfloat16 cache holds its 64 sequences; the engine sleeps through the update.
    assert plan.kv_cache / GIB == pytest.approx(6.56, abs=0.01)
    assert plan.fits and plan.total / GIB == pytest.approx(60.1, abs=0.1)


def test_an_undeclared_kind_is_the_hosts_and_the_bug_it_was(tmp_path: Path) -> None:
    """Memory declared, kind not: the CPU host's kind, as before: a float32 engine with
    128-token blocks beside the update, which does not fit (what GRPO_WORKER_DEVICE_KIND is
    for)."""
    spec = JobSpec.model_validate(SEVEN_B)
    plan, _ = memory_plan(spec, settings(tmp_path, worker_device_memory_gib=80))
    assert plan is not None
    assert plan.kv_cache / GIB == pytest.approx(13.12, abs=0.01)  # float32
    assert not plan.fits and plan.total / GIB == pytest.approx(99.7, abs=0.1)
    assert settings(tmp_path).worker_device_memory() == (HOST_RAM, "cpu")


def test_the_kind_is_read_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRPO_WORKER_DEVICE_KIND", "cuda")
    monkeypatch.setenv("GRPO_WORKER_DEVICE_MEMORY_GIB", "80")
    assert settings(tmp_path).worker_device_memory() == (80 * GIB, "cuda")
    monkeypatch.setenv("GRPO_WORKER_DEVICE_KIND", "tpu")
    with pytest.raises(ValueError, match="worker_device_kind"):
        settings(tmp_path)
