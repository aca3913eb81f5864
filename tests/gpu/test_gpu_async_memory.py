"""The GPU tier's part of issue 45: what only a CUDA device shows of an async job's memory.

- An async job of Qwen2.5-1.5B's shapes (random weights) on one device: once the trainer is
  placed, the rollout server's share (``rollout.gpu_memory_utilization`` of the run's spec) is
  free on the device, as vLLM's start-up demands, and holds the server's weights and KV cache;
  with vLLM installed the server starts with it (the GPU machines have no vLLM so far).
- The memory plan of an async job against ``torch.cuda.max_memory_allocated`` of its trainer
  (a whole 1-step job, its transformers rollout server a process of its own on the device).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

from jobspec import JobSpec
from jobspec.memory_plan import PlanInputs, plan_memory
from jobspec.model_shape import ModelShape
from trainer.models.loading import resolve_model
from trainer.rollout.startup import kv_block_tokens, run_kv_cache_bytes
from trainer.run.callbacks import Callbacks
from trainer.run.loop import train
from trainer.run.setup import Given, prepare_run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Qwen2.5-1.5B's and Qwen2.5-0.5B's public config.json (the Instruct models share them).
QWEN25: dict[str, dict[str, Any]] = {
    "1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
             "num_attention_heads": 12, "num_key_value_heads": 2},
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14, "num_key_value_heads": 2},
}  # fmt: skip


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _random_qwen_folder(size: str, root: Path) -> Path:
    """A Hugging Face folder of a randomly initialised Qwen2.5 model of ``size``'s shapes (built
    on the device, saved in bfloat16) with the tiny packaged model's tokenizer."""
    config = Qwen2Config(
        **QWEN25[size],
        vocab_size=151_936,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    folder = root / f"qwen2.5-{size}-random"
    with torch.device(_device()):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    AutoTokenizer.from_pretrained(resolve_model("tiny-random-llama")).save_pretrained(folder)
    return folder


def _async_spec(folder: Path, engine: str = "vllm") -> JobSpec:
    return JobSpec.model_validate(
        {
            "model": str(folder),
            "dataset": {"rows": [{"prompt": f"say {w} twice"} for w in "abcdefgh"]},
            "graders": [{"type": "regex", "name": "seven", "pattern": "7"}],
            "grpo": {
                "steps": 1,
                "prompts_per_step": 4,
                "group_size": 4,
                "max_prompt_tokens": 32,
                "max_new_tokens": 32,
                "micro_batch_size": 16,
                "dtype": "bfloat16",
                "kl": {"estimator": "k3", "beta": 0.04, "placement": "loss"},
                "async": {"max_staleness": 1},
            },
            "rollout": {"engine": engine},
            "checkpoint_interval": 0,
        }
    )


@pytest.fixture(scope="module")
def qwen15b_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _random_qwen_folder("1.5b", tmp_path_factory.mktemp("models"))


def test_an_async_15b_jobs_server_share_is_free_once_the_trainer_is_placed(
    qwen15b_folder: Path, tmp_path: Path
) -> None:
    """vLLM refuses to start when less than ``gpu_memory_utilization x total`` is free; the
    share the run derived after placement is free, and holds the server's bfloat16 weights and
    its KV cache."""
    setup = prepare_run(_async_spec(qwen15b_folder), Callbacks(), tmp_path, _device(), Given())
    share = setup.config.rollout.gpu_memory_utilization
    assert share is not None
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(_device())
    assert share * total <= free, (share, free / 2**30, total / 2**30)
    parameters = sum(p.numel() for p in setup.model.parameters())
    block = kv_block_tokens("cuda")
    kv = run_kv_cache_bytes(
        setup.config, setup.engine_model, setup.train_ids, setup.eval_ids, block,
        device_type="cuda",
    )  # fmt: skip
    assert share * total >= 2 * parameters + kv
    if importlib.util.find_spec("vllm") is None:
        return  # the GPU machines have no vLLM: the start itself is checked where it is
    from trainer.rollout.remote_start import start_remote_engine

    server = start_remote_engine(setup)
    try:
        assert server.health()["max_model_len"] == 64
    finally:
        server.close()


def test_the_async_plan_against_the_trainers_peak(tmp_path: Path) -> None:
    """A whole 1-step async job of Qwen2.5-0.5B's shapes, its rollout server (transformers, on
    the device, a process of its own) generating beside the trainer: the plan's trainer part
    (weights, optimizer, reference, gradients, activations) against the trainer's
    ``torch.cuda.max_memory_allocated``, and the plan's total is that part plus the server's
    engine, which never sleeps."""
    folder = _random_qwen_folder("0.5b", tmp_path)
    spec = _async_spec(folder, engine="transformers")  # the GPU machines have no vLLM
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(_device())
    base = torch.cuda.memory_allocated(_device())
    train(spec, Callbacks(), output_dir=tmp_path / "run", device=str(_device()))
    peak = torch.cuda.max_memory_allocated(_device()) - base
    shape = ModelShape.from_config(Qwen2Config(**QWEN25["0.5b"], vocab_size=151_936).to_dict())
    inputs = PlanInputs.from_spec(spec, "cuda").replace(
        engine="transformers", engine_holds_weights=False
    )
    total = torch.cuda.get_device_properties(_device()).total_memory
    plan = plan_memory(shape, inputs, device_memory=total, suggest=False)
    trainer_part = plan.weights + plan.optimizer + plan.reference + plan.gradients
    trainer_part += plan.activations
    assert plan.total == trainer_part + plan.engine
    assert plan.engine_weights == 2 * shape.parameters  # the server's own bfloat16 copy
    assert 0.6 < trainer_part / peak < 1.6, (trainer_part / 2**30, peak / 2**30)
