"""The API plans a job for the workers' device kind, not its own host's (issue 45):
GRPO_WORKER_DEVICE_KIND=cuda with GRPO_WORKER_DEVICE_MEMORY_GIB=80 on an API host without a GPU
plans CUDA (bfloat16 rollouts in 16-token blocks, an engine asleep in the update), where it
planned every job as a CPU job (float32 rollouts, twice the KV cache, no sleep). Undeclared,
the plan is for the device the job's workers announce with their size class."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import jobspec.model_shape as model_shape
from app.core.db import session_scope
from app.core.settings import Settings, build_settings
from app.jobs.service import memory_plan
from jobspec import JobSpec
from jobspec.memory_plan import PlanInputs, plan_memory
from tests.app.jobs.conftest import Deployment

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


def plan_on(deployment: Deployment, spec: JobSpec, **declared: object) -> Any:
    """The plan the deployment's API makes of `spec` with these settings declared."""
    with session_scope(deployment.sessions) as session:
        return memory_plan(spec, deployment.settings.model_copy(update=declared), session)


@pytest.fixture
def api_host(deployment: Callable[..., Deployment]) -> Deployment:
    return deployment()


def test_a_declared_cuda_kind_plans_as_cuda_on_a_host_without_a_gpu(api_host: Deployment) -> None:
    spec = JobSpec.model_validate(SEVEN_B)
    plan, reason = plan_on(api_host, spec, worker_device_memory_gib=80, worker_device_kind="cuda")
    assert plan is not None and reason is None
    cuda = PlanInputs.from_spec(spec, "cuda")
    assert cuda.rollout_dtype == "bfloat16"
    shape = model_shape.PRESET_SHAPES["qwen/qwen2.5-7b"]
    assert plan == plan_memory(shape, cuda, device_memory=80 * GIB, max_devices=8)
    # Each rank's bfloat16 cache holds its 64 sequences; the engine sleeps through the update.
    assert plan.kv_cache / GIB == pytest.approx(6.56, abs=0.01)
    assert plan.fits and plan.total / GIB == pytest.approx(60.1, abs=0.1)


def test_an_undeclared_kind_before_any_worker_is_the_hosts_and_the_bug_it_was(
    api_host: Deployment,
) -> None:
    """Memory declared, kind not, no worker seen: the CPU host's kind, as before: a float32
    engine with 128-token blocks beside the update, which does not fit."""
    spec = JobSpec.model_validate(SEVEN_B)
    plan, _ = plan_on(api_host, spec, worker_device_memory_gib=80)
    assert plan is not None
    assert plan.kv_cache / GIB == pytest.approx(13.12, abs=0.01)  # float32
    assert not plan.fits and plan.total / GIB == pytest.approx(99.7, abs=0.1)
    assert api_host.settings.worker_device_memory() == (HOST_RAM, "cpu")


def test_undeclared_the_plan_is_for_the_device_the_jobs_workers_announce(
    api_host: Deployment,
) -> None:
    """Nothing declared: once workers of 8 x 80 GB announce themselves, the 7B job is planned
    for them (what the declared test plans), not for this 64 GiB CPU host; a job of a size
    nobody runs is planned for the deployment's devices; a smaller CUDA worker of the class
    is what the plan must fit; a declared kind still wins."""
    spec = JobSpec.model_validate(SEVEN_B)
    on_host, _ = plan_on(api_host, spec)
    assert on_host.kv_cache / GIB == pytest.approx(13.12, abs=0.01)  # the bug: a CPU plan

    api_host.worker_seen(8, device=(80 * GIB, "cuda"))
    api_host.worker_seen(1, device=(HOST_RAM, "cpu"))  # another class: not this job's
    declared, _ = plan_on(api_host, spec, worker_device_memory_gib=80, worker_device_kind="cuda")
    announced, _ = plan_on(api_host, spec)
    assert announced == declared and announced.fits
    assert announced.kv_cache / GIB == pytest.approx(6.56, abs=0.01)
    # 4 devices: no worker of that size; the deployment's CUDA workers are what it is planned for.
    four = JobSpec.model_validate({**SEVEN_B, "resources": {"devices": 4}})
    assert plan_on(api_host, four)[0].device_memory == 80 * GIB

    api_host.worker_seen(8, device=(40 * GIB, "cuda"))
    smaller, _ = plan_on(api_host, spec)
    assert smaller.device_memory == 40 * GIB and not smaller.fits
    as_cpu, _ = plan_on(api_host, spec, worker_device_kind="cpu")
    assert as_cpu.kv_cache / GIB == pytest.approx(13.12, abs=0.01)
    assert as_cpu.device_memory == HOST_RAM  # a GPU's bytes are no CPU worker's memory


def test_the_kind_is_read_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRPO_WORKER_DEVICE_KIND", "cuda")
    monkeypatch.setenv("GRPO_WORKER_DEVICE_MEMORY_GIB", "80")
    assert settings(tmp_path).worker_device_memory() == (80 * GIB, "cuda")
    monkeypatch.setenv("GRPO_WORKER_DEVICE_KIND", "tpu")
    with pytest.raises(ValueError, match="worker_device_kind"):
        settings(tmp_path)
