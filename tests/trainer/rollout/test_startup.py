"""KV-cache sizing of the vLLM engine (pure arithmetic on the model config)."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from jobspec.memory_terms import KV_HEADROOM, kv_block_tokens
from trainer.rollout.startup import kv_cache_bytes

# SmolLM2-135M's attention: 30 layers, 9 query heads of 64 dims, 3 KV heads.
SMOLLM2 = LlamaConfig(
    hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3
)


def test_per_token_bytes_follow_layers_kv_heads_and_dtype() -> None:
    one_block = 16 * KV_HEADROOM
    # key + value, 30 layers, 3 KV heads, 64 dims, 4 bytes: 46,080 bytes per token.
    fp32 = kv_cache_bytes(
        SMOLLM2, sequences=1, tokens_per_sequence=16, dtype="float32", block_tokens=16
    )
    assert fp32 == pytest.approx(46_080 * one_block, abs=1)
    bf16 = kv_cache_bytes(
        SMOLLM2, sequences=1, tokens_per_sequence=16, dtype="bfloat16", block_tokens=16
    )
    assert bf16 == pytest.approx(fp32 / 2, abs=1)


def test_sequences_take_whole_blocks() -> None:
    def size(tokens: int, block: int = 16) -> int:
        return kv_cache_bytes(
            SMOLLM2, sequences=64, tokens_per_sequence=tokens, dtype="float32", block_tokens=block
        )

    assert size(1) == size(16) < size(17) == size(32)
    assert size(1, 128) == size(128, 128) == size(113, 16) == size(128, 16)
    # The benchmark's batch on CPU: 64 sequences of a 42-token prompt + 64 new tokens in blocks
    # of 128 take 0.44 GiB, a fifth of the 2 GiB the engine used to take.
    assert kv_block_tokens("cpu") == 128 and kv_block_tokens("cuda") == 16
    assert size(42 + 64, 128) / (1 << 30) == pytest.approx(0.44, abs=0.01)


def test_head_dim_defaults_to_hidden_over_heads_and_rejects_empty_batches() -> None:
    mha = LlamaConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4)
    assert mha.num_key_value_heads == 4
    per_token = 2 * 2 * 4 * 32 * 4
    got = kv_cache_bytes(mha, sequences=2, tokens_per_sequence=16, dtype="float32", block_tokens=16)
    assert got == pytest.approx(2 * 16 * per_token * KV_HEADROOM, abs=1)
    with pytest.raises(ValueError):
        kv_cache_bytes(mha, sequences=0, tokens_per_sequence=16, dtype="float32", block_tokens=16)


def test_an_agent_jobs_cache_holds_episodes_of_at_most_the_models_context() -> None:
    """A tool job on a model of 1,024 positions asks for episodes of 4,096 tokens (the
    default): the engine's context and its cache stop at the model's, since episodes end
    there (the cache was 4 times what any episode could use)."""
    from torch import nn

    from jobspec import JobSpec
    from tests.trainer.test_loop import tiny_spec
    from trainer.rollout.startup import max_model_len, run_kv_cache_bytes

    tool = {
        "type": "function",
        "function": {"name": "one", "parameters": {"type": "object", "properties": {}}},
        "implementation": {"type": "python", "source": "def one():\n    return 1\n"},
    }
    spec = tiny_spec(tools=[tool])
    assert isinstance(spec, JobSpec) and spec.episode.max_episode_tokens == 4096
    assert max_model_len(spec) == 4096 and max_model_len(spec, 1024) == 1024
    policy = nn.Module()
    policy.config = SMOLLM2  # type: ignore[assignment]
    prompts = [[1] * 10]

    def cache(context: int | None) -> int:
        return run_kv_cache_bytes(spec, policy, prompts, prompts, 16, context)

    assert cache(1024) * 4 == pytest.approx(cache(None), rel=0.01)
