"""bench.gpu_update on CPU: its arguments, its FLOP count, the clear refusal without a GPU, and a
dry run of the whole code path on a tiny model (the figures themselves come from a GPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from bench import gpu_update
from bench.gpu_update import Shape, qwen25_05b_config, update_flops


def test_the_model_has_qwen25_05b_shapes_and_the_flops_count_follows_them() -> None:
    config = qwen25_05b_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == 494_032_768  # Qwen2.5-0.5B's count
    shape = Shape(rows=64, prompt_tokens=128, completion_tokens=384, micro_batch_size=16)
    full = update_flops(config, shape, lora_params=None)
    # About 6 FLOPs per weight and token: 358M decoder weights at 32,768 tokens, plus the head
    # at the completion positions and attention.
    decoder = 24 * (896 * 896 * 2 + 2 * 896 * 128 + 3 * 896 * 4864)
    assert full > 6 * decoder * 64 * 512
    assert full < 1.3 * 6 * (decoder * 64 * 512 + 151_936 * 896 * 64 * 384)
    lora = update_flops(config, shape, lora_params=8_798_208)
    assert 0.6 < lora / full < 0.7  # no weight gradients for the frozen base


def test_without_a_gpu_it_says_how_to_check_the_code_path(
    capsys: pytest.CaptureFixture[str],
) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert gpu_update.main([]) == 2
    assert "--dry-run" in capsys.readouterr().err


def test_an_unknown_configuration_is_refused_before_any_model_is_built() -> None:
    with pytest.raises(ValueError, match="full or loraN"):
        gpu_update.main(["--dry-run", "--configs", "full,qlora"])


def test_a_dry_run_goes_through_the_whole_update_on_a_tiny_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert gpu_update.main(["--dry-run", "--configs", "full,lora16"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "tokens/s" in line]
    assert [line.split(":")[0].strip() for line in lines] == ["full", "lora16"]
    assert all("step" in line and "MFU" in line for line in lines)
