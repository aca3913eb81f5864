"""GET /v1/usage's checkpoint storage quota: the bytes counted against
GRPO_MAX_CHECKPOINT_BYTES_PER_PROJECT (kept checkpoints, deleted jobs' until their purge) and
the limit, per project; and the OpenAPI schema that documents them. Checkpoints are recorded by
the worker's real database callbacks."""

from __future__ import annotations

from collections.abc import Callable

from app.usage.service import human_bytes
from tests.app.progress.test_progress_api import finish, running_job
from tests.conftest import Api


def save(api: Api, sizes: list[int]) -> str:
    """A job of the project of `api` that saved checkpoints of `sizes` bytes, then succeeded."""
    job_id, callbacks, ctx = running_job(api)
    folder = api.settings.resolved_checkpoint_dir / job_id
    for step, size in enumerate(sizes, start=1):
        path = folder / f"checkpoint-{step:06d}"
        path.mkdir(parents=True)
        (path / "model.safetensors").write_bytes(b"w" * size)
        callbacks.on_checkpoint(step, path)
    finish(ctx, job_id)
    return job_id


def test_usage_shows_the_bytes_counted_against_the_limit_and_the_limit(
    make_api: Callable[..., Api],
) -> None:
    api = make_api(max_checkpoint_bytes_per_project=10_000)
    empty = api.client.get("/v1/usage", headers=api.headers).json()
    assert empty["checkpoint_quota"] == {
        "used_bytes": 0,
        "pending_purge_bytes": 0,
        "limit_bytes": 10_000,
    }

    save(api, [1000, 2000])
    deleted = save(api, [500])
    other_key, other_project = api.new_key()
    other_api = Api(api.client, api.settings, other_key, other_project)
    save(other_api, [7000])
    assert api.client.delete(f"/v1/jobs/{deleted}", headers=api.headers).status_code == 200

    usage = api.client.get("/v1/usage", headers=api.headers).json()
    # The deleted job's checkpoint left `checkpoint_bytes` but is on disk until its purge.
    assert usage["checkpoint_bytes"] == 3000
    assert usage["checkpoint_quota"] == {
        "used_bytes": 3500,
        "pending_purge_bytes": 500,
        "limit_bytes": 10_000,
    }
    theirs = api.client.get("/v1/usage", headers=other_api.headers).json()
    assert theirs["checkpoint_quota"]["used_bytes"] == theirs["checkpoint_bytes"] == 7000


def test_usage_limit_is_null_when_there_is_none_and_defaults_to_50_gib(
    make_api: Callable[..., Api],
) -> None:
    unlimited = make_api(max_checkpoint_bytes_per_project=0)
    save(unlimited, [1234])
    quota = unlimited.client.get("/v1/usage", headers=unlimited.headers).json()["checkpoint_quota"]
    assert quota == {"used_bytes": 1234, "pending_purge_bytes": 0, "limit_bytes": None}

    default = make_api()
    quota = default.client.get("/v1/usage", headers=default.headers).json()["checkpoint_quota"]
    assert quota["limit_bytes"] == 50 * 1024**3


def test_the_openapi_schema_documents_the_quota(api: Api) -> None:
    schema = api.client.get("/openapi.json").json()
    usage = schema["components"]["schemas"]["UsageOut"]
    assert "checkpoint_quota" in usage["required"]
    quota = schema["components"]["schemas"]["CheckpointQuotaOut"]
    assert set(quota["properties"]) == {"used_bytes", "pending_purge_bytes", "limit_bytes"}
    assert (
        "GRPO_MAX_CHECKPOINT_BYTES_PER_PROJECT" in quota["properties"]["limit_bytes"]["description"]
    )
    assert (
        "GRPO_MAX_CHECKPOINT_BYTES_PER_PROJECT"
        in (schema["paths"]["/v1/usage"]["get"]["description"])
    )


def test_human_bytes() -> None:
    assert [human_bytes(n) for n in (0, 1023, 1024, 1536 * 1024, 50 * 1024**3)] == [
        "0 B",
        "1023 B",
        "1.00 KiB",
        "1.50 MiB",
        "50.00 GiB",
    ]
