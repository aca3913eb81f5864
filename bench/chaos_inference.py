"""The chaos run's inference client: one thread sends chat completions through the API's
gateway (`POST /v1/chat/completions`) all along, to the base model and to the models of jobs
that succeeded, and records each answer's status and latency, as the API poll does.

Targets, drawn by a seeded generator: the base model (any project may call it); the `ft:` name
of a LoRA job that succeeded (an adapter over the warm base engine); and one full fine-tune (the
first job of another kind seen succeeded, pinned for the run: each full checkpoint is an engine
of its own, ~1.3 GB and a minute of CPU to start, which a 2-core machine cannot afford for
every job). A job's model is asked for with its owner's key (models resolve per project).

What an answer may be: 200; 429 or 503 with `Retry-After` (the tier says when to come back:
an engine starting, the budget held, no inference process registered, the database down).
Anything else is a violation: a 500, a 502 or 504, a 503 without `Retry-After`, a 4xx (a
succeeded job's model is never a 404). A request the API does not answer within the timeout
is recorded as status 0 and reported, like the API poll's.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from bench.chaos_jobs import TINY
from bench.load_client import percentile

INTERVAL_S = 1.0
TIMEOUT_S = 60.0
REFRESH_S = 5.0
MAX_BACKOFF_S = 3.0  # honour Retry-After, but keep sampling the tier
TARGET_WEIGHTS = {"base": 0.4, "lora": 0.35, "full": 0.25}
PROMPT = [{"role": "user", "content": "What is 3 + 4?"}]


def fine_tuned_name(job_id: str) -> str:
    """A native job's `ft:` name (app.fine_tuning.names: no OpenAI model, no suffix)."""
    return f"ft:{TINY}::{job_id}"


def acceptable(status: int, retry_after: bool) -> bool:
    return status == 200 or (status in (429, 503) and retry_after)


class InferenceTraffic:
    def __init__(
        self,
        api_url: str,
        rng: random.Random,
        keys: list[str],
        owner: Mapping[str, int],
        kind_of: Mapping[str, str],
        succeeded: Callable[[], list[str]],
    ) -> None:
        self.api_url = api_url
        self.rng = rng
        self.keys = keys
        self.owner = owner  # job id -> project index (filled as jobs are submitted)
        self.kind_of = kind_of  # job id -> kind
        self._succeeded = succeeded  # the ids of the jobs that succeeded (may raise)
        self.phase = "window"
        # phase, target, status, seconds, Retry-After given, seconds since start
        self.samples: list[tuple[str, str, int, float, bool, float]] = []
        self.bad: list[dict[str, Any]] = []  # the answers that are violations (first 50)
        self.violations = 0
        self.pinned_full: str | None = None
        self._done: list[str] = []
        self._refreshed = 0.0
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=TIMEOUT_S + 5)

    # ---- what to ask --------------------------------------------------------------------------

    def _refresh(self) -> None:
        if time.monotonic() - self._refreshed < REFRESH_S:
            return
        try:
            done = self._succeeded()
        except Exception:  # the database may be down: keep the last list
            return
        self._refreshed = time.monotonic()
        self._done = [j for j in done if j in self.owner]
        if self.pinned_full is None:
            full = [j for j in self._done if self.kind_of.get(j) not in (None, "lora")]
            if full:
                self.pinned_full = full[0]

    def _target(self) -> tuple[str, str, int]:
        """(target kind, model name, project index)."""
        lora = [j for j in self._done if self.kind_of.get(j) == "lora"]
        choices = {"base": True, "lora": bool(lora), "full": self.pinned_full is not None}
        kinds = [k for k in TARGET_WEIGHTS if choices[k]]
        kind = self.rng.choices(kinds, [TARGET_WEIGHTS[k] for k in kinds])[0]
        if kind == "lora":
            job = self.rng.choice(lora)
            return kind, fine_tuned_name(job), self.owner[job]
        if kind == "full":
            assert self.pinned_full is not None
            return kind, fine_tuned_name(self.pinned_full), self.owner[self.pinned_full]
        return kind, TINY, self.rng.randrange(len(self.keys))

    # ---- asking -------------------------------------------------------------------------------

    def ask(self, client: httpx.Client, kind: str, model: str, project: int) -> tuple[int, bool]:
        """One chat completion; (status, Retry-After given), recorded."""
        body = {"model": model, "messages": PROMPT, "max_tokens": 8, "temperature": 0}
        headers = {"Authorization": f"Bearer {self.keys[project]}"}
        started = time.perf_counter()
        retry_after, detail = False, ""
        try:
            response = client.post("/v1/chat/completions", json=body, headers=headers)
            status = response.status_code
            retry_after = response.headers.get("Retry-After", "").isdigit()
            detail = response.text[:300]
        except httpx.HTTPError as exc:
            status, detail = 0, repr(exc)[:300]
        seconds = time.perf_counter() - started
        at = round(time.monotonic() - self._t0, 1)
        self.samples.append((self.phase, kind, status, seconds, retry_after, at))
        if status != 0 and not acceptable(status, retry_after):
            self.violations += 1
            if len(self.bad) < 50:
                self.bad.append(
                    {"t": at, "phase": self.phase, "target": kind, "model": model,
                     "status": status, "retry_after": retry_after, "body": detail}
                )  # fmt: skip
        return status, retry_after

    def _run(self) -> None:
        with httpx.Client(base_url=self.api_url, timeout=TIMEOUT_S) as client:
            while not self._stop.is_set():
                self._refresh()
                kind, model, project = self._target()
                status, retry_after = self.ask(client, kind, model, project)
                wait = INTERVAL_S
                if retry_after and status in (429, 503):
                    wait = max(wait, min(MAX_BACKOFF_S, self.rng.uniform(1.0, MAX_BACKOFF_S)))
                if self._stop.wait(wait):
                    return

    def recovered(self, timeout_s: float) -> dict[str, float | None]:
        """After the run (the thread stopped): seconds until each target kind that had a model
        answered 200 again (None: not within `timeout_s`). The check that the tier came back
        from its last fault, as the drain is for the jobs."""
        self.phase = "recovery"
        self._refreshed = 0.0
        self._refresh()
        out: dict[str, float | None] = {}
        started = time.monotonic()
        with httpx.Client(base_url=self.api_url, timeout=TIMEOUT_S) as client:
            for kind in TARGET_WEIGHTS:
                lora = [j for j in self._done if self.kind_of.get(j) == "lora"]
                if kind == "lora" and not lora:
                    continue
                if kind == "full" and self.pinned_full is None:
                    continue
                job = lora[0] if kind == "lora" else self.pinned_full
                model = TINY if kind == "base" else fine_tuned_name(str(job))
                project = 0 if kind == "base" else self.owner[str(job)]
                out[kind] = None
                while time.monotonic() - started < timeout_s:
                    status, _ = self.ask(client, kind, model, project)
                    if status == 200:
                        out[kind] = round(time.monotonic() - started, 1)
                        break
                    time.sleep(2.0)
        return out

    # ---- the report ---------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for phase in ("window", "drain", "recovery"):
            rows = [s for s in self.samples if s[0] == phase]
            ok = [s[3] * 1000 for s in rows if s[2] == 200]
            by_status: dict[str, int] = {}
            by_target: dict[str, dict[str, int]] = {}
            for _, target, status, _, retry_after, _ in rows:
                name = str(status) if status in (0, 200) or retry_after else f"{status}_no_retry"
                by_status[name] = by_status.get(name, 0) + 1
                counts = by_target.setdefault(target, {})
                counts[name] = counts.get(name, 0) + 1
            out[phase] = {
                "requests": len(rows),
                "by_status": by_status,
                "by_target": by_target,
                "ok_latency_ms": {
                    q: round(v, 1) if (v := percentile(ok, p)) is not None else None
                    for q, p in (("p50", 50), ("p95", 95), ("p99", 99), ("max", 100))
                },
            }
        out["violations"] = self.violations
        out["bad_answers"] = self.bad
        out["pinned_full_job"] = self.pinned_full
        return out
