"""Hub repo ids at the API: a well-formed `owner/name` (with an optional `model_revision`) is
accepted when the operator allows Hub models, anything else is a 422 naming the field, at
submission and in the dry run. Whether the worker's cache holds the model is the worker's
business (tests/worker/test_runner.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.conftest import Api, tiny_spec

ENDPOINTS = ("/v1/jobs/validate", "/v1/jobs")


def _submit(api: Api, endpoint: str, **changes: Any) -> Any:
    return api.client.post(endpoint, json=tiny_spec() | changes, headers=api.headers)


def _refused(response: Any) -> dict[str, Any]:
    assert response.status_code == 422, response.text
    error: dict[str, Any] = response.json()["error"]
    return error


def test_a_hub_repo_id_and_revision_are_accepted(make_api: Callable[..., Api]) -> None:
    api = make_api()
    for endpoint in ENDPOINTS:
        response = _submit(api, endpoint, model="Qwen/Qwen2.5-0.5B-Instruct", model_revision="v1.0")
        assert response.status_code in (200, 201), response.text
        spec = response.json().get("spec") or response.json()
        assert spec["model"] == "Qwen/Qwen2.5-0.5B-Instruct"
        assert spec["model_revision"] == "v1.0"


def test_malformed_repo_ids_and_revisions_are_refused_naming_the_field(
    make_api: Callable[..., Api],
) -> None:
    api = make_api()
    bad_models = ("../x", "a/b/c", "a/b\x00c", "owner/" + "n" * 100, "x/../../etc")
    for endpoint in ENDPOINTS:
        for model in bad_models:
            error = _refused(_submit(api, endpoint, model=model))
            assert error["param"] == "model", (model, error)
        # An absolute path is a folder, and there are no model roots here.
        error = _refused(_submit(api, endpoint, model="/etc"))
        assert error["param"] == "model" and "/" not in error["message"]
        for revision in ("../main", "a b", "r" * 200):
            error = _refused(
                _submit(api, endpoint, model="Qwen/Qwen2.5-0.5B-Instruct", model_revision=revision)
            )
            assert error["param"] == "model_revision", (revision, error)
        error = _refused(_submit(api, endpoint, model_revision="main"))
        assert error["param"] == "model_revision" and "Hub repo id" in error["message"]


def test_the_operator_can_forbid_hub_models_or_allow_only_some(
    make_api: Callable[..., Api],
) -> None:
    closed = make_api(allow_hub_models=False)
    listed = make_api(hub_model_allowlist="Qwen, HuggingFaceTB/SmolLM2-*")
    for endpoint in ENDPOINTS:
        error = _refused(_submit(closed, endpoint, model="Qwen/Qwen2.5-0.5B-Instruct"))
        assert error["param"] == "model" and "Hugging Face Hub" in error["message"]
        # The packaged models stay open.
        assert _submit(closed, endpoint, model="tiny-random-llama").status_code in (200, 201)

        for allowed in ("Qwen/Qwen2.5-0.5B-Instruct", "HuggingFaceTB/SmolLM2-360M-Instruct"):
            assert _submit(listed, endpoint, model=allowed).status_code in (200, 201), allowed
        error = _refused(_submit(listed, endpoint, model="evil-org/exfiltrate"))
        assert error["param"] == "model"
        assert "evil-org/exfiltrate" in error["message"] and "Qwen" in error["message"]
