"""The memory plan at the sizes users train (issue 45): an async job's rollout server never
sleeps (state + engine + update), each rank's KV cache holds its share of the step, a
float32 job is told that bfloat16 training fits, and the plan counts the host memory each
rank holds at start-up. Numbers for Qwen2.5 shapes on 80 GiB devices, bfloat16 training."""

from __future__ import annotations

from typing import Any

import pytest

from jobspec import JobSpec
from jobspec.memory_plan import PlanInputs, plan_memory, refusal
from jobspec.memory_terms import sequences_per_call
from jobspec.model_shape import PRESET_SHAPES, ModelShape

GIB = 1 << 30
GIB80 = 80 * GIB
QWEN7B = PRESET_SHAPES["qwen/qwen2.5-7b"]
# Qwen2.5-1.5B's public config.json (the size the async job could not start at).
QWEN15B = ModelShape(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    vocab_size=151_936,
    tie_word_embeddings=True,
    max_position_embeddings=32_768,
    qkv_bias=True,
    model_type="qwen2",
)


def spec(model: str, *, devices: int = 1, asynchronous: bool = False, **grpo: Any) -> JobSpec:
    """A bfloat16 job of 64 prompts x 8 completions of 512 + 1024 tokens (the issue's case)."""
    return JobSpec.model_validate(
        {
            "model": model,
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
                "async": {"max_staleness": 1 if asynchronous else 0},
                **grpo,
            },
            "resources": {"devices": devices},
        }
    )


# --------------------------------------------------------------------------- async


def test_an_async_jobs_peak_adds_its_never_sleeping_engine_to_the_update() -> None:
    """A 1.5B full fine-tune, one 80 GiB device: the synchronous job's engine sleeps in the
    update (state + max(engine, update)); the async job's server generates during it."""
    sync = PlanInputs.from_spec(spec("qwen/qwen2.5-1.5b"), "cuda")
    asynchronous = PlanInputs.from_spec(spec("qwen/qwen2.5-1.5b", asynchronous=True), "cuda")
    assert asynchronous.async_rollouts and not sync.async_rollouts
    one, other = (plan_memory(QWEN15B, i, device_memory=GIB80) for i in (sync, asynchronous))
    state = other.weights + other.optimizer + other.reference
    update = other.gradients + other.activations
    assert other.total == state + other.engine + update
    assert one.total == state + max(one.engine, update)
    # 1.54e9 parameters: 23.0 GiB of float32 weights, gradients and AdamW moments (16 bytes
    # each), a 3.3 GiB reference (bfloat16 Linears), a 2.9 GiB bfloat16 engine and a
    # 26.25 GiB KV cache (512 sequences of 1,536 tokens), 6.6 GiB of activations.
    assert other.parameters == 1_543_714_304
    assert other.engine_weights == 2 * other.parameters
    assert other.kv_cache / GIB == pytest.approx(26.25, abs=0.01)
    assert other.total / GIB == pytest.approx(62.0, abs=0.1)
    assert one.total / GIB == pytest.approx(49.7, abs=0.1)
    assert other.fits  # 72 GiB usable


def test_an_async_transformers_server_holds_its_own_copy() -> None:
    """The server loads the model folder in a process of its own: never the policy itself,
    and its cache lives through the update."""
    inputs = PlanInputs.from_spec(spec("qwen/qwen2.5-1.5b", asynchronous=True), "cpu")
    hf = inputs.replace(engine="transformers", engine_holds_weights=False, rollout_dtype="float32")
    plan = plan_memory(QWEN15B, hf, device_memory=1 << 40)
    assert plan.engine_weights == 4 * QWEN15B.parameters
    state = plan.weights + plan.optimizer + plan.reference
    assert plan.total == state + plan.engine + plan.gradients + plan.activations


# --------------------------------------------------------------------------- KV per rank


def test_a_ranks_kv_cache_holds_its_share_of_the_step() -> None:
    """7B full on 8 x 80 GiB at 64 x 8 completions of 1.5k tokens: each rank samples 8 of the
    64 prompts, so its bfloat16 cache holds 64 sequences (6.56 GiB), not the step's 512
    (52.5 GiB, which refused the job); the plan then fits (the issue measured about 58 GiB)."""
    plan = plan_memory(
        QWEN7B,
        PlanInputs.from_spec(spec("qwen/qwen2.5-7b", devices=8), "cuda"),
        device_memory=GIB80,
    )
    per_token = QWEN7B.kv_bytes_per_token(2)  # 57,344 bytes
    assert plan.kv_cache == pytest.approx(64 * 1536 * per_token * 1.25, abs=1)
    assert plan.kv_cache / GIB == pytest.approx(6.56, abs=0.01)
    assert plan.fits, plan.summary()
    assert plan.total / GIB == pytest.approx(60.1, abs=0.1)
    one = plan_memory(
        QWEN7B, PlanInputs.from_spec(spec("qwen/qwen2.5-7b"), "cuda"), device_memory=GIB80
    )
    assert one.kv_cache / GIB == pytest.approx(52.5, abs=0.01)  # one device samples it all


@pytest.mark.parametrize(
    ("completions", "group", "evals", "devices", "async_server", "expected"),
    [
        (512, 8, 0, 8, False, 64),  # 8 prompts x 8 per rank
        (512, 8, 0, 1, False, 512),
        (48, 8, 0, 4, False, 16),  # 6 prompts over 4 ranks: the first two take 2
        (64, 8, 100, 8, False, 13),  # evaluation: 13 of 100 rows per rank
        (64, 8, 100, 8, True, 100),  # an async server evaluates every row in one call
        (512, 8, 0, 8, True, 64),  # and samples the shares one after the other
    ],
)
def test_sequences_per_call(
    completions: int, group: int, evals: int, devices: int, async_server: bool, expected: int
) -> None:
    got = sequences_per_call(
        completions=completions,
        group_size=group,
        eval_prompts=evals,
        devices=devices,
        async_server=async_server,
    )
    assert got == expected


# --------------------------------------------------------------------------- suggestions, host


def test_a_float32_job_that_bfloat16_would_fit_is_told_so() -> None:
    """14B LoRA r16 in float32 on one 80 GiB device, 8 x 8 completions of 256 + 256 tokens:
    its float32 frozen base alone is 55.3 GiB (90.8 GiB in all); bfloat16 training halves the
    base's Linears (66.2 GiB). Where the job cannot take more devices (an agent job), that is
    the one change that fits: the plan said "no single change fits"."""
    job = spec("qwen/qwen2.5-14b", dtype="float32", prompts_per_step=8, max_new_tokens=256,
               max_prompt_tokens=256, micro_batch_size=8)  # fmt: skip
    inputs = PlanInputs.from_spec(job, "cuda").replace(lora_rank=16, rollout_dtype="bfloat16")
    plan = plan_memory(PRESET_SHAPES["qwen/qwen2.5-14b"], inputs, device_memory=GIB80)
    assert not plan.fits and plan.total / GIB == pytest.approx(90.8, abs=0.1)
    changes = [s.change for s in plan.suggestions]
    assert changes == [{"grpo.dtype": "bfloat16"}, {"resources.devices": 2}]
    assert plan.suggestions[0].total / GIB == pytest.approx(66.2, abs=0.1)
    one_device = plan_memory(
        PRESET_SHAPES["qwen/qwen2.5-14b"], inputs.replace(device_divisor=1), device_memory=GIB80
    )
    assert [s.change for s in one_device.suggestions] == [{"grpo.dtype": "bfloat16"}]
    message, details = refusal(one_device)
    assert "grpo.dtype: bfloat16" in message
    assert details == [
        {
            "param": "grpo.dtype",
            "value": "bfloat16",
            "message": "bfloat16 training: 66.19 GiB per device",
        }
    ]


def test_the_plan_counts_each_ranks_host_memory_at_start_up() -> None:
    """Each rank loads the float32 policy in host memory and builds a full fine-tune's
    bfloat16 reference from it: 47.9 GB per rank at 7B, 383 GB for the 8 ranks of a machine."""
    plan = plan_memory(
        QWEN7B,
        PlanInputs.from_spec(spec("qwen/qwen2.5-7b", devices=8), "cuda"),
        device_memory=GIB80,
    )
    linear = QWEN7B.linear_parameters
    reference = 2 * linear + 4 * (QWEN7B.parameters - linear)  # bfloat16 Linears, the rest float32
    assert plan.host_memory_per_rank == 4 * QWEN7B.parameters + reference
    assert plan.host_memory_per_rank / 1e9 == pytest.approx(47.9, abs=0.1)
    shown = plan.as_dict()
    assert shown["host_memory_per_rank"] == plan.host_memory_per_rank
    assert shown["host_memory"] == 8 * plan.host_memory_per_rank
