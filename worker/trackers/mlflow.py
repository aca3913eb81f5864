"""An MLflow tracking server, through its REST API (``/api/2.0/mlflow``) with httpx: no
``mlflow`` package in the worker.

The run: the experiment is found by name (``experiments/get-by-name``) or created; a job's run
is found again by its ``grpo.job_id`` tag (``runs/search``), so a resumed job continues the
same run, or created (``runs/create``). Params go in ``runs/log-batch`` calls of at most 100,
metrics in calls of at most 1000 (MLflow's limits), and ``runs/update`` ends the run.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from worker.trackers.exporter import Outcome, PermanentError, Point

API = "/api/2.0/mlflow"
MAX_METRICS_PER_CALL = 1000
MAX_PARAMS_PER_CALL = 100
_STATUS = {"succeeded": "FINISHED", "failed": "FAILED", "cancelled": "KILLED"}


class MlflowError(Exception):
    """A failed request (the server's error code and message when it sent one)."""


def _tags(tags: dict[str, str]) -> list[dict[str, str]]:
    return [{"key": k, "value": v} for k, v in tags.items()]


class MlflowTracker:
    kind = "mlflow"

    def __init__(
        self,
        *,
        base_url: str,
        experiment: str,
        run_name: str,
        job_id: str,
        params: dict[str, str],
        tags: dict[str, str],
        auth: httpx.Auth | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 10.0,
    ) -> None:
        self.where = f"MLflow experiment {experiment!r} at {base_url}"
        self._experiment = experiment
        self._run_name = run_name
        self._job_id = job_id
        self._params = params
        self._tags = {**tags, "grpo.job_id": job_id, "mlflow.runName": run_name}
        self._client = httpx.Client(
            base_url=base_url.rstrip("/"),
            auth=auth,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)),
        )
        self.run_id: str | None = None

    # -- HTTP ---------------------------------------------------------------------------------

    def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        response = self._client.request(method, f"{API}/{path}", **kwargs)
        if response.is_success:
            return response.json() if response.content else {}
        try:
            body = response.json()
            detail = f"{body.get('error_code', '')}: {body.get('message', '')}"[:300]
        except ValueError:
            detail = response.text[:300]
        error = f"{path} answered {response.status_code} {detail}"
        if 400 <= response.status_code < 500 and response.status_code not in (408, 429):
            raise PermanentError(error)
        raise MlflowError(error)

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", path, json=body)

    # -- the run --------------------------------------------------------------------------------

    def _experiment_id(self) -> str:
        try:
            found = self._call(
                "GET", "experiments/get-by-name", params={"experiment_name": self._experiment}
            )
            return str(found["experiment"]["experiment_id"])
        except PermanentError as exc:
            if "RESOURCE_DOES_NOT_EXIST" not in str(exc):
                raise
        try:
            return str(
                self._post("experiments/create", {"name": self._experiment})["experiment_id"]
            )
        except PermanentError as exc:  # created meanwhile by another job
            if "RESOURCE_ALREADY_EXISTS" not in str(exc):
                raise
            return self._experiment_id()

    def _existing_run(self, experiment_id: str) -> str | None:
        found = self._post(
            "runs/search",
            {
                "experiment_ids": [experiment_id],
                "filter": f"tags.`grpo.job_id` = '{self._job_id}'",
                "max_results": 1,
            },
        )
        runs = found.get("runs") or []
        return str(runs[0]["info"]["run_id"]) if runs else None

    def open(self) -> None:
        if self.run_id is not None:
            return
        experiment_id = self._experiment_id()
        run_id = self._existing_run(experiment_id)
        if run_id is None:
            created = self._post(
                "runs/create",
                {
                    "experiment_id": experiment_id,
                    "run_name": self._run_name,
                    "start_time": int(time.time() * 1000),
                    "tags": _tags(self._tags),
                },
            )
            run_id = str(created["run"]["info"]["run_id"])
        else:
            self._post("runs/update", {"run_id": run_id, "status": "RUNNING"})
        items = list(self._params.items())
        for i in range(0, len(items), MAX_PARAMS_PER_CALL):
            chunk = items[i : i + MAX_PARAMS_PER_CALL]
            params = [{"key": k, "value": v} for k, v in chunk]
            self._post("runs/log-batch", {"run_id": run_id, "params": params})
        self.run_id = run_id

    def log_metrics(self, points: list[Point]) -> None:
        for i in range(0, len(points), MAX_METRICS_PER_CALL):
            metrics = [
                {"key": p.key, "value": p.value, "timestamp": p.timestamp_ms, "step": p.step}
                for p in points[i : i + MAX_METRICS_PER_CALL]
            ]
            self._post("runs/log-batch", {"run_id": self.run_id, "metrics": metrics})

    def set_tags(self, tags: dict[str, str]) -> None:
        self._post("runs/log-batch", {"run_id": self.run_id, "tags": _tags(tags)})

    def finish(self, outcome: Outcome) -> None:
        status = _STATUS.get(outcome)
        if status is not None:  # "stopped": the resumed job continues this run
            body = {"run_id": self.run_id, "status": status, "end_time": int(time.time() * 1000)}
            self._post("runs/update", body)

    def close(self) -> None:
        self._client.close()
