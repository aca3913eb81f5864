"""A job's tracker `integrations` at the API: the spec's own rules (strict, bounded, a union on
`type`) and the operator's (an MLflow tracking_uri only from GRPO_MLFLOW_TRACKING_URIS, W&B only
when GRPO_WANDB_MODE allows it), each refusal a 422 naming the field, at submission and in the
dry run. The exports themselves: tests/worker/test_trackers_*.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.conftest import Api, tiny_spec

ENDPOINTS = ("/v1/jobs/validate", "/v1/jobs")
SERVERS = "http://mlflow-a.internal:5000/,https://mlflow-b.internal"


def _submit(api: Api, endpoint: str, *integrations: dict[str, Any]) -> Any:
    body = tiny_spec() | {"integrations": list(integrations)}
    return api.client.post(endpoint, json=body, headers=api.headers)


def _refusal(response: Any) -> tuple[str, str]:
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    return error["param"], error["message"]


def test_integrations_of_the_operators_trackers_are_accepted_and_stored(
    make_api: Callable[..., Api],
) -> None:
    api = make_api(mlflow_tracking_uris=SERVERS, wandb_mode="offline")
    mlflow = {
        "type": "mlflow",
        "experiment": "arithmetic",
        "run_name": "r1",
        "tags": {"team": "rl"},
        "tracking_uri": "http://mlflow-a.internal:5000",  # the list's, without its slash
    }
    wandb = {"type": "wandb", "project": "grpo", "entity": "lab", "name": "r1", "tags": ["a"]}
    for endpoint in ENDPOINTS:
        response = _submit(api, endpoint, mlflow, {"type": "mlflow", "experiment": "x"}, wandb)
        assert response.status_code in (200, 201), response.text
        spec = response.json().get("spec") or response.json()
        assert spec["integrations"] == [
            mlflow,
            {
                "type": "mlflow",
                "experiment": "x",
                "run_name": None,
                "tags": {},
                "tracking_uri": None,
            },
            wandb,
        ]


def test_a_tracking_uri_not_of_the_operator_is_refused_naming_the_field(
    make_api: Callable[..., Api],
) -> None:
    api = make_api(mlflow_tracking_uris=SERVERS)
    for endpoint in ENDPOINTS:
        for uri in (
            "http://127.0.0.1:5000",
            "http://mlflow-a.internal:5001",
            "http://evil.example",
        ):
            integration = {"type": "mlflow", "experiment": "e", "tracking_uri": uri}
            param, message = _refusal(_submit(api, endpoint, integration))
            assert param == "integrations[0].tracking_uri", (uri, message)
            assert message == (
                f"tracking_uri {uri!r} is not one of this service's MLflow tracking servers "
                "(http://mlflow-a.internal:5000, https://mlflow-b.internal); leave it out for "
                "http://mlflow-a.internal:5000"
            )


def test_trackers_the_operator_did_not_set_up_are_refused(make_api: Callable[..., Api]) -> None:
    api = make_api()  # no MLflow servers, W&B disabled: the defaults
    for endpoint in ENDPOINTS:
        wandb = {"type": "wandb", "project": "p"}
        assert _refusal(_submit(api, endpoint, wandb)) == (
            "integrations[0]",
            "this service exports to no Weights & Biases account",
        )
        mlflow = {"type": "mlflow", "experiment": "e"}
        assert _refusal(_submit(api, endpoint, mlflow)) == (
            "integrations[0]",
            "this service exports to no MLflow tracking server",
        )


def test_malformed_integrations_are_refused_naming_the_field(
    make_api: Callable[..., Api],
) -> None:
    api = make_api(mlflow_tracking_uris=SERVERS, wandb_mode="online")
    mlflow = {"type": "mlflow", "experiment": "e"}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"type": "comet", "project": "p"}, "integrations[0].type"),
        ({"type": "mlflow"}, "integrations[0].experiment"),
        (mlflow | {"experiment": ""}, "integrations[0].experiment"),
        (mlflow | {"experiment": "e" * 251}, "integrations[0].experiment"),
        (mlflow | {"api_key": "secret"}, "integrations[0].api_key"),
        (mlflow | {"tracking_uri": "file:///etc"}, "integrations[0].tracking_uri"),
        (mlflow | {"tracking_uri": "h" * 1001}, "integrations[0].tracking_uri"),
        (mlflow | {"tags": {f"k{i}": "v" for i in range(33)}}, "integrations[0].tags"),
        (mlflow | {"tags": {"grpo.job_id": "forged"}}, "integrations[0].tags"),
        (mlflow | {"tags": {"k": "v" * 5001}}, "integrations[0].tags"),
        (mlflow | {"tags": {"a\nb": "v"}}, "integrations[0].tags"),
        ({"type": "wandb", "project": "a/b"}, "integrations[0].project"),
        ({"type": "wandb", "project": "p", "entity": "e" * 129}, "integrations[0].entity"),
        ({"type": "wandb", "project": "p", "tags": ["t" * 65]}, "integrations[0].tags"),
        ({"type": "wandb", "project": "p", "tags": ["t"] * 33}, "integrations[0].tags"),
        ({"type": "wandb", "project": "p", "base_url": "http://x"}, "integrations[0].base_url"),
    ]
    for endpoint in ENDPOINTS:
        for integration, param in cases:
            assert _refusal(_submit(api, endpoint, integration))[0] == param, integration
        assert _refusal(_submit(api, endpoint, *[mlflow] * 5))[0] == "integrations"
