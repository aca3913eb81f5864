"""LoRA: the reference is the base with adapters off, the engine gets float32-merged weights
without the base changing, checkpoints hold the adapters alone and resume exactly, and a
merged export is a plain Hugging Face model with the adapter model's log-probabilities."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from jobspec import LoraSpec
from tests.trainer.conftest import tiny_llama
from tests.trainer.test_loop import Recorder, tiny_spec
from trainer.errors import LoraTargetNotSupported
from trainer.models.loading import load_policy, resolve_model
from trainer.models.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    apply_lora,
    engine_state_dict,
    is_lora,
    merged_model,
    trainable_parameters,
)
from trainer.models.reference import reference_for
from trainer.run.loop import train
from trainer.update.logprobs import completion_logprobs


def _tiny_lora(rank: int = 4, seed: int = 0) -> tuple[Any, Any]:
    """(the tiny base as loaded, a LoRA model on another copy with non-zero adapters)."""
    base, _ = load_policy(resolve_model("tiny-random-llama"))
    other, _ = load_policy(resolve_model("tiny-random-llama"))
    lora = apply_lora(other, LoraSpec(rank=rank), base_name="tiny-random-llama")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:  # B starts at 0, which would make every check trivial
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return base, lora


def _logprobs(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(7, 50, (3, 14), generator=torch.Generator().manual_seed(1))
    return completion_logprobs(model.eval(), ids, torch.ones_like(ids), 5)[0].detach()


def test_only_the_adapters_train() -> None:
    base, lora = _tiny_lora()
    trained = trainable_parameters(lora)
    assert trained and all(p.requires_grad for p in trained)
    names = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert sum(p.numel() for p in trained) < 0.25 * sum(p.numel() for p in base.parameters())


def test_the_reference_is_the_base_with_adapters_off() -> None:
    base, lora = _tiny_lora()
    reference = reference_for(lora, "float32")
    assert reference.model is lora  # no second copy of the weights
    with reference.scope():
        off = _logprobs(reference.model)
    on = _logprobs(lora)
    assert torch.equal(off, _logprobs(base))
    assert (on - off).abs().max() > 1e-3  # the adapters do change the model outside the scope


def test_engine_weights_are_merged_in_float32_and_leave_the_base_untouched() -> None:
    _, lora = _tiny_lora()
    before = {k: v.clone() for k, v in lora.get_base_model().state_dict().items()}
    weights = engine_state_dict(lora)
    # Hugging Face names of the plain model, lm_head included (vLLM needs it when tied).
    plain_names = set(load_policy(resolve_model("tiny-random-llama"))[0].state_dict())
    assert set(weights) == plain_names
    layer = lora.get_base_model().model.layers[0].self_attn.q_proj
    expected = (
        layer.base_layer.weight.float()
        + (layer.lora_B["default"].weight @ layer.lora_A["default"].weight)
        * layer.scaling["default"]
    )
    assert torch.allclose(weights["model.layers.0.self_attn.q_proj.weight"], expected, atol=1e-7)
    for _ in range(3):
        engine_state_dict(lora)
    after = lora.get_base_model().state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # bit for bit


def test_a_merged_export_loads_in_transformers_with_the_adapter_models_logprobs(
    tmp_path: Path,
) -> None:
    _, lora = _tiny_lora()
    merged: Any = merged_model(lora)
    merged.save_pretrained(tmp_path / "merged")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True)
    assert not any(".lora_" in k for k in loaded.state_dict())
    assert torch.allclose(_logprobs(loaded), _logprobs(lora), atol=1e-4)


def test_an_embedding_target_is_refused_by_the_spec_with_its_name() -> None:
    with pytest.raises(ValidationError, match="'embed_tokens' is an embedding"):
        LoraSpec(target_modules=["q_proj", "embed_tokens"])


@pytest.mark.parametrize(
    ("target", "tied", "named"),
    [
        ("embed_tokens", True, "'model.embed_tokens', an embedding"),
        ("embed_tokens", False, "'model.embed_tokens', an embedding"),
        ("lm_head", True, "'lm_head', the output head, whose weight is tied"),
    ],
)
def test_a_target_the_engine_and_export_would_drop_is_refused_naming_the_module(
    target: str, tied: bool, named: str
) -> None:
    """The loaded model is checked too: names the spec cannot know to be embeddings (here
    the spec's own check is bypassed) and a tied output head. Before, both trained and were
    left out of the engine sync and of ``grpo export --merge`` (logits off by up to 238)."""
    model = tiny_llama(60, tie_word_embeddings=tied)
    # model_construct: past the spec's name check, as a name it does not list would be.
    spec = LoraSpec.model_construct(rank=4, alpha=8, dropout=0.0, target_modules=[target])
    with pytest.raises(LoraTargetNotSupported, match=re.escape(named)) as refused:
        apply_lora(model, spec)
    assert refused.value.reason == "lora_target_not_supported"
    assert not is_lora(model) and not any(".lora_" in k for k in model.state_dict())


def test_an_untied_output_head_is_adapted_and_carried_to_the_engine_and_the_export(
    tmp_path: Path,
) -> None:
    """An untied head is a plain linear layer: its merged weight reaches the engine weights,
    and the merged export computes what the adapter model computes."""
    lora: Any = apply_lora(
        tiny_llama(60, tie_word_embeddings=False),
        LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "lm_head"]),
    )
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.2, generator=torch.Generator().manual_seed(len(name)))
    weights = engine_state_dict(lora)
    base_head = lora.get_base_model().lm_head.get_base_layer().weight
    assert not torch.equal(weights["lm_head.weight"], base_head)
    merged: Any = merged_model(lora)
    assert torch.allclose(_logprobs(merged), _logprobs(lora), atol=1e-5)


def test_a_lora_job_learns_and_checkpoints_only_its_adapters(tmp_path: Path) -> None:
    lora_spec = tiny_spec(
        lora={"rank": 2, "alpha": 16},
        grpo={"learning_rate": 1e-2, "kl": {"estimator": "k3_unbiased", "beta": 0.05}},
    )
    rec = Recorder()
    result = train(lora_spec, rec, output_dir=tmp_path / "lora")
    rewards = rec.rewards()
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.2, rewards
    assert rec.metrics[1]["kl_k3"] < 1e-6 < rec.metrics[6]["kl_k3"]  # adapters-off reference

    folder = result.checkpoint_path
    assert folder is not None
    names = {p.name for p in folder.iterdir()}
    assert {ADAPTER_WEIGHTS, ADAPTER_CONFIG} <= names and "model.safetensors" not in names

    full = train(tiny_spec(steps=1), Recorder(), output_dir=tmp_path / "full").checkpoint_path
    assert full is not None

    def size(path: Path) -> int:
        return sum(p.stat().st_size for p in path.iterdir())

    assert size(folder) < 0.05 * size(full), (size(folder), size(full))


def test_a_lora_job_resumes_exactly(tmp_path: Path) -> None:
    # Dropout on the adapters draws random numbers during the update: the resume restores them.
    spec = tiny_spec(
        steps=4,
        lora={"rank": 4, "dropout": 0.1},
        grpo={
            "prompts_per_step": 4,
            "group_size": 4,
            "max_new_tokens": 12,
            "num_iterations": 2,
            "mini_batch_size": 8,
            "learning_rate": 5e-3,
            "kl": {"estimator": "k3_unbiased", "beta": 0.1},
        },
    )
    straight = Recorder()
    train(spec, straight, output_dir=tmp_path / "straight")
    first = Recorder(stop_after=2)
    half = train(spec, first, output_dir=tmp_path / "resumed")
    assert half.stopped_early and half.checkpoint_path is not None
    second = Recorder()
    train(spec, second, output_dir=tmp_path / "resumed", resume_from=half.checkpoint_path)
    resumed = {**first.metrics, **second.metrics}
    for step in range(1, 5):
        for key, value in straight.metrics[step].items():
            if not key.startswith(("time/", "tokens_per_s")):
                assert resumed[step][key] == pytest.approx(value, abs=1e-5), (step, key)


@pytest.mark.model
def test_the_vllm_engine_samples_with_the_merged_adapters(tmp_path: Path) -> None:
    """After each update the engine's log-probs of its samples match the trainer's LoRA
    model (float32 engine): the merged weights reached it."""
    spec = tiny_spec(
        steps=3,
        lora={"rank": 4},
        grpo={"learning_rate": 1e-2},
        rollout={"engine": "vllm", "dtype": "float32"},
    )
    rec = Recorder()
    train(spec, rec, output_dir=tmp_path)
    diffs = [rec.metrics[s]["logprob_diff/engine_vs_trainer"] for s in (1, 2, 3)]
    assert all(d < 1e-3 for d in diffs), diffs
    assert rec.metrics[2]["time/weight_sync"] > 0


@pytest.mark.model
def test_the_vllm_engine_samples_with_the_hot_swapped_adapter(tmp_path: Path) -> None:
    """rollout.lora_sync adapter: the base stays in the engine and only the adapter is pushed
    (vLLM's LoRA path on CPU); the engine's log-probs still match the trainer's LoRA model."""
    spec = tiny_spec(
        steps=3,
        lora={"rank": 4},
        grpo={"learning_rate": 1e-2},
        rollout={"engine": "vllm", "dtype": "float32", "lora_sync": "adapter"},
    )
    rec = Recorder()
    train(spec, rec, output_dir=tmp_path)
    diffs = [rec.metrics[s]["logprob_diff/engine_vs_trainer"] for s in (1, 2, 3)]
    assert all(d < 1e-3 for d in diffs), diffs
    assert rec.metrics[2]["time/weight_sync"] > 0
    assert not any(p.name.startswith("vllm-adapters-") for p in tmp_path.iterdir())


def test_adapter_sync_is_refused_without_lora_or_off_vllm() -> None:
    with pytest.raises(ValidationError, match="needs a LoRA job"):
        tiny_spec(rollout={"engine": "vllm", "lora_sync": "adapter"})
    with pytest.raises(ValidationError, match="vllm engine mode"):
        tiny_spec(lora={"rank": 4}, rollout={"engine": "transformers", "lora_sync": "adapter"})


def test_grpo_export_merges_a_lora_checkpoint(tmp_path: Path) -> None:
    """`grpo export CKPT --merge` writes a plain folder whose log-probs are the adapter
    model's; without --merge it writes the adapters alone."""
    from grpo_cli.main import main as grpo
    from trainer.checkpoint.store import load_checkpoint

    spec = tiny_spec(steps=2, lora={"rank": 4}, grpo={"learning_rate": 5e-2})
    checkpoint = train(spec, Recorder(), output_dir=tmp_path / "run").checkpoint_path
    assert checkpoint is not None
    assert grpo(["export", str(checkpoint), "--out", str(tmp_path / "merged"), "--merge"]) == 0
    assert grpo(["export", str(checkpoint), "--out", str(tmp_path / "adapter")]) == 0
    assert grpo(["export", str(checkpoint), "--out", str(tmp_path / "merged")]) == 1  # exists

    names = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {ADAPTER_WEIGHTS, ADAPTER_CONFIG} <= names and "optimizer.pt" not in names
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True)
    base, _ = load_policy(resolve_model("tiny-random-llama"))
    lora = apply_lora(base, LoraSpec(rank=4))
    load_checkpoint(checkpoint, lora, None, None, restore_rng=False)
    assert torch.allclose(_logprobs(merged), _logprobs(lora), atol=1e-4)
    untrained, _ = load_policy(resolve_model("tiny-random-llama"))
    assert (_logprobs(merged) - _logprobs(untrained)).abs().max() > 1e-3  # training moved it
