"""jobspec.memory_plan: the parts of a plan, and plans for the Qwen2.5 shapes on 1 and 8
devices of 80 GB, with the start-up order of issue 34 (bfloat16 training: float32 master
weights, a bfloat16 engine on the GPU; a LoRA job's frozen base as the bfloat16 reference is)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from jobspec import GRPOSpec, JobSpec
from jobspec.grpo import UnresolvedMicroBatch
from jobspec.memory_plan import PlanInputs, plan_memory, refusal, resolve_micro_batch
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


# --------------------------------------------------------------------------- micro-batch auto

GIB = 1 << 30


def auto_spec(model: str, **grpo: object) -> JobSpec:
    """A job of ``model`` with micro_batch_size auto: 64 completions per update."""
    return JobSpec.model_validate(
        {
            "model": model,
            "dataset": {"generator": {"type": "arithmetic", "count": 16}},
            "graders": [{"type": "numeric_match"}],
            "grpo": {"prompts_per_step": 8, "group_size": 8, "max_new_tokens": 256,
                     "micro_batch_size": "auto", **grpo},
            "rollout": {"engine": "transformers"},
        }
    )  # fmt: skip


@pytest.mark.parametrize(
    ("model", "memories_gib"),
    [
        ("tiny-random-llama", [1, 0.3, 0.15, 0.05]),
        ("smollm2-135m-instruct", [64, 6, 4, 3.3]),
        ("qwen/qwen2.5-0.5b", [64, 14, 11, 9]),
    ],
)
def test_auto_chooses_a_smaller_micro_batch_on_a_smaller_device(
    model: str, memories_gib: list[float]
) -> None:
    spec = auto_spec(model)
    shape = PRESET_SHAPES[model]
    inputs = PlanInputs.from_spec(spec)
    assert inputs.micro_batch_auto and inputs.micro_batch_size == 64  # where auto starts
    chosen = []
    for gib in memories_gib:
        memory = int(gib * GIB)
        plan = plan_memory(shape, inputs, device_memory=memory)
        micro = plan.micro_batch_size
        assert plan.micro_batch_auto and plan.as_dict()["micro_batch_size"] == micro
        assert micro & (micro - 1) == 0 and 1 <= micro <= 64  # a power of two, at most 64
        assert resolve_micro_batch(spec, shape, device_memory=memory, accelerator="cpu") == micro
        fixed = inputs.replace(micro_batch_auto=False, micro_batch_size=micro)
        assert plan.total == plan_memory(shape, fixed, device_memory=memory).total
        if micro > 1:
            assert plan.fits  # the largest that fits ...
        if micro < 64:  # ... and twice it does not
            doubled = fixed.replace(micro_batch_size=2 * micro)
            assert not plan_memory(shape, doubled, device_memory=memory).fits
        chosen.append(micro)
    assert chosen[0] == 64 and chosen == sorted(chosen, reverse=True) and chosen[-1] < 16, chosen


def test_auto_starts_from_the_completions_one_device_trains_per_update() -> None:
    shape = PRESET_SHAPES["smollm2-135m-instruct"]
    spec = auto_spec("smollm2-135m-instruct", prompts_per_step=6, group_size=4, mini_batch_size=12)
    assert PlanInputs.from_spec(spec).micro_batch_size == 8  # 12 rows: the power of two below
    two = spec.model_copy(update={"resources": spec.resources.model_copy(update={"devices": 2})})
    assert PlanInputs.from_spec(two).micro_batch_size == 4  # 6 rows per device
    assert (
        plan_memory(shape, PlanInputs.from_spec(spec), device_memory=64 * GIB).micro_batch_size == 8
    )


def test_a_number_is_planned_as_it_is_and_auto_suggests_no_micro_batch() -> None:
    shape = PRESET_SHAPES["smollm2-135m-instruct"]
    fixed = PlanInputs.from_spec(auto_spec("smollm2-135m-instruct", micro_batch_size=32))
    assert not fixed.micro_batch_auto and fixed.micro_batch_size == 32
    assert plan_memory(shape, fixed, device_memory=GIB).micro_batch_size == 32
    inputs = PlanInputs.from_spec(auto_spec("smollm2-135m-instruct"))
    auto = plan_memory(shape, inputs, device_memory=5 * GIB // 2)
    assert not auto.fits and auto.micro_batch_size == 1  # no full fine-tune fits 2.5 GiB
    changes = [s.change for s in auto.suggestions]
    assert {"lora.rank": 16} in changes
    assert not [c for c in changes if "grpo.micro_batch_size" in c]


def test_spec_micro_batch_auto_is_kept_and_must_be_resolved_before_it_is_read() -> None:
    spec = auto_spec("tiny-random-llama")
    assert spec.model_dump()["grpo"]["micro_batch_size"] == "auto"
    assert spec.grpo.micro_batch_setting == "auto"
    with pytest.raises(UnresolvedMicroBatch, match="resolve it with the memory plan"):
        _ = spec.grpo.micro_batch_size
    assert GRPOSpec().micro_batch_size == 16 and GRPOSpec().micro_batch_setting == 16
    assert GRPOSpec(micro_batch_size=4).micro_batch_size == 4
    with pytest.raises(ValidationError, match="micro_batch_size"):
        GRPOSpec.model_validate({"micro_batch_size": "largest"})
    with pytest.raises(ValidationError, match="micro_batch_size"):
        GRPOSpec.model_validate({"micro_batch_size": 0})


def test_compile_is_off_by_default_and_says_what_it_compiles() -> None:
    field = GRPOSpec.model_fields["compile"]
    assert GRPOSpec().compile is False
    assert field.description is not None
    assert "decoder layer" in field.description and "first steps" in field.description
    assert GRPOSpec(compile=True).model_dump()["compile"] is True


# --------------------------------------------------------------------------- the fused head

# Peaks measured on an H200 (torch.cuda.max_memory_allocated; BENCHMARKS.md 10c,
# bench/results/gpu/gpu_update_h200_final.json and gpu_update_compile_mb32_h200.json): the
# bfloat16 update of Qwen2.5-0.5B's shapes, 64 x (128 + 384) tokens, fused head.
H200_MEMORY = 143_150 << 20
H200_PEAKS_GIB = {(None, 16): 12.041, (16, 16): 5.466, (None, 32): 12.127, (16, 32): 6.206}


@pytest.mark.parametrize(("lora", "micro"), sorted(H200_PEAKS_GIB, key=str))
def test_the_plan_follows_the_fused_heads_gpu_peak(lora: int | None, micro: int) -> None:
    inputs = PlanInputs(
        training_dtype="bfloat16",
        lora_rank=lora,
        engine="transformers",
        engine_holds_weights=False,
        micro_batch_size=micro,
        sequence_tokens=512,
        completion_tokens=384,
        accelerator="cuda",
    )
    plan = plan_memory(QWEN["0.5b"], inputs, device_memory=H200_MEMORY, suggest=False)
    update = plan.weights + plan.gradients + plan.optimizer + plan.activations
    ratio = update / GIB / H200_PEAKS_GIB[(lora, micro)]
    assert 1.0 <= ratio <= 1.1, ratio  # it over-counted 1.29x-1.73x with the plain head's chunk
