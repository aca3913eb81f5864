"""Hub models by repo id, offline: a real hub-cache layout on disk (tests/hub_cache.py) built from
the packaged models, read through resolve_model and load_policy as a worker reads a job's model.
No test reaches a hub: HF_HUB_OFFLINE is set and HF_HOME points into tmp_path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.hub_cache import add_snapshot
from trainer.errors import ModelNotCached
from trainer.models.hub import hub_cache_dir, resolve_hub_model
from trainer.models.loading import load_policy, resolve_model

REPO = "tiny-org/Tiny-Llama-2L"
COMMIT_A = "a" * 40
COMMIT_B = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An offline process whose Hugging Face cache is empty and under tmp_path."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    return tmp_path / "hf-home" / "hub"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return resolve_model("tiny-random-llama", cache_dir=tmp_path_factory.mktemp("models"))


def test_a_hub_cache_model_loads_by_repo_id_offline(hub: Path, tiny_folder: Path) -> None:
    snapshot = add_snapshot(hub, REPO, tiny_folder, COMMIT_A)
    assert hub_cache_dir() == hub
    path = resolve_model(REPO)
    assert path == snapshot
    # The files are symlinks into blobs/, as `hf download` leaves them.
    assert (path / "model.safetensors").is_symlink()

    model, tokenizer = load_policy(path)
    original, original_tokenizer = load_policy(tiny_folder)
    text = "what is 2+3?"
    assert tokenizer(text).input_ids == original_tokenizer(text).input_ids
    assert tokenizer.chat_template == original_tokenizer.chat_template
    ids = torch.tensor([tokenizer(text).input_ids])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, original(ids).logits)


def test_a_revision_is_a_branch_or_a_commit(hub: Path, tiny_folder: Path) -> None:
    first = add_snapshot(hub, REPO, tiny_folder, COMMIT_A, branches=["main"])
    second = add_snapshot(hub, REPO, tiny_folder, COMMIT_B, branches=["v2"])
    assert resolve_model(REPO) == first
    assert resolve_model(REPO, revision="main") == first
    assert resolve_model(REPO, revision="v2") == second
    assert resolve_model(REPO, revision=COMMIT_A) == first
    assert resolve_model(REPO, revision=COMMIT_B) == second
    # A model folder given by path ignores the revision (the worker passes its snapshot on).
    assert resolve_model(str(second), revision="v2") == second


def _not_cached(repo_id: str, revision: str | None = None) -> str:
    with pytest.raises(ModelNotCached) as refused:
        resolve_model(repo_id, revision=revision)
    assert refused.value.reason == "model_not_cached"
    return str(refused.value)


def test_an_uncached_model_fails_naming_it_and_how_to_prefetch_it(
    hub: Path, tmp_path: Path
) -> None:
    message = _not_cached("nobody/not-cached")
    assert "model nobody/not-cached (revision main)" in message
    assert "HF_HUB_OFFLINE" in message
    assert "hf download nobody/not-cached --revision main" in message
    assert "HF_HOME=" in message
    # No server path: the user reads this as the job's failure message.
    assert str(tmp_path) not in message and "/root" not in message
    assert not hub.exists() or not any(hub.iterdir())  # nothing was written, nothing fetched


def test_an_unknown_revision_of_a_cached_model_fails_the_same_way(
    hub: Path, tiny_folder: Path
) -> None:
    add_snapshot(hub, REPO, tiny_folder, COMMIT_A)
    message = _not_cached(REPO, "no-such-branch")
    assert f"hf download {REPO} --revision no-such-branch" in message
    message = _not_cached(REPO, COMMIT_B)
    assert f"(revision {COMMIT_B})" in message


def test_a_partial_snapshot_is_refused_before_transformers_reads_it(
    hub: Path, tiny_folder: Path
) -> None:
    add_snapshot(hub, REPO, tiny_folder, COMMIT_A, skip=["model.safetensors"])
    assert "no safetensors weights" in _not_cached(REPO)
    add_snapshot(hub, "tiny-org/no-config", tiny_folder, COMMIT_A, skip=["config.json"])
    assert "no config.json" in _not_cached("tiny-org/no-config")


def test_hf_hub_cache_wins_over_hf_home(
    hub: Path, tiny_folder: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    other = tmp_path / "elsewhere"
    snapshot = add_snapshot(other, REPO, tiny_folder, COMMIT_A)
    monkeypatch.setenv("HF_HUB_CACHE", str(other))
    assert hub_cache_dir() == other
    assert resolve_hub_model(REPO) == snapshot


@pytest.mark.slow
def test_smollm2_from_a_hub_cache_layout_answers_arithmetic(hub: Path) -> None:
    # The packaged SmolLM2 (converted once into the shared model cache, about 40 s the first
    # time), laid out as `hf download HuggingFaceTB/SmolLM2-135M-Instruct` would leave it.
    folder = resolve_model("smollm2-135m-instruct")
    add_snapshot(hub, "HuggingFaceTB/SmolLM2-135M-Instruct", folder, COMMIT_A, link=True)
    model, tokenizer = load_policy(resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct"))
    assert len(tokenizer) == 49152
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
