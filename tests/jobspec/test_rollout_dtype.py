"""``rollout.dtype``'s default is chosen by the device at start (issue 34, item 8; issue 45):
bfloat16 on a GPU whatever the training dtype (a float32 vLLM engine takes the slow attention
path with twice the KV bytes), float32 elsewhere; a dtype the job sets is kept everywhere. The
memory plan resolves it by the same rule for the workers' device kind."""

from __future__ import annotations

import pytest

from jobspec import CPU_ROLLOUT_DTYPE, JobSpec, RolloutSpec, rollout_dtype

BODY = {
    "dataset": {"rows": [{"prompt": "2+2?", "answer": "4"}, {"prompt": "3+3?", "answer": "6"}]},
    "graders": [{"type": "numeric_match"}],
}


def test_the_default_is_left_to_the_device() -> None:
    assert RolloutSpec().dtype is None
    spec = JobSpec.model_validate({**BODY, "rollout": {"engine": "vllm"}})
    assert spec.rollout.dtype is None
    assert "rollout_dtype" in (RolloutSpec.model_fields["dtype"].description or "")


@pytest.mark.parametrize(
    ("asked", "training", "device", "expected"),
    [
        (None, "bfloat16", "cuda", "bfloat16"),  # a GPU: bfloat16
        (None, "float32", "cuda", "bfloat16"),
        (None, "bfloat16", "cpu", "float32"),  # elsewhere: float32
        (None, "float32", "cpu", "float32"),
        (None, "bfloat16", "mps", "float32"),
        ("float32", "bfloat16", "cuda", "float32"),  # asked: kept
        ("bfloat16", "float32", "cpu", "bfloat16"),
    ],
)
def test_rollout_dtype(asked: str | None, training: str, device: str, expected: str) -> None:
    assert rollout_dtype(asked, training, device) == expected  # type: ignore[arg-type]


def test_the_cpu_default_is_float32() -> None:
    assert CPU_ROLLOUT_DTYPE == "float32"
    with pytest.raises(ValueError, match="training dtype"):
        rollout_dtype(None, "float16", "cuda")


def test_the_plan_rolls_a_float32_job_out_as_its_device_would() -> None:
    """A float32 job (the default) planned for CUDA workers counts a bfloat16 engine (and
    KV cache); planned for CPU workers, a float32 one."""
    from jobspec.memory_plan import PlanInputs, plan_memory
    from jobspec.model_shape import PRESET_SHAPES

    spec = JobSpec.model_validate({**BODY, "model": "qwen/qwen2.5-0.5b"})
    assert spec.grpo.dtype == "float32"
    shape = PRESET_SHAPES["qwen/qwen2.5-0.5b"]
    for kind, engine, itemsize in (("cuda", "bfloat16", 2), ("cpu", "float32", 4)):
        inputs = PlanInputs.from_spec(spec, kind)  # type: ignore[arg-type]
        assert inputs.rollout_dtype == engine, kind
        plan = plan_memory(shape, inputs, device_memory=80 << 30, suggest=False)
        assert plan.engine_weights == itemsize * shape.parameters


def test_an_explicit_dtype_survives_a_round_trip() -> None:
    """A spec stored as JSON (the API keeps the job's) keeps the dtype it asked for, and one
    that asked for none still asks for none: the worker's device decides."""
    asked = JobSpec.model_validate({**BODY, "rollout": {"dtype": "bfloat16"}})
    left = JobSpec.model_validate(BODY)
    assert JobSpec.model_validate_json(asked.model_dump_json()).rollout.dtype == "bfloat16"
    assert JobSpec.model_validate_json(left.model_dump_json()).rollout.dtype is None
