"""jobspec.model_shape counts what transformers builds: the packaged models' real weights, the
Qwen2.5 shapes on the meta device (and their published counts), and peft's LoRA adapters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config

from jobspec import LoraSpec
from jobspec.model_shape import PRESET_SHAPES, ModelShape, lookup_shape, read_model_shape
from trainer.models.loading import resolve_model
from trainer.models.lora import apply_lora

PUBLISHED = {
    "qwen/qwen2.5-0.5b": 494_032_768,
    "qwen/qwen2.5-7b": 7_615_616_512,
    "qwen/qwen2.5-14b": 14_770_033_664,
}


@pytest.mark.parametrize("name", ["tiny-random-llama", "smollm2-135m-instruct"])
def test_packaged_models_shape_and_count(name: str) -> None:
    folder = resolve_model(name)
    shape = read_model_shape(folder)
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    assert shape.parameters == sum(p.numel() for p in model.parameters())
    # The API plans packaged models from presets (it never builds them): they must agree.
    assert PRESET_SHAPES[name] == shape
    for rank, targets in ((8, "all-linear"), (4, ["q_proj", "v_proj"])):
        wrapped = apply_lora(
            AutoModelForCausalLM.from_pretrained(str(folder)),
            LoraSpec(rank=rank, target_modules=targets),
        )
        trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
        assert shape.lora_parameters(rank, targets) == trainable


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_qwen25_counts_on_the_meta_device(name: str) -> None:
    shape = PRESET_SHAPES[name]
    assert shape.parameters == PUBLISHED[name]
    config = Qwen2Config(
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        vocab_size=shape.vocab_size,
        tie_word_embeddings=shape.tie_word_embeddings,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[name]
    assert ModelShape.from_config(config.to_dict()) == shape


def test_lookup_reads_folders_presets_and_the_hub_cache(tmp_path: Path) -> None:
    config = AutoConfig.for_model(
        "qwen3",
        hidden_size=64,
        intermediate_size=128,
        vocab_size=99,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ).to_dict()
    snapshot = tmp_path / "hub" / "models--acme--q3" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    (tmp_path / "hub" / "models--acme--q3" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--q3" / "refs" / "main").write_text("abc")
    shape, reason = lookup_shape("acme/q3", hub_cache=tmp_path / "hub")
    assert reason is None and shape is not None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    assert shape.parameters == sum(p.numel() for p in model.parameters())
    assert lookup_shape("Qwen/Qwen2.5-7B-Instruct")[0] == PRESET_SHAPES["qwen/qwen2.5-7b"]
    missing, why = lookup_shape("acme/other", hub_cache=tmp_path / "hub")
    assert missing is None and why is not None and "config.json" in why
