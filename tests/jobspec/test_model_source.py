"""What `model` may name by its text (jobspec.model_source, through JobSpec), and the
operator's rule for Hub repo ids (jobspec.paths.hub_model_refusal). Torch-free."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from jobspec import JobSpec
from jobspec.paths import hub_allowlist, hub_model_refusal

BASE: dict[str, Any] = {
    "dataset": {"generator": {"type": "arithmetic", "count": 4}},
    "graders": [{"type": "numeric_match"}],
}

GOOD_IDS = (
    "Qwen/Qwen2.5-0.5B-Instruct",
    "HuggingFaceTB/SmolLM2-135M-Instruct",
    "meta-llama/Llama-3.2-1B",
    "a/b",
    "under_score/x.y_z-1",
)
BAD_IDS = {
    "../x": "'..'",
    "x/..": "'..'",
    "a/b/c": "exactly one '/'",
    "owner/": "starting and ending",
    "-owner/name": "starting and ending",
    "owner/name.": "starting and ending",
    "a--b/c": "'--'",
    "owner/name.git": ".git",
    "owner/na me": "ASCII letters",
    "owner/námé": "ASCII letters",
    "o/" + "n" * 95: "at most 96",
    "a/b\x00c": "",
    "./x": "",
    "~/models/x": "",
    "C:/models/x": "",
    "gpt-17": "",
}


def _spec(**fields: Any) -> JobSpec:
    return JobSpec.model_validate({**BASE, **fields})


def _error(**fields: Any) -> tuple[str, str]:
    with pytest.raises(ValidationError) as refused:
        _spec(**fields)
    first = refused.value.errors()[0]
    return ".".join(str(part) for part in first["loc"]), first["msg"]


@pytest.mark.parametrize("repo_id", GOOD_IDS)
def test_hub_repo_ids_are_models(repo_id: str) -> None:
    assert _spec(model=repo_id).model == repo_id


@pytest.mark.parametrize(("model", "reason"), BAD_IDS.items())
def test_malformed_repo_ids_are_refused_naming_model(model: str, reason: str) -> None:
    where, message = _error(model=model)
    assert where == "model"
    assert "Hub repo id (owner/name)" in message or "NUL" in message, message
    assert reason in message


@pytest.mark.parametrize(
    "revision", ["main", "v1.0", "refs/pr/3", "0123456789abcdef" * 2 + "0" * 8]
)
def test_a_revision_goes_with_a_hub_repo_id(revision: str) -> None:
    spec = _spec(model="Qwen/Qwen2.5-0.5B-Instruct", model_revision=revision)
    assert spec.model_revision == revision


@pytest.mark.parametrize(
    "revision",
    ["", "../main", "a/../b", "/main", "main/", "-x", ".hidden", "a b", "x.lock", "r" * 129],
)
def test_malformed_revisions_are_refused_naming_model_revision(revision: str) -> None:
    where, _ = _error(model="Qwen/Qwen2.5-0.5B-Instruct", model_revision=revision)
    assert where == "model_revision"


@pytest.mark.parametrize("model", ["tiny-random-llama", "/models/team/llama"])
def test_a_revision_without_a_hub_repo_id_is_refused(model: str) -> None:
    where, message = _error(model=model, model_revision="main")
    assert where == "model_revision" and "only to a Hub repo id" in message


def test_the_operator_allows_hub_models_by_owner_or_pattern() -> None:
    def refusal(repo_id: str, allowlist: str, allow_hub: bool = True) -> str | None:
        return hub_model_refusal(
            repo_id, allow_hub=allow_hub, allowlist=hub_allowlist(allowlist), has_roots=False
        )

    assert hub_allowlist(" Qwen, HuggingFaceTB/SmolLM2-*  meta-llama/Llama-3.2-1B ") == (
        "Qwen",
        "HuggingFaceTB/SmolLM2-*",
        "meta-llama/Llama-3.2-1B",
    )
    allowlist = "Qwen, HuggingFaceTB/SmolLM2-*"
    assert refusal("anyone/anything", "") is None
    assert refusal("Qwen/Qwen2.5-7B", allowlist) is None
    assert refusal("qwen/qwen2.5-7b", allowlist) is None  # the Hub ignores case
    assert refusal("HuggingFaceTB/SmolLM2-135M-Instruct", allowlist) is None
    denied = refusal("HuggingFaceTB/SmolLM3-3B", allowlist)
    assert denied is not None and "HuggingFaceTB/SmolLM3-3B" in denied and "Qwen" in denied
    assert refusal("QwenX/model", allowlist) is not None  # an owner is matched whole
    off = refusal("Qwen/Qwen2.5-7B", "", allow_hub=False)
    assert off is not None and "does not train models from the Hugging Face Hub" in off
