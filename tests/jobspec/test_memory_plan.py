"""jobspec.memory_plan: the parts of a plan, and plans for the Qwen2.5 shapes on 1 and 8
devices of 80 GB, with the start-up order of issue 34 (bfloat16 training: float32 master
weights, a bfloat16 engine on the GPU; a LoRA job's frozen base as the bfloat16 reference is)."""

from __future__ import annotations

import pytest

from jobspec import JobSpec
from jobspec.memory_plan import PlanInputs, plan_memory, refusal
from jobspec.model_shape import PRESET_SHAPES

GB80 = 80 * 10**9
QWEN = {size: PRESET_SHAPES[f"qwen/qwen2.5-{size}"] for size in ("0.5b", "7b", "14b")}


def gpu(devices: int, *, lora: int | None = None, micro: int = 8) -> PlanInputs:
    return PlanInputs(
        devices=devices,
        training_dtype="bfloat16",
        rollout_dtype="bfloat16",
        lora_rank=lora,
        micro_batch_size=micro,
        accelerator="cuda",
        device_divisor=8,
    )


@pytest.mark.parametrize("size", sorted(QWEN))
@pytest.mark.parametrize("devices", [1, 8])
@pytest.mark.parametrize("lora", [None, 16])
def test_qwen_plans_on_80gb(size: str, devices: int, lora: int | None) -> None:
    shape = QWEN[size]
    plan = plan_memory(shape, gpu(devices, lora=lora), device_memory=GB80)
    p = shape.parameters
    trainable = p if lora is None else shape.lora_parameters(lora)
    assert plan.gradients == -(-4 * trainable // devices)
    assert plan.optimizer == -(-8 * trainable // devices)
    assert plan.engine_weights == 2 * p  # every rank holds the whole bfloat16 engine
    full_fits: dict[str, bool] = {"0.5b": True, "7b": devices == 8, "14b": devices == 8}
    expected_fit = full_fits[size] if lora is None else True
    assert plan.fits is expected_fit, plan.summary()
    if not plan.fits:
        assert plan.suggestions and all(
            plan_memory(shape, _apply(gpu(devices, lora=lora), s.change), device_memory=GB80).fits
            for s in plan.suggestions
        )


def _apply(inputs: PlanInputs, change: dict[str, object]) -> PlanInputs:
    names = {"lora.rank": "lora_rank", "resources.devices": "devices",
             "grpo.micro_batch_size": "micro_batch_size"}  # fmt: skip
    return inputs.replace(**{names[k]: v for k, v in change.items()})


def test_the_acceptance_cases() -> None:
    assert plan_memory(QWEN["7b"], gpu(8), device_memory=GB80).fits
    assert plan_memory(QWEN["14b"], gpu(1, lora=16), device_memory=GB80).fits
    assert not plan_memory(QWEN["7b"], gpu(1), device_memory=GB80).fits


def test_spec_inputs_reference_and_refusal() -> None:
    spec = JobSpec.model_validate(
        {
            "model": "smollm2-135m-instruct",
            "dataset": {"generator": {"type": "arithmetic", "count": 16}},
            "graders": [{"type": "numeric_match"}],
            "grpo": {
                "prompts_per_step": 2,
                "group_size": 2,
                "micro_batch_size": 4,
                "max_new_tokens": 8,
                "kl": {"beta": 0.1},
            },
        }
    )
    shape = PRESET_SHAPES["smollm2-135m-instruct"]
    inputs = PlanInputs.from_spec(spec)
    assert inputs.kl_active and inputs.rollout_dtype == "float32" and inputs.engine == "vllm"
    plan = plan_memory(shape, inputs, device_memory=1 << 30)
    assert plan.reference == 4 * shape.parameters  # a float32 copy for a full fine-tune
    assert plan.engine_weights == 4 * shape.parameters
    assert not plan.fits
    # With the transformers engine (no copy, no cache up front) LoRA fits a 1 GiB device.
    hf = inputs.replace(engine="transformers", engine_holds_weights=False)
    plan = plan_memory(shape, hf, device_memory=1 << 30)
    message, details = refusal(plan)
    assert "1.00 GiB" in message and "optimizer" in message
    assert {d["param"] for d in details} >= {"lora.rank"}
    lora = plan_memory(shape, hf.replace(lora_rank=8), device_memory=1 << 30)
    assert lora.fits
    assert lora.reference == 0 and lora.trainable_parameters == shape.lora_parameters(8)


def test_accumulating_micro_batches_on_several_devices_hold_whole_gradients() -> None:
    """Gradients are reduce-scattered once per minibatch (issue 34): while a device
    accumulates several micro-batches it holds the whole float32 gradients, not its shard,
    and the plan counts them so; one micro-batch per device per update keeps the shard."""
    shape = QWEN["7b"]
    one_pass = plan_memory(shape, gpu(8, micro=8).replace(update_rows=64), device_memory=GB80)
    accumulating = plan_memory(shape, gpu(8, micro=4).replace(update_rows=64), device_memory=GB80)
    assert one_pass.gradients == -(-4 * shape.parameters // 8)
    assert accumulating.gradients == 4 * shape.parameters
    assert accumulating.total > one_pass.total
    assert accumulating.fits  # 7B full still fits 8 x 80 GB (the engine sleeps in the update)
    single = plan_memory(shape, gpu(1, micro=4).replace(update_rows=64), device_memory=GB80)
    assert single.gradients == 4 * shape.parameters
