"""/v1/fine_tuning and the OpenAI-shaped files: requests map to native jobs, objects and errors
come back in OpenAI's shapes (the SDK-level test with a real worker is
tests/worker/test_openai_sdk.py)."""

from __future__ import annotations

import csv
import io
import json
from datetime import timedelta
from typing import Any

from app.core.clock import utcnow
from app.core.db import session_scope
from app.core.models import Job
from app.jobs import transitions
from app.jobs.transitions import JobStatus
from app.progress import repository as progress_repo
from tests.conftest import Api

ROWS = [{"messages": [{"role": "user", "content": f"say {w}"}], "answer": "7"} for w in "abcdef"]
STRING_CHECK = {
    "type": "string_check",
    "name": "exact",
    "input": "{{ sample.output_text }}",
    "reference": "{{ item.answer }}",
    "operation": "eq",
}


def upload(api: Api, rows: list[dict[str, Any]], purpose: str = "fine-tune") -> dict[str, Any]:
    content = "".join(json.dumps(r) + "\n" for r in rows).encode()
    response = api.client.post(
        "/v1/files",
        files={"file": ("train.jsonl", content)},
        data={"purpose": purpose},
        headers=api.headers,
    )
    assert response.status_code == 201, response.text
    body: dict[str, Any] = response.json()
    return body


def request(file_id: str, **extra: Any) -> dict[str, Any]:
    hyper = extra.pop("hyperparameters", {})
    return {
        "model": "tiny-random-llama",
        "training_file": file_id,
        "method": {
            "type": "reinforcement",
            "reinforcement": {"grader": STRING_CHECK, "hyperparameters": hyper},
        },
        "grpo_service": {"rollout": {"engine": "transformers"}},
        **extra,
    }


def create(api: Api, body: dict[str, Any]) -> Any:
    return api.client.post("/v1/fine_tuning/jobs", json=body, headers=api.headers)


def error(response: Any, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()["error"]
    return body


# ---- files ---------------------------------------------------------------------------------


def test_files_are_openai_file_objects(api: Api) -> None:
    before = int(utcnow().timestamp())
    file = upload(api, ROWS)
    assert file["object"] == "file" and file["purpose"] == "fine-tune"
    assert file["status"] == "processed" and file["row_count"] == 6
    assert isinstance(file["created_at"], int) and file["created_at"] >= before - 1
    assert api.client.get(f"/v1/files/{file['id']}", headers=api.headers).json() == file
    content = api.client.get(f"/v1/files/{file['id']}/content", headers=api.headers)
    assert [json.loads(line) for line in content.text.splitlines()] == ROWS
    second = upload(api, ROWS[:2], purpose="train")
    listed = api.client.get("/v1/files?limit=1", headers=api.headers).json()
    assert [f["id"] for f in listed["data"]] == [second["id"]] and listed["has_more"] is True
    rest = api.client.get(f"/v1/files?after={second['id']}", headers=api.headers).json()
    assert [f["id"] for f in rest["data"]] == [file["id"]] and rest["has_more"] is False
    only = api.client.get("/v1/files?purpose=fine-tune", headers=api.headers).json()
    assert [f["id"] for f in only["data"]] == [file["id"]]


def test_a_file_in_use_cannot_be_deleted_until_its_job_ends(api: Api) -> None:
    file = upload(api, ROWS)
    job = create(api, request(file["id"]))
    assert job.status_code == 200, job.text
    refused = api.client.delete(f"/v1/files/{file['id']}", headers=api.headers)
    assert error(refused, 409)["code"] == "file_in_use"
    assert api.client.post(f"/v1/fine_tuning/jobs/{job.json()['id']}/cancel", headers=api.headers)
    deleted = api.client.delete(f"/v1/files/{file['id']}", headers=api.headers)
    assert deleted.json() == {"id": file["id"], "object": "file", "deleted": True}
    gone = api.client.get(f"/v1/files/{file['id']}", headers=api.headers)
    assert error(gone, 404)["param"] == "file_id"


# ---- creating jobs -------------------------------------------------------------------------


def test_a_request_maps_to_a_native_spec_with_auto_resolved(api: Api) -> None:
    train, validation = upload(api, ROWS), upload(api, ROWS[:2])
    body = request(
        train["id"],
        validation_file=validation["id"],
        suffix="my-run",
        seed=7,
        metadata={"team": "rl"},
        hyperparameters={"n_epochs": 2, "batch_size": 4, "learning_rate_multiplier": 3},
    )
    response = create(api, body)
    assert response.status_code == 200, response.text
    job = response.json()
    assert job["object"] == "fine_tuning.job" and job["status"] == "queued"
    assert job["model"] == "tiny-random-llama" and job["seed"] == 7
    assert job["training_file"] == train["id"] and job["validation_file"] == validation["id"]
    assert job["fine_tuned_model"] is None and job["metadata"] == {"team": "rl"}
    assert job["hyperparameters"] == {
        "batch_size": 4,
        "learning_rate_multiplier": 3.0,
        "n_epochs": 2,
    }
    native = api.client.get(f"/v1/jobs/{job['id']}", headers=api.headers).json()["spec"]
    # 2 epochs of 6 rows at 4 prompts a step: ceil(12 / 4) steps.
    assert native["grpo"]["steps"] == 3 and native["grpo"]["prompts_per_step"] == 4
    assert native["grpo"]["learning_rate"] == 3e-6
    assert native["grpo"]["group_size"] == 8 and native["grpo"]["max_new_tokens"] == 128
    assert native["eval"] == {"interval": 1, "max_rows": 64}  # auto: every ceil(3 / 10) steps
    assert native["dataset"]["validation_file_id"] == validation["id"]
    assert native["graders"][0]["reference"] == "{{ item.answer }}"
    assert native["name"] == "my-run"


def test_openai_model_names_map_to_the_operators_models(api: Api) -> None:
    file = upload(api, ROWS)
    body = request(file["id"], model="o4-mini-2025-04-16")
    job = create(api, body).json()
    assert job["model"] == "o4-mini-2025-04-16"
    native = api.client.get(f"/v1/jobs/{job['id']}", headers=api.headers).json()
    assert native["spec"]["model"] == "smollm2-135m-instruct"
    unknown = error(create(api, request(file["id"], model="gpt-5-turbo")))
    assert unknown["param"] == "model" and "gpt-5-turbo" in unknown["message"]


def test_the_extension_sets_native_settings_and_may_not_fight_a_hyperparameter(
    api: Api,
) -> None:
    file = upload(api, ROWS)
    body = request(file["id"])
    body["grpo_service"] |= {"grpo": {"kl": {"estimator": "k3", "beta": 0.1}, "group_size": 4}}
    job = create(api, body).json()
    native = api.client.get(f"/v1/jobs/{job['id']}", headers=api.headers).json()["spec"]
    assert native["grpo"]["kl"]["estimator"] == "k3" and native["grpo"]["group_size"] == 4
    both = request(file["id"], hyperparameters={"compute_multiplier": 2})
    both["grpo_service"] |= {"grpo": {"group_size": 4}}
    refusal = error(create(api, both))
    assert refusal["param"] == "grpo_service.grpo.group_size"
    bad = request(file["id"])
    bad["grpo_service"] |= {"grpo": {"kl": {"estimator": "k9"}}}
    assert error(create(api, bad))["param"] == "grpo_service.grpo.kl.estimator"


def test_refusals_are_400s_naming_the_request_field(api: Api) -> None:
    file = upload(api, ROWS)
    cases: list[tuple[dict[str, Any], str]] = []
    supervised = request(file["id"])
    supervised["method"] = {"type": "supervised", "supervised": {}}
    cases.append((supervised, "method.type"))
    cases.append(({k: v for k, v in request(file["id"]).items() if k != "method"}, "method"))
    cases.append((request("file_nope"), "training_file"))
    cases.append((request(file["id"], validation_file="file_nope"), "validation_file"))
    cases.append((request(file["id"], hyperparameters={"batch_size": 0}), "method.reinforcement.hyperparameters.batch_size"))  # fmt: skip
    cases.append((request(file["id"], hyperparameters={"n_epochs": "many"}), "method.reinforcement.hyperparameters.n_epochs"))  # fmt: skip
    bad_grader = request(file["id"])
    bad_grader["method"]["reinforcement"]["grader"] = {**STRING_CHECK, "reference": "{{ nope.x }}"}
    cases.append((bad_grader, "method.reinforcement.grader.reference"))
    cases.append((request(file["id"], suffix="has space"), "suffix"))
    cases.append((request(file["id"], seed=float("inf")), "body"))
    for body, param in cases:
        try:
            response = create(api, body)
        except ValueError:  # httpx refuses to send Infinity as JSON
            response = api.client.post(
                "/v1/fine_tuning/jobs",
                content=json.dumps(body).encode(),
                headers={**api.headers, "Content-Type": "application/json"},
            )
            param = "seed"
        got = error(response)
        assert got["param"] == param, (param, got)
        assert got["type"] == "invalid_request_error" and got["code"] == "invalid_value"


def test_operator_limits_name_the_hyperparameter_that_decided(make_api: Any) -> None:
    api = make_api(max_total_tokens=100_000)
    file = upload(api, ROWS)
    refused = error(create(api, request(file["id"], hyperparameters={"n_epochs": 20})))
    assert refused["param"] == "method.reinforcement.hyperparameters.n_epochs"
    assert "100000" in refused["message"]


def test_wandb_integrations_map_to_the_native_ones(make_api: Any) -> None:
    off = make_api()  # W&B export disabled (the default): refused, naming OpenAI's field
    file = upload(off, ROWS)
    wandb = [{"type": "wandb", "wandb": {"project": "rft", "tags": ["a"]}}]
    assert error(create(off, request(file["id"], integrations=wandb)))["param"] == (
        "integrations[0].wandb"
    )
    bad = [{"type": "mlflow"}]
    assert error(create(off, request(file["id"], integrations=bad)))["param"] == "integrations[0]"
    on = make_api(wandb_mode="offline")
    file = upload(on, ROWS)
    job = create(on, request(file["id"], integrations=wandb)).json()
    assert job["integrations"] == [
        {"type": "wandb", "wandb": {"project": "rft", "entity": None, "name": None, "tags": ["a"]}}
    ]
    native = on.client.get(f"/v1/jobs/{job['id']}", headers=on.headers).json()["spec"]
    assert native["integrations"][0]["project"] == "rft"


def test_retries_with_an_idempotency_key_create_one_job(api: Api) -> None:
    file = upload(api, ROWS)
    headers = {**api.headers, "Idempotency-Key": "ft-1"}
    body = request(file["id"])  # no seed: one is drawn, and the retry must still match
    first = api.client.post("/v1/fine_tuning/jobs", json=body, headers=headers)
    again = api.client.post("/v1/fine_tuning/jobs", json=body, headers=headers)
    assert first.status_code == again.status_code == 200
    assert again.json() == first.json() and again.headers["Idempotent-Replayed"] == "true"


def test_authentication_and_not_found_errors(api: Api) -> None:
    no_key = api.client.get("/v1/fine_tuning/jobs")
    assert error(no_key, 401)["type"] == "authentication_error"
    missing = api.client.get("/v1/fine_tuning/jobs/job_0000000000000000", headers=api.headers)
    assert error(missing, 404)["param"] == "job_id"


# ---- reading jobs --------------------------------------------------------------------------


def _finish(api: Api, job_id: str, steps: int, checkpoints: tuple[int, ...]) -> None:
    """What a worker records for a job that trains `steps` steps and succeeds."""
    from app.core.db import make_engine, make_session_factory

    engine = make_engine(api.settings.resolved_database_url)
    sessions = make_session_factory(engine)
    start = utcnow()
    try:
        with session_scope(sessions) as session:
            transitions.transition(session, job_id, JobStatus.RUNNING, attempt=None)
        for step in range(1, steps + 1):
            with session_scope(sessions) as session:
                values = {"reward/mean": step / 10, "tokens/trained": 100.0}
                progress_repo.add_metrics_once(
                    session,
                    job_id=job_id,
                    step=step,
                    attempt=0,
                    values=values,
                    now=start + timedelta(seconds=step),
                )
                if step in checkpoints:
                    progress_repo.add_checkpoint_once(
                        session,
                        job_id=job_id,
                        step=step,
                        attempt=0,
                        path=api.settings.data_dir / f"checkpoint-{step:06d}",
                        now=start + timedelta(seconds=step),
                    )
        with session_scope(sessions) as session:
            transitions.transition(session, job_id, JobStatus.SUCCEEDED, attempt=None)
    finally:
        engine.dispose()


def test_a_finished_job_shows_its_model_tokens_events_checkpoints_and_results(api: Api) -> None:
    file = upload(api, ROWS)
    job = create(api, request(file["id"], suffix="done")).json()
    _finish(api, job["id"], steps=5, checkpoints=(2, 4))
    got = api.client.get(f"/v1/fine_tuning/jobs/{job['id']}", headers=api.headers).json()
    assert got["status"] == "succeeded"
    assert got["fine_tuned_model"] == f"ft:tiny-random-llama:done:{job['id']}"
    assert got["trained_tokens"] == 500 and isinstance(got["finished_at"], int)

    events: list[dict[str, Any]] = []
    after = None
    while True:
        url = f"/v1/fine_tuning/jobs/{job['id']}/events?limit=3" + (
            f"&after={after}" if after else ""
        )
        page = api.client.get(url, headers=api.headers).json()
        events += page["data"]
        if not page["has_more"]:
            break
        after = page["data"][-1]["id"]
    assert len({e["id"] for e in events}) == len(events)
    metrics = [e for e in events if e["type"] == "metrics"]
    assert [e["data"]["step"] for e in metrics] == [5, 4, 3, 2, 1]  # newest first
    assert metrics[0]["data"]["reward/mean"] == 0.5
    assert [e["created_at"] for e in events] == sorted(
        (e["created_at"] for e in events), reverse=True
    )
    assert {e["data"]["type"] for e in events if e["type"] == "message"} >= {
        "created",
        "status",
    } or events

    ckpts = api.client.get(
        f"/v1/fine_tuning/jobs/{job['id']}/checkpoints?limit=1", headers=api.headers
    ).json()
    first = ckpts["data"][0]
    assert first["object"] == "fine_tuning.job.checkpoint" and first["step_number"] == 4
    assert first["fine_tuned_model_checkpoint"] == f"{got['fine_tuned_model']}:ckpt-step-4"
    assert first["metrics"]["reward/mean"] == 0.4 and ckpts["has_more"] is True
    rest = api.client.get(
        f"/v1/fine_tuning/jobs/{job['id']}/checkpoints?after={first['id']}", headers=api.headers
    ).json()
    assert [c["step_number"] for c in rest["data"]] == [2] and rest["has_more"] is False

    [result_id] = got["result_files"]
    result = api.client.get(f"/v1/files/{result_id}", headers=api.headers).json()
    assert result["purpose"] == "fine-tune-results"
    content = api.client.get(f"/v1/files/{result_id}/content", headers=api.headers)
    table = list(csv.reader(io.StringIO(content.text)))
    assert table[0] == ["step", "reward/mean", "tokens/trained"]
    assert [row[0] for row in table[1:]] == ["1", "2", "3", "4", "5"]
    assert result["bytes"] == len(content.content)


def test_list_filters_by_metadata_and_pages_with_after(api: Api) -> None:
    file = upload(api, ROWS)
    ids = [
        create(api, request(file["id"], metadata={"team": team})).json()["id"]
        for team in ("a", "b", "a")
    ]
    only_a = api.client.get("/v1/fine_tuning/jobs?metadata[team]=a", headers=api.headers).json()
    assert [j["id"] for j in only_a["data"]] == [ids[2], ids[0]]
    page = api.client.get("/v1/fine_tuning/jobs?limit=2", headers=api.headers).json()
    assert [j["id"] for j in page["data"]] == [ids[2], ids[1]] and page["has_more"]
    rest = api.client.get(f"/v1/fine_tuning/jobs?after={ids[1]}", headers=api.headers).json()
    assert [j["id"] for j in rest["data"]] == [ids[0]]


def test_pause_resume_and_a_final_conflict_that_says_not_to_retry(api: Api) -> None:
    file = upload(api, ROWS)
    job_id = create(api, request(file["id"])).json()["id"]
    base = f"/v1/fine_tuning/jobs/{job_id}"
    assert api.client.post(f"{base}/pause", headers=api.headers).json()["status"] == "paused"
    assert api.client.post(f"{base}/resume", headers=api.headers).json()["status"] == "queued"
    assert api.client.post(f"{base}/cancel", headers=api.headers).json()["status"] == "cancelled"
    refused = api.client.post(f"{base}/pause", headers=api.headers)
    assert error(refused, 409)["code"] == "invalid_state"
    assert refused.headers["x-should-retry"] == "false"


def test_native_jobs_are_listed_in_the_openai_view(api: Api) -> None:
    from tests.conftest import tiny_spec

    native = api.client.post("/v1/jobs", json=tiny_spec(), headers=api.headers).json()
    listed = api.client.get("/v1/fine_tuning/jobs", headers=api.headers).json()["data"]
    [shown] = [j for j in listed if j["id"] == native["id"]]
    assert shown["model"] == "tiny-random-llama" and shown["training_file"] is None
    assert shown["method"]["reinforcement"]["grader"]["type"] == "numeric_match"


def test_openai_grader_paths_run_the_same_engine(api: Api) -> None:
    body = {"grader": STRING_CHECK, "model_sample": "7", "item": {"answer": "7"}}
    ran = api.client.post("/v1/fine_tuning/alpha/graders/run", json=body, headers=api.headers)
    assert ran.status_code == 200 and ran.json()["reward"] == 1.0
    bad = {"grader": {**STRING_CHECK, "operation": "regex"}}
    refused = api.client.post(
        "/v1/fine_tuning/alpha/graders/validate", json=bad, headers=api.headers
    )
    assert error(refused)["param"] == "grader.operation"


def test_job_rows_keep_the_request_words(api: Api) -> None:
    file = upload(api, ROWS)
    job_id = create(api, request(file["id"], suffix="kept")).json()["id"]
    from app.core.db import make_engine, make_session_factory

    engine = make_engine(api.settings.resolved_database_url)
    try:
        with session_scope(make_session_factory(engine)) as session:
            stored = session.get(Job, job_id)
            assert stored is not None and stored.openai is not None
            assert stored.openai["suffix"] == "kept"
            assert stored.openai["requested"]["n_epochs"] == "auto"
    finally:
        engine.dispose()


# Request bodies in the shape of OpenAI's RFT guide and API reference: accepted as written.
GUIDE_GRADERS: list[dict[str, Any]] = [
    {
        "type": "score_model",
        "name": "gpt-4.1 grader",
        "model": "gpt-4.1-2025-04-14",
        "input": [
            {
                "role": "user",
                "type": "message",
                "content": "Score the answer {{ sample.output_text }} against "
                "{{ item.answer }} from 0 to 10. Reply with the number.",
            }
        ],
        "range": [0, 10],
        "sampling_params": {"temperature": 0, "max_completions_tokens": 16, "seed": 42},
    },
    {
        "type": "python",
        "name": "python grader",
        "image_tag": "2025-05-08",
        "source": "def grade(sample, item):\n    return 1.0 if sample['output_text'] == item['answer'] else 0.0\n",
    },
    {
        "type": "multi",
        "name": "combined",
        "graders": {
            "exact": {**STRING_CHECK, "name": "exact"},
            "similar": {
                "type": "text_similarity",
                "name": "similar",
                "input": "{{ sample.output_text }}",
                "reference": "{{ item.answer }}",
                "evaluation_metric": "fuzzy_match",
                "pass_threshold": 0.8,
            },
        },
        "calculate_output": "0.5 * exact + 0.5 * similar",
    },
]


def test_the_rft_guides_bodies_are_accepted_as_written(api: Api, monkeypatch: Any) -> None:
    # The operator's judge: graders naming OpenAI's models run on it (its served model).
    judge = {"default": {"base_url": "http://127.0.0.1:9/v1", "model": "local-judge"}}
    monkeypatch.setenv("GRPO_JUDGE_ENDPOINTS", json.dumps(judge))
    train, validation = upload(api, ROWS), upload(api, ROWS[:3])
    hyperparameters: list[dict[str, Any]] = [
        {"reasoning_effort": "medium"},
        {"n_epochs": 1, "batch_size": 4, "eval_interval": 2, "eval_samples": 3,
         "compute_multiplier": 1.0, "learning_rate_multiplier": "auto"},
    ]  # fmt: skip
    for grader in GUIDE_GRADERS:
        for hyper in hyperparameters:
            body = {
                "training_file": train["id"],
                "validation_file": validation["id"],
                "model": "o4-mini-2025-04-16",
                "method": {
                    "type": "reinforcement",
                    "reinforcement": {
                        "grader": grader,
                        "response_format": {
                            "type": "json_schema",
                            "json_schema": {"name": "answer", "schema": {"type": "object"}},
                        },
                        "hyperparameters": hyper,
                    },
                },
            }
            response = create(api, body)
            assert response.status_code == 200, (grader["type"], hyper, response.text)
            shown = response.json()["method"]["reinforcement"]
            assert shown["grader"]["type"] == grader["type"]


def test_cursors_past_a_columns_range_or_in_other_digits_are_refused(api: Api) -> None:
    """An `after` the API never sent is a client error naming `after`, also when its number
    overflows the column it is compared with (a 500 before: 'integer out of range') or is
    written in digits int() refuses ('²')."""
    job = create(api, request(upload(api, ROWS)["id"])).json()
    base = f"/v1/fine_tuning/jobs/{job['id']}"
    for path, after in [
        ("events", f"ftevent-m{2**31}"),
        ("events", f"ftevent-e{2**63}"),
        ("events", "ftevent-e\u00b2"),
        ("checkpoints", f"ftckpt-{2**63}"),
        ("checkpoints", "ftckpt-\u00b2"),
    ]:
        response = api.client.get(f"{base}/{path}", params={"after": after}, headers=api.headers)
        assert error(response)["param"] == "after", (path, after)  # OpenAI's 400
