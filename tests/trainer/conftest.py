"""Shared helpers of the trainer tests, and which of them are model runs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

HERE = Path(__file__).resolve().parent

# Model runs (marker `model`, left out of `make test-fast`): tests that start vLLM or run the
# training loop. Modules, or single tests given as "module::test". The math tests on a tiny
# random Llama (a forward/backward pass or two) stay in the fast tier.
MODEL_RUNS = (
    "rollout/test_vllm_engine.py",
    "rollout/test_stop_tokens.py::test_vllm_engine_stops_a_qwen_style_model_at_end_of_turn",
    "test_loop.py",
    "agents/test_agent_training.py",  # agent jobs through train() and grpo train
    "test_library.py",
    "test_cli.py::test_tiny_recipe_runs_and_resumes",
    "test_models.py::test_concurrent_builds_agree",
    # LoRA and bf16 runs of the training loop (the pure LoRA/precision checks stay fast)
    "test_lora.py::test_a_lora_job_learns_and_checkpoints_only_its_adapters",
    "test_lora.py::test_a_lora_job_resumes_exactly",
    "test_lora.py::test_grpo_export_merges_a_lora_checkpoint",
    "test_precision.py::test_a_bfloat16_job_learns_with_float32_master_weights",
    "test_launch.py",
    "test_cli.py::test_two_ranks_train_from_the_command_line",
    "test_cli.py::test_ctrl_c_stops_two_ranks_at_a_step_with_a_checkpoint",
    "test_memory_plan_peak.py",  # a training step of SmolLM2 against the memory plan
)
# Tests that start processes of their own (spawned grader workers, a memory probe subprocess):
# marker `process`, also left out of `make test-fast`.
PROCESS_RUNS = (
    "test_memory.py",
    "test_memory_plan_peak.py",  # each measurement in a fresh process
    "distributed/test_equivalence.py",  # torchrun, two ranks
    "distributed/test_ranks.py",
    "distributed/test_streaming.py",  # torchrun, two ranks streaming their weights
    "distributed/test_solo_phases.py",  # two ranks, one frozen
    "agents/test_sandbox_tools.py",  # python tools and environments in bubblewrap
    "agents/test_agent_training.py",  # the same, in agent jobs
    # torchrun's agent and its ranks (trainer.run.launch)
    "test_launch.py",
    "test_cli.py::test_two_ranks_train_from_the_command_line",
    "test_cli.py::test_ctrl_c_stops_two_ranks_at_a_step_with_a_checkpoint",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(item.path)
        if not path.is_relative_to(HERE):
            continue  # this hook sees the whole session's items
        module = path.relative_to(HERE).as_posix()
        test = f"{module}::{getattr(item, 'originalname', item.name)}"
        if module in MODEL_RUNS or test in MODEL_RUNS:
            item.add_marker(pytest.mark.model)
        if module in PROCESS_RUNS or test in PROCESS_RUNS:
            item.add_marker(pytest.mark.process)


def tiny_llama(vocab_size: int, **config_overrides: object) -> LlamaForCausalLM:
    """A seeded 2-layer random Llama in float32 and eval mode (no hub, no tokenizer);
    ``config_overrides`` change its LlamaConfig (e.g. attention_dropout)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        # A wider init than the default 0.02 so that the logits are far from uniform and a
        # wrong position, token or row would show up well above the tolerance.
        initializer_range=0.3,
        pad_token_id=0,
        **config_overrides,
    )
    model = LlamaForCausalLM(config).float()
    model.eval()  # no dropout in Llama, but make it explicit
    return model


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread for the test: the tiny model gains nothing from more, and on a
    shared 2-core machine two spinning OpenMP threads per process made the training runs ~50x
    slower (measured). Modules use it with ``pytest.mark.usefixtures("one_torch_thread")``."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
