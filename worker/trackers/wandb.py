"""Weights & Biases, through the ``wandb`` package (imported only when a job exports to it).

The mode (online or offline), the API key and the host are the worker's (GRPO_WANDB_*), never
the job's. The run id is derived from the job id and resumed with ``resume="allow"``, so a
resumed job continues its run. wandb buffers and retries on its own (in its service process);
this client only turns its calls into the exporter's protocol.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from worker.trackers.exporter import Outcome, Point


def run_id_of(job_id: str) -> str:
    """The W&B run id of a job: its id, in W&B's run id alphabet."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", job_id)[:64]


class WandbTracker:
    kind = "wandb"

    def __init__(
        self,
        *,
        project: str,
        entity: str | None,
        name: str,
        tags: list[str],
        job_id: str,
        params: dict[str, str],
        mode: str,
        root_dir: Path,
        api_key: str | None = None,
        base_url: str | None = None,
    ) -> None:
        self.where = f"W&B project {project!r}" + (f" of {entity!r}" if entity else "")
        self._init: dict[str, Any] = {
            "project": project,
            "entity": entity,
            "name": name,
            "tags": tags,
            "id": run_id_of(job_id),
            "config": params,
            "resume": "allow",
            "reinit": "create_new",  # one process may hold several jobs' runs in tests
            "dir": str(root_dir),
        }
        self._settings: dict[str, Any] = {
            "mode": mode,
            "root_dir": str(root_dir),
            "silent": True,
            "console": "off",
            "save_code": False,
            "disable_git": True,
            "x_disable_stats": True,
            "x_disable_machine_info": True,
            "x_save_requirements": False,
        }
        if api_key:
            self._settings["api_key"] = api_key
        if base_url:
            self._settings["base_url"] = base_url
        self._root_dir = root_dir
        self.run: Any = None

    def open(self) -> None:
        if self.run is not None:
            return
        import wandb  # only on a worker that exports a job to W&B

        self._root_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(**self._init, settings=wandb.Settings(**self._settings))

    def log_metrics(self, points: list[Point]) -> None:
        steps: dict[int, dict[str, float]] = defaultdict(dict)
        for p in points:
            steps[p.step][p.key] = p.value
        for step in sorted(steps):
            self.run.log(steps[step], step=step)

    def set_tags(self, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self.run.summary[key] = value

    def finish(self, outcome: Outcome) -> None:
        # A stopped job resumes this run (same id) in its next attempt.
        self.run.finish(exit_code=1 if outcome == "failed" else 0)

    def close(self) -> None:
        pass
