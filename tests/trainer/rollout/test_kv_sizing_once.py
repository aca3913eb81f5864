"""The engine's KV cache and the memory plan's KV term are one formula
(``jobspec.memory_terms.kv_cache_bytes``, blocks from ``kv_block_tokens``): for three model
shapes, on CPU and CUDA, on one device and on eight, the cache the trainer configures its vLLM
engine with (``trainer.rollout.startup.run_kv_cache_bytes``) is the plan's ``kv_cache``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from transformers import LlamaConfig, Qwen2Config

from jobspec import JobSpec
from jobspec.memory_plan import PlanInputs, plan_memory
from jobspec.memory_terms import kv_block_tokens
from jobspec.model_shape import PRESET_SHAPES, ModelShape
from tests.trainer.test_loop import tiny_spec
from trainer.rollout.startup import run_kv_cache_bytes

GIB = 1 << 30


def hf_config(shape: ModelShape) -> Any:
    """A Hugging Face config of `shape`, as a loaded policy carries it."""
    make = Qwen2Config if shape.model_type == "qwen2" else LlamaConfig
    return make(
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        vocab_size=shape.vocab_size,
        head_dim=shape.head_size,
    )


SHAPES = {
    "smollm2-135m": ModelShape.from_config(
        {
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "vocab_size": 49152,
            "model_type": "llama",
        }
    ),
    "qwen2.5-0.5b": PRESET_SHAPES["qwen/qwen2.5-0.5b"],
    "qwen2.5-7b": PRESET_SHAPES["qwen/qwen2.5-7b"],
}


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("accelerator", ["cpu", "cuda"])
@pytest.mark.parametrize("devices", [1, 8])
def test_the_engines_cache_is_the_plans_kv_term(name: str, accelerator: str, devices: int) -> None:
    shape = SHAPES[name]
    spec = tiny_spec(  # the spec's model name plays no part: the shape is `name`'s
        rollout={"engine": "vllm"},
        resources={"devices": devices},
        grpo={
            "prompts_per_step": 16,
            "group_size": 8,
            "max_prompt_tokens": 300,
            "max_new_tokens": 700,
            "micro_batch_size": 8,
            "dtype": "bfloat16",
        },
    )
    assert isinstance(spec, JobSpec)
    # Prompts as long as the spec allows (what the plan counts for every prompt).
    train = [[1] * spec.grpo.max_prompt_tokens] * 4
    engine = run_kv_cache_bytes(
        spec,
        SimpleNamespace(config=hf_config(shape)),  # type: ignore[arg-type]
        train,
        [],
        kv_block_tokens(accelerator),
        device_type=accelerator,
    )
    inputs = PlanInputs.from_spec(spec, accelerator)  # type: ignore[arg-type]
    plan = plan_memory(shape, inputs, device_memory=80 * GIB, max_devices=8)
    assert engine == plan.kv_cache
    assert engine > 0
