"""A job with conversation rows and the graders users bring (a sandboxed python grader reading
item fields, a math grader, and a score_model judge on a real vLLM server), submitted over HTTP
and trained by a real Celery worker."""

from __future__ import annotations

import json
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import Api, tiny_spec
from tests.vllm_judge import vllm_judge_server
from tests.worker.conftest import WorkerProcess, wait_for

pytest.importorskip("vllm")
pytestmark = [
    pytest.mark.model,
    pytest.mark.process,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed"),
]

PYTHON = (
    "def grade(sample, item):\n    return 1.0 if item['digit'] in sample['output_text'] else 0.0\n"
)


# One store: it is not what this tests (test_round_trip runs jobs on both).
@pytest.mark.parametrize("backend", ["postgres"])
def test_conversation_rows_and_user_graders_train_through_the_service(
    api: Api,
    start_worker: Callable[..., WorkerProcess],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    with vllm_judge_server(tmp_path) as judge_url:
        # The API (admission) and the worker read the operator's judge endpoints.
        monkeypatch.setenv("GRPO_JUDGE_ENDPOINTS", json.dumps({"local": {"base_url": judge_url}}))
        api.settings.queue_name = f"{api.settings.queue_name}-{secrets.token_hex(3)}"
        worker = start_worker(api.settings)
        rows = [
            {
                "messages": [
                    {"role": "system", "content": "Answer with one digit."},
                    {"role": "user", "content": f"say {w}"},
                ],
                "answer": "7",
                "digit": "7",
            }
            for w in "abcd"
        ]
        spec = tiny_spec() | {
            "dataset": {"rows": rows},
            "graders": [
                {"type": "python", "name": "digit", "source": PYTHON},
                {"type": "math", "name": "math", "weight": 0.5},
                {
                    "type": "score_model",
                    "name": "judge",
                    "weight": 0.2,
                    "model": "judge",
                    "endpoint": "local",
                    "input": [{"role": "user", "content": "Repeat: 3. {{ sample.output_text }}"}],
                    "range": [0, 10],
                    "sampling_params": {"max_completions_tokens": 4},
                },
            ],
        }
        response = api.client.post("/v1/jobs", json=spec, headers=api.headers)
        assert response.status_code == 201, response.text
        job_id = response.json()["id"]

        def finished() -> dict[str, object] | None:
            body = api.client.get(f"/v1/jobs/{job_id}", headers=api.headers).json()
            return body if body["status"] in ("succeeded", "failed", "cancelled") else None

        try:
            final = wait_for(finished, 400, "the job to finish")
        except AssertionError:
            raise AssertionError(worker.log_tail()) from None
    assert isinstance(final, dict)
    assert final["status"] == "succeeded", (final["error"], worker.log_tail())
    metrics = api.client.get(f"/v1/jobs/{job_id}/metrics", headers=api.headers).json()
    for grader in ("digit", "math", "judge"):
        assert f"reward/{grader}/mean" in metrics["available"], metrics["available"]
        assert f"reward/{grader}/errors" in metrics["available"]
    # The sandboxed python grader and the math grader scored every sample.
    for name in ("reward/digit/errors", "reward/math/errors"):
        assert [p["value"] for p in metrics["series"][name]] == [0.0, 0.0], name
