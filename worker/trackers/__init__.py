"""Export a job's run to the experiment trackers its spec names (``integrations``).

:func:`start_exports` builds one :class:`~worker.trackers.exporter.Exporter` per integration
the worker accepts (the operator's rule, checked again here), each with its own thread;
:class:`Exports` is what the database callbacks and the runner hold: steps go in after the
database stored them, reports of what was not exported come out as job events, and
:meth:`Exports.close` ends every run with one bounded wait.

- ``exporter``: one tracker export: a bounded queue and the thread that sends it in batches;
- ``mlflow``: an MLflow tracking server, through its REST API;
- ``wandb``: Weights & Biases, through the ``wandb`` package;
- ``params``: a job's resolved spec as flat tracker params.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import httpx

from jobspec import JobSpec, MlflowIntegration, WandbIntegration
from jobspec.integrations import normalized_uri
from worker.settings import WorkerSettings
from worker.trackers.exporter import Exporter, Outcome, Report, Tracker
from worker.trackers.mlflow import MlflowTracker
from worker.trackers.params import flatten_spec
from worker.trackers.wandb import WandbTracker

__all__ = ["Exports", "Outcome", "Report", "start_exports"]


class Exports:
    """The exporters of one job attempt (possibly none)."""

    def __init__(self, exporters: Iterable[Exporter] = (), refused: Iterable[Report] = ()) -> None:
        self.exporters = list(exporters)
        self._reports = list(refused)

    @property
    def idle(self) -> bool:
        """No exporter and nothing to report: a job without integrations."""
        return not self.exporters and not self._reports

    def add_step(self, step: int, values: dict[str, float | None]) -> None:
        for exporter in self.exporters:
            exporter.add_step(step, values)

    def take_reports(self) -> list[Report]:
        """What was not exported since the last call (refusals first)."""
        reports, self._reports = self._reports, []
        reports.extend(r for e in self.exporters if (r := e.take_report()) is not None)
        return reports

    def close(self, tags: dict[str, str], outcome: Outcome, timeout: float) -> list[Report]:
        """End every run (in parallel: each exporter has its own thread) within ``timeout``
        seconds in all; what was not exported."""
        deadline = time.monotonic() + timeout
        for exporter in self.exporters:
            exporter.request_close(tags, outcome, timeout)
        reports, self._reports = self._reports, []
        for exporter in self.exporters:
            report = exporter.wait_closed(max(0.0, deadline - time.monotonic()))
            if report is not None:
                reports.append(report)
        return reports


def _mlflow_auth(settings: WorkerSettings) -> tuple[httpx.Auth | None, dict[str, str]]:
    if settings.mlflow_tracking_token is not None:
        token = settings.mlflow_tracking_token.get_secret_value()
        return None, {"Authorization": f"Bearer {token}"}
    if settings.mlflow_tracking_username and settings.mlflow_tracking_password is not None:
        password = settings.mlflow_tracking_password.get_secret_value()
        return httpx.BasicAuth(settings.mlflow_tracking_username, password), {}
    return None, {}


def _tracker(
    integration: MlflowIntegration | WandbIntegration,
    *,
    job_id: str,
    params: dict[str, str],
    settings: WorkerSettings,
) -> Tracker:
    if isinstance(integration, MlflowIntegration):
        uri = integration.tracking_uri
        auth, headers = _mlflow_auth(settings)
        return MlflowTracker(
            base_url=normalized_uri(uri) if uri else settings.mlflow_tracking_uri_list[0],
            experiment=integration.experiment,
            run_name=integration.run_name or job_id,
            job_id=job_id,
            params=params,
            tags=integration.tags,
            auth=auth,
            headers=headers,
        )
    key = settings.wandb_api_key
    return WandbTracker(
        project=integration.project,
        entity=integration.entity,
        name=integration.name or job_id,
        tags=integration.tags,
        job_id=job_id,
        params=params,
        mode=settings.wandb_mode,
        root_dir=settings.resolved_wandb_dir,
        api_key=key.get_secret_value() if key is not None else None,
        base_url=settings.wandb_base_url,
    )


def start_exports(job_id: str, stored_spec: dict[str, Any], settings: WorkerSettings) -> Exports:
    """Start an exporter for each integration of the job's stored (resolved) spec that this
    worker accepts; a refused one becomes a report. No integrations: an empty Exports."""
    spec = JobSpec.model_validate(stored_spec)
    if not spec.integrations:
        return Exports()
    params = flatten_spec(stored_spec)
    exporters: list[Exporter] = []
    refused: list[Report] = []
    for i, integration in enumerate(spec.integrations):
        refusal = settings.integration_refusal(integration)
        if refusal is not None:  # the API allowed it; this worker's settings differ
            field, message = refusal
            data: dict[str, object] = {"tracker": integration.type, "integration": i}
            refused.append(Report(integration.type, f"integrations[{i}]{field}: {message}", data))
            continue
        tracker = _tracker(integration, job_id=job_id, params=params, settings=settings)
        exporters.append(
            Exporter(
                tracker,
                queue_size=settings.tracker_queue_size,
                batch_seconds=settings.tracker_batch_seconds,
                retry_seconds=settings.tracker_retry_seconds,
            )
        )
    return Exports(exporters, refused)
