"""The GPU tier (``make test-gpu``, marker ``gpu``): what only a CUDA device can show. Each test
is skipped where there is none, so the tier is collected and skipped cleanly on CPU.

The GPU machines have torch, transformers and peft but no vLLM and no pretrained weights (see
the project's environment notes): the models here are built from configs, and the vLLM
engine's GPU behaviour is checked on CPU against a recording fake
(tests/trainer/rollout/test_vllm_calls.py).
"""

from __future__ import annotations

import pytest
import torch

from bench import gpu_update
from bench.gpu_update import Shape, qwen25_05b_config, run_config
from jobspec import JobSpec
from trainer.models.loading import load_policy, resolve_model
from trainer.rollout.colocation import MIN_ENGINE_SHARE
from trainer.rollout.registry import make_engine
from trainer.rollout.startup import plan_colocation

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def test_the_transformers_engine_generates_on_cuda() -> None:
    model, tokenizer = load_policy(resolve_model("tiny-random-llama"))
    model.to(_device())
    engine = make_engine(
        "transformers",
        resolve_model("tiny-random-llama"),
        tokenizer,
        dtype="float32",
        max_model_len=128,
        policy_model=model,
    )
    prompts = [tokenizer.encode("what is 2+3?"), tokenizer.encode("hi")]
    cuda_state = torch.cuda.get_rng_state(_device())
    first = engine.generate(prompts, 3, max_new_tokens=12, temperature=1.0, seed=5)
    again = engine.generate(prompts, 3, max_new_tokens=12, temperature=1.0, seed=5)
    # The rollout's fork covered the CUDA generator: the trainer's stream did not move.
    assert torch.equal(torch.cuda.get_rng_state(_device()), cuda_state)
    assert [[c.token_ids for c in g] for g in first] == [[c.token_ids for c in g] for g in again]
    for group in first:
        assert len(group) == 3
        for completion in group:
            assert 1 <= len(completion.token_ids) <= 12
            assert completion.logprobs is not None and all(lp <= 0 for lp in completion.logprobs)
    engine.close()


@pytest.mark.parametrize("name", ["full", "lora16"])
def test_a_bf16_update_step_on_a_qwen25_05b_shaped_model(name: str) -> None:
    """One warm-up and one timed bfloat16 update of the trainer's own ``run_updates`` on a
    random model of Qwen2.5-0.5B's shapes: finite, and it fits the device."""
    result = run_config(
        name, qwen25_05b_config(), Shape(8, 64, 64, 4), _device(), steps=1, peak=None
    )
    assert all(torch.isfinite(torch.tensor(result["policy_loss"])))
    assert result["step_s"] > 0 and result["tokens_per_s"] > 0
    total = torch.cuda.get_device_properties(_device()).total_memory
    assert 0 < result["peak_memory_gib"] * 2**30 < total
    # The memory plan (jobspec.memory_plan) against torch.cuda.max_memory_allocated.
    assert 0.5 < result["planned_gib"] / result["peak_memory_gib"] < 2.0, result
    full_params = 494_032_768
    if name == "full":
        assert result["trainable_params"] == full_params
    else:
        assert 0 < result["trainable_params"] < full_params // 20


def test_the_colocation_planner_reads_the_real_device() -> None:
    """With the policy placed on the device, the engine's share comes from what
    torch.cuda.mem_get_info reports free, less the update's reserve and the margin."""
    model, _ = load_policy(resolve_model("tiny-random-llama"))
    model.to(_device())
    spec = JobSpec.model_validate(
        {
            "model": "tiny-random-llama",
            "dataset": {"rows": [{"prompt": "hi"}]},
            "graders": [{"type": "regex", "name": "g", "pattern": "7"}],
            "rollout": {"engine": "vllm"},
        }
    )
    plan = plan_colocation(spec, model, _device())
    free, total = torch.cuda.mem_get_info(_device())
    assert plan.derived and plan.sleep_level == 2
    assert plan.gpu_memory_utilization is not None
    assert MIN_ENGINE_SHARE <= plan.gpu_memory_utilization <= min(0.95, free / total)


def test_the_gpu_update_bench_prints_its_figures(
    capsys: pytest.CaptureFixture[str], tmp_path: object
) -> None:
    code = gpu_update.main(
        [
            "--configs",
            "full,lora16",
            "--steps",
            "1",
            "--rows",
            "8",
            "--prompt-tokens",
            "32",
            "--completion-tokens",
            "32",
            "--micro-batch-size",
            "4",
            "--out",
            str(tmp_path) + "/gpu_update.json",
        ]
    )
    assert code == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "tokens/s" in line]
    assert len(lines) == 2
    assert all("step" in line and "MFU" in line for line in lines)
