"""The chaos run's clients: one thread submits the jobs on a seeded schedule (and cancels a
few), another polls the API all along and records how long each answer took, a third sends
chat completions to the inference tier (bench.chaos_inference). All go through the public HTTP
API, retrying as a real client would while a fault makes it unavailable. The jobs are a seeded
mix of kinds (bench.chaos_jobs)."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import httpx

from bench.chaos_cluster import Cluster
from bench.chaos_inference import InferenceTraffic
from bench.chaos_jobs import job_spec, plan_kinds, steps_for
from bench.load_client import percentile

PROJECTS = 3
TERMINAL = ("succeeded", "failed", "cancelled")
POLL_INTERVAL_S = 0.25


class Traffic:
    def __init__(
        self,
        cluster: Cluster,
        rng: random.Random,
        *,
        jobs: int,
        steps: int,
        window_s: float,
        cancels: int,
        mix: str = "all",
    ) -> None:
        self.cluster = cluster
        self.rng = rng
        self.kinds = plan_kinds(jobs, rng, mix)  # by submission order
        self.jobs = jobs
        self.steps = steps
        self.window_s = window_s
        self.cancels = cancels
        self.keys: list[str] = []
        self.job_ids: list[str] = []
        self.owner: dict[str, int] = {}  # job id -> project index
        self.kind_of: dict[str, str] = {}  # job id -> kind
        self.inference: InferenceTraffic | None = None
        self.cancelled: set[str] = set()
        self.errors: list[str] = []  # refused submissions
        self.samples: list[tuple[str, str, int, float]] = []  # phase, kind, status, seconds
        self.phase = "window"
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        self.keys = [self.cluster.new_key(f"chaos-{p}") for p in range(PROJECTS)]
        # A fifth of the jobs at once, the rest over the first 60% of the fault window, so
        # that faults keep landing on running jobs; cancels at random points of the window.
        head = max(1, self.jobs // 5)
        times = [0.0] * head + sorted(
            self.rng.uniform(0, 0.6 * self.window_s) for _ in range(self.jobs - head)
        )
        plan: list[tuple[float, str, int]] = [(t, "submit", i) for i, t in enumerate(times)]
        plan += [
            (self.rng.uniform(0.2, 0.9) * self.window_s, "cancel", c) for c in range(self.cancels)
        ]
        plan.sort()
        inference_seed = self.rng.random()  # drawn before the threads share the generator
        for target in (self._submit_all, self._poll):
            thread = threading.Thread(target=target, args=(plan,), daemon=True)
            thread.start()
            self._threads.append(thread)
        if self.cluster.inference_enabled:
            self.inference = InferenceTraffic(
                self.cluster.api_url,
                random.Random(inference_seed),
                self.keys,
                self.owner,
                self.kind_of,
                self._succeeded,
            )
            self.inference.start()

    def _succeeded(self) -> list[str]:
        """The jobs that succeeded, in submission order."""
        rows = self.cluster.rows("SELECT id FROM jobs WHERE status = 'succeeded'")
        done = {str(r["id"]) for r in rows}
        return [j for j in list(self.job_ids) if j in done]

    def mark(self, phase: str) -> None:
        self.phase = phase
        if self.inference is not None:
            self.inference.phase = phase

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=15)
        if self.inference is not None:
            self.inference.stop()

    # ---- submitting and cancelling ---------------------------------------------------------

    def _headers(self, project: int) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[project]}"}

    def _until_answered(
        self, client: httpx.Client, method: str, path: str, project: int, **kw: Any
    ) -> httpx.Response | None:
        """Send until the API answers something other than 5xx/429 (it may be restarting
        its database); None once the run is stopping."""
        headers = {**self._headers(project), **kw.pop("headers", {})}
        while not self._stop.is_set():
            try:
                response = client.request(method, path, headers=headers, **kw)
                if response.status_code < 500 and response.status_code != 429:
                    return response
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        return None

    def _submit_all(self, plan: list[tuple[float, str, int]]) -> None:
        t0 = time.monotonic()
        with httpx.Client(base_url=self.cluster.api_url, timeout=30) as client:
            for at, action, index in plan:
                while time.monotonic() - t0 < at:
                    if self._stop.wait(0.2):
                        return
                if action == "submit":
                    self._submit(client, index)
                else:
                    self._cancel_one(client)

    def _submit(self, client: httpx.Client, index: int) -> None:
        project = index % PROJECTS
        kind = self.kinds[index]
        steps = steps_for(kind, self.steps, self.rng)
        response = self._until_answered(
            client,
            "POST",
            "/v1/jobs",
            project,
            json=job_spec(index, steps, kind),
            # A retry after a lost answer must not create a second job.
            headers={"Idempotency-Key": f"chaos-{index}"},
        )
        if response is None:
            return
        if response.status_code != 201:  # the job count check then fails the run
            self.errors.append(f"job {index}: {response.status_code} {response.text[:300]}")
            return
        job_id = str(response.json()["id"])
        self.kind_of[job_id] = kind
        self.owner[job_id] = project
        self.job_ids.append(job_id)

    def _cancel_one(self, client: httpx.Client) -> None:
        """Cancel a job that has not finished (queued or running), if there is one."""
        try:
            active = {
                str(r["id"])
                for r in self.cluster.rows(
                    "SELECT id FROM jobs WHERE status IN ('queued', 'running')"
                )
            }
        except Exception:  # the database may be down: try any job not cancelled yet
            active = set(self.job_ids)
        candidates = sorted(j for j in self.job_ids if j in active and j not in self.cancelled)
        self.rng.shuffle(candidates)
        for job_id in candidates[:8]:
            response = self._until_answered(
                client, "POST", f"/v1/jobs/{job_id}/cancel", self.owner[job_id]
            )
            if response is None:
                return
            if response.status_code == 200 and response.json()["status"] in (
                "cancelling",
                "cancelled",
            ):
                self.cancelled.add(job_id)
                return

    # ---- polling -----------------------------------------------------------------------------

    def _poll(self, _plan: object) -> None:
        with httpx.Client(base_url=self.cluster.api_url, timeout=10) as client:
            turn = 0
            while not self._stop.wait(POLL_INTERVAL_S):
                turn += 1
                own = [j for j, p in list(self.owner.items()) if p == 0]
                if turn % 2 and own:
                    kind, path = "get", f"/v1/jobs/{self.rng.choice(own)}"
                else:
                    kind, path = "list", "/v1/jobs?limit=20"
                started = time.perf_counter()
                try:
                    status = client.get(path, headers=self._headers(0)).status_code
                except httpx.HTTPError:
                    status = 0
                self.samples.append((self.phase, kind, status, time.perf_counter() - started))

    def latency_summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for phase in ("window", "drain"):
            rows = [s for s in self.samples if s[0] == phase]
            ok = [s[3] * 1000 for s in rows if 200 <= s[2] < 300]
            by_status: dict[str, int] = {}
            for row in rows:
                by_status[str(row[2])] = by_status.get(str(row[2]), 0) + 1
            out[phase] = {
                "requests": len(rows),
                "by_status": by_status,
                "ok_latency_ms": {
                    q: round(v, 1) if (v := percentile(ok, p)) is not None else None
                    for q, p in (("p50", 50), ("p95", 95), ("p99", 99), ("max", 100))
                },
            }
        return out

    # ---- the end -------------------------------------------------------------------------------

    def wait_all_finished(self, timeout_s: float) -> bool:
        """True once every job was submitted and has ended, within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if len(self.job_ids) == self.jobs:
                try:
                    rows = self.cluster.rows("SELECT status FROM jobs")
                except Exception:  # the database may still be coming back
                    rows = []
                if len(rows) == self.jobs and all(r["status"] in TERMINAL for r in rows):
                    return True
            time.sleep(2.0)
        return False
