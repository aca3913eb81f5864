"""What users read carries no server path: a checkpoint is shown by its folder name, in the
checkpoints API and in checkpoint events, though the worker stores where it wrote it."""

from __future__ import annotations

from pathlib import Path

from app.core.db import session_scope
from app.jobs.transitions import add_event
from tests.app.progress.test_progress_api import running_job
from tests.conftest import Api


def test_checkpoints_and_their_events_name_the_folder_not_the_server_path(
    api: Api, tmp_path: Path
) -> None:
    job_id, callbacks, ctx = running_job(api)
    server_folder = tmp_path / "srv" / "checkpoints" / job_id / "checkpoint-000001"
    callbacks.on_checkpoint(1, server_folder)
    # An event written before workers stopped recording the path keeps it in the database.
    with session_scope(ctx.sessions) as session:
        add_event(
            session,
            job_id,
            "checkpoint",
            "checkpoint of step 2 saved",
            attempt=1,
            data={"step": 2, "path": str(server_folder.with_name("checkpoint-000002"))},
        )

    checkpoints = api.client.get(f"/v1/jobs/{job_id}/checkpoints", headers=api.headers)
    assert [c["path"] for c in checkpoints.json()["data"]] == ["checkpoint-000001"]
    events = api.client.get(f"/v1/jobs/{job_id}/events", headers=api.headers)
    saved = [e["data"] for e in events.json()["data"] if e["type"] == "checkpoint"]
    assert saved[-1] == {"step": 2, "path": "checkpoint-000002"}
    for response in (checkpoints, events):
        assert str(tmp_path) not in response.text
