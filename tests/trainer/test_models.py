from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trainer.models import (
    PACKAGED_MODELS,
    TINY_ALPHABET,
    load_policy,
    model_cache_dir,
    resolve_model,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_packaged_names() -> None:
    assert set(PACKAGED_MODELS) == {"smollm2-135m-instruct", "tiny-random-llama"}


def test_model_cache_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GRPO_MODEL_CACHE", str(tmp_path / "cache"))
    assert model_cache_dir() == tmp_path / "cache"
    monkeypatch.delenv("GRPO_MODEL_CACHE")
    assert model_cache_dir() == Path.home() / ".cache" / "grpo-service" / "models"


def test_tiny_model_is_built_once_and_reused(tmp_path: Path) -> None:
    first = resolve_model("tiny-random-llama", cache_dir=tmp_path)
    assert first.parent == tmp_path
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (first / name).is_file(), name
    weights = first / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    second = resolve_model("tiny-random-llama", cache_dir=tmp_path)
    assert second == first
    assert weights.stat().st_mtime_ns == stamp
    # Only the model folder and its lock file: no temporary build folder left behind.
    leftovers = sorted(p.name for p in tmp_path.iterdir())
    assert leftovers == [".tiny-random-llama-v1.lock", "tiny-random-llama-v1"]


def test_tiny_model_is_identical_across_builds(tmp_path: Path) -> None:
    a = load_file(
        resolve_model("tiny-random-llama", cache_dir=tmp_path / "a") / "model.safetensors"
    )
    b = load_file(
        resolve_model("tiny-random-llama", cache_dir=tmp_path / "b") / "model.safetensors"
    )
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_concurrent_builds_agree(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path; from trainer.models import resolve_model; "
        "print(resolve_model('tiny-random-llama', cache_dir=Path(sys.argv[1])))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err
    paths = {out.strip() for out, _ in outputs}
    assert paths == {str(tmp_path / "tiny-random-llama-v1")}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".tiny-random-llama-v1.lock",
        "tiny-random-llama-v1",
    ]


def test_tiny_model_loads_in_transformers(tmp_path: Path) -> None:
    model, tokenizer = load_policy(resolve_model("tiny-random-llama", cache_dir=tmp_path))
    config = model.config
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (
        128,
        4,
        2,
    )
    assert (config.num_hidden_layers, config.head_dim) == (2, 32)
    assert config.tie_word_embeddings
    assert next(model.parameters()).dtype == torch.float32
    assert tokenizer.padding_side == "left"
    assert tokenizer.pad_token_id is not None
    assert tokenizer.eos_token_id == config.eos_token_id
    assert config.vocab_size == len(tokenizer)
    ids = torch.tensor([tokenizer.encode("12+3=")])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 5, len(tokenizer))
    assert torch.isfinite(logits).all()


def test_load_policy_dtype(tmp_path: Path) -> None:
    model, _ = load_policy(resolve_model("tiny-random-llama", cache_dir=tmp_path), torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16


def test_tiny_tokenizer_round_trips_characters(tmp_path: Path) -> None:
    _, tokenizer = load_policy(resolve_model("tiny-random-llama", cache_dir=tmp_path))
    text = "what is 12+30? the answer: 42.\nabcdefghijklmnopqrstuvwxyz 0123456789 -=,"
    ids = tokenizer.encode(text)
    assert len(ids) == len(text)  # one token per character, nothing added
    assert tokenizer.decode(ids) == text
    assert tokenizer.unk_token_id not in ids
    assert set(tokenizer.convert_ids_to_tokens(tokenizer.encode(TINY_ALPHABET))) == set(
        TINY_ALPHABET
    )
    # Characters outside the alphabet (upper case included) become <unk>.
    assert tokenizer.encode("A~") == [tokenizer.unk_token_id] * 2


def test_tiny_chat_template(tmp_path: Path) -> None:
    _, tokenizer = load_policy(resolve_model("tiny-random-llama", cache_dir=tmp_path))
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is 2+3?"},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<s><|system|>be brief<|end|><|user|>what is 2+3?<|end|><|assistant|>"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")
    assert ids.count(tokenizer.eos_token_id) == 2  # each finished turn ends with eos
    assert tokenizer.decode(ids, skip_special_tokens=True) == "be briefwhat is 2+3?"


def test_resolve_model_accepts_folders_and_rejects_others(tmp_path: Path) -> None:
    built = resolve_model("tiny-random-llama", cache_dir=tmp_path / "cache")
    assert resolve_model(str(built)) == built
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        resolve_model(str(empty))
    with pytest.raises(FileNotFoundError, match="tiny-random-llama"):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="neither a packaged model"):
        resolve_model("gpt-17")


@pytest.mark.slow
def test_smollm2_conversion_answers_arithmetic() -> None:
    # Uses the shared cache: the first run converts (about 40 s), later runs reuse the folder.
    path = resolve_model("smollm2-135m-instruct")
    assert path.parent == model_cache_dir()
    model, tokenizer = load_policy(path)
    assert model.config.tie_word_embeddings
    assert len(tokenizer) == 49152
    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3? Answer with a number."}],
        add_generation_prompt=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        out = model.generate(
            **prompt, max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "5" in answer, answer
