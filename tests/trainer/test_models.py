from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trainer.errors import ModelNotAllowed
from trainer.models.loading import (
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
        "import sys; from pathlib import Path; from trainer.models.loading import resolve_model; "
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


def test_every_packaged_name_has_exactly_one_builder() -> None:
    from jobspec import PACKAGED_MODELS
    from trainer.models.loading import PACKAGED_BUILDERS

    assert set(PACKAGED_BUILDERS) == set(PACKAGED_MODELS)
    folders = [p.folder for p in PACKAGED_BUILDERS.values()]
    assert len(set(folders)) == len(folders), "two models would share one cache folder"


# --------------------------------------------------------------------------- confinement


def model_folder(path: Path) -> Path:
    """A folder that looks like a Hugging Face model (the check reads only config.json)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


@pytest.fixture
def layout(tmp_path: Path) -> dict[str, Path]:
    """A model root with one model, a folder beside it with another, and the service's
    checkpoint folder inside the root (an operator's root that is too broad)."""
    root = tmp_path / "models"
    return {
        "root": root,
        "inside": model_folder(root / "team" / "llama"),
        "outside": model_folder(tmp_path / "other-project" / "checkpoint-3"),
        "checkpoints": model_folder(root / "grpo-checkpoints" / "job_x" / "checkpoint-2"),
        "no_config": (root / "bare").resolve(),
    }


def test_a_folder_under_a_root_resolves_to_its_real_path(layout: dict[str, Path]) -> None:
    root = layout["root"]
    assert resolve_model(str(layout["inside"]), allowed_roots=[root]) == layout["inside"]
    # A symlink that stays inside the root is fine; the real path comes back.
    (root / "alias").symlink_to(layout["inside"])
    assert resolve_model(str(root / "alias"), allowed_roots=[root]) == layout["inside"]
    # A root that is itself a symlink may be named either way.
    link_root = root.parent / "models-link"
    link_root.symlink_to(root)
    named = str(link_root / "team" / "llama")
    assert resolve_model(named, allowed_roots=[link_root]) == layout["inside"]


def test_every_escape_is_refused_with_one_message_that_names_no_path(
    layout: dict[str, Path],
) -> None:
    root, outside = layout["root"], layout["outside"]
    layout["no_config"].mkdir()
    (root / "escape").symlink_to(outside)  # a symlink inside the root leading out
    attempts = {
        "outside the roots": str(outside),
        "missing": str(root / "team" / "missing"),
        "dot-dot": f"{root}/team/../../other-project/checkpoint-3",
        "dot-dot that stays inside": f"{root}/team/../team/llama",
        "symlink escape": str(root / "escape"),
        "relative": "models/team/llama",
        "no config.json": str(layout["no_config"]),
        "the service's checkpoints": str(layout["checkpoints"]),
        "NUL": f"{layout['inside']}\x00",
    }
    forbidden = [root / "grpo-checkpoints"]
    messages = set()
    for why, model in attempts.items():
        with pytest.raises(ModelNotAllowed) as refused:
            resolve_model(model, allowed_roots=[root], forbidden=forbidden)
        assert refused.value.reason == "model_not_allowed", why
        messages.add(str(refused.value))
    # The same words whatever the reason, so a refusal never tells whether a path exists.
    assert len(messages) == 1
    (message,) = messages
    assert str(layout["root"].parent) not in message and "/" not in message


def test_no_roots_means_packaged_models_only(layout: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ModelNotAllowed, match="packaged models: smollm2-135m-instruct"):
        resolve_model(str(layout["inside"]), allowed_roots=[])
    built = resolve_model("tiny-random-llama", tmp_path / "cache", allowed_roots=[])
    assert (built / "config.json").is_file()
    # The library (no allowed_roots) still opens any folder: `grpo train` on a laptop.
    assert resolve_model(str(layout["outside"])) == layout["outside"]
