"""GET /v1/jobs/{id}/metrics on a long job: the database builds the windows from rollups, the
answer matches what the pre-rollup Python downsampler gave (kept below as the reference), every
read is bounded, and raw reads page. Not timed: bench/metrics_read.py measures speed."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from app.core.clock import utcnow
from app.core.db import make_engine, make_session_factory, session_scope
from app.core.models import JobMetric, JobMetricRollup
from app.progress import metrics as metrics_service
from app.progress import metrics_repository as metrics_repo
from app.progress import repository as progress_repo
from grpo_cli import db as migrations
from grpo_cli import gates
from grpo_cli.client import Client
from tests.conftest import Api, create_pg_database, drop_pg_database, tiny_spec

STEPS = 20_000
DENSE = ["entropy", "grad_norm", "loss/policy", "reward/mean"]  # a finite value at every step
SPARSE = ["eval/accuracy", "kl"]  # every 250th step; null (non-finite) at every 97th step
Rows = list[tuple[int, dict[str, float | None]]]


def make_rows(seed: int = 7) -> Rows:
    rng = random.Random(seed)
    rows: Rows = []
    for step in range(1, STEPS + 1):
        values: dict[str, float | None] = {
            "reward/mean": rng.random(),
            "loss/policy": rng.gauss(0, 1),
            "entropy": rng.uniform(0, 2),
            "grad_norm": 1e6 if step == 12_345 else rng.uniform(0, 10),
            "kl": None if step % 97 == 0 else rng.random() / 100,
        }
        if step % 250 == 0:
            values["eval/accuracy"] = rng.random()
        rows.append((step, values))
    return rows


# --- the reference: app/progress/metrics.py before rollups, verbatim but for the row type ----


def old_series(rows: Rows, names: list[str], max_points: int | None) -> dict[str, list[Any]]:
    out = {}
    for name in names:
        points = [
            (step, float(v))
            for step, values in rows
            if (v := values.get(name)) is not None and math.isfinite(float(v))
        ]
        out[name] = _old_downsample(points, max_points)
    return out


def _old_downsample(points: list[tuple[int, float]], max_points: int | None) -> list[Any]:
    if not points:
        return []
    size = 1 if not max_points else math.ceil(len(points) / max_points)
    buckets = [points[i : i + size] for i in range(0, len(points), size)]
    return [
        {
            "step": bucket[-1][0],
            "value": sum(v for _, v in bucket) / len(bucket),
            "min": min(v for _, v in bucket),
            "max": max(v for _, v in bucket),
            "count": len(bucket),
        }
        for bucket in buckets
    ]


def window_series(
    rows: Rows, names: list[str], lo: int, hi: int, width: int
) -> dict[str, list[Any]]:
    """The documented windows: the old bucket statistics over the finite values of steps
    (k-1)*width < step <= k*width, clipped to lo..hi."""
    out = {}
    for name in names:
        windows: dict[int, list[tuple[int, float]]] = {}
        for step, values in rows:
            v = values.get(name)
            if lo <= step <= hi and v is not None:
                windows.setdefault(-(-step // width), []).append((step, v))
        out[name] = [_old_downsample(w, 1)[0] for _, w in sorted(windows.items())]
    return out


def assert_same(got: dict[str, list[Any]], expected: dict[str, list[Any]]) -> None:
    assert list(got) == list(expected)
    for name, points in expected.items():
        assert len(got[name]) == len(points), name
        for g, e in zip(got[name], points, strict=True):
            assert (g["step"], g["count"], g["min"], g["max"]) == (
                e["step"],
                e["count"],
                e["min"],
                e["max"],
            ), name
            assert g["value"] == pytest.approx(e["value"], rel=1e-9, abs=1e-12), name


# --- one long job per backend, shared by the tests of this module ----------------------------


@dataclass
class LongJob:
    job_id: str
    headers: dict[str, str]
    rows: Rows

    @property
    def url(self) -> str:
        return f"/v1/jobs/{self.job_id}/metrics"


_JOBS: dict[str, LongJob] = {}


def _sessions(api: Api) -> Iterator[Any]:
    engine = make_engine(api.settings.resolved_database_url)
    try:
        yield make_session_factory(engine)
    finally:
        engine.dispose()


@pytest.fixture
def long_job(api: Api) -> LongJob:
    """A job with 20,000 steps, inserted with the bulk repository insert (once per backend)."""
    url = api.settings.resolved_database_url
    if url not in _JOBS:
        job_id = api.client.post("/v1/jobs", json=tiny_spec(), headers=api.headers).json()["id"]
        rows = make_rows()
        for sessions in _sessions(api):
            with session_scope(sessions) as session:
                added = metrics_repo.add_many(
                    session, job_id=job_id, attempt=1, points=rows, now=utcnow()
                )
        assert added == STEPS
        _JOBS[url] = LongJob(job_id, dict(api.headers), rows)
    return _JOBS[url]


def test_downsampled_reads_equal_the_old_downsampler(api: Api, long_job: LongJob) -> None:
    # Dense series over the whole job: when steps / max_points is a whole number of rollup
    # blocks (or below the smallest), the windows are exactly the old buckets.
    for max_points, width in ((10_000, 2), (5_000, 4), (2_500, 8), (1_250, 16), (625, 32)):
        body = api.client.get(
            long_job.url,
            params={"names": DENSE, "max_points": max_points},
            headers=long_job.headers,
        ).json()
        assert body["bucket_steps"] == width
        assert body["steps"] == STEPS and body["next_step_from"] is None
        assert_same(body["series"], old_series(long_job.rows, DENSE, max_points))
    # The spike survives any zoom level.
    body = api.client.get(
        long_job.url, params={"names": "grad_norm", "max_points": 3}, headers=long_job.headers
    ).json()
    assert max(p["max"] for p in body["series"]["grad_norm"]) == 1e6


@pytest.mark.parametrize(
    ("step_from", "step_to", "max_points"),
    [
        (None, None, 500),
        (None, None, 7),
        (1, 1, 500),
        (3, 19_998, 500),
        (4_001, 4_999, 100),
        (101, 13_337, 1),
        (9_999, 10_003, 2),
        (None, 2_000, 1_999),
        (17, 6_000, 333),
    ],
)
def test_any_range_and_width_matches_the_documented_windows(
    api: Api, long_job: LongJob, step_from: int | None, step_to: int | None, max_points: int
) -> None:
    names = DENSE + SPARSE + ["never/recorded"]
    params: dict[str, Any] = {"names": names, "max_points": max_points}
    if step_from is not None:
        params["step_from"] = step_from
    if step_to is not None:
        params["step_to"] = step_to
    body = api.client.get(long_job.url, params=params, headers=long_job.headers).json()
    lo, hi = step_from or 1, step_to or STEPS
    width = body["bucket_steps"]
    assert body["steps"] == hi - lo + 1
    for name, points in body["series"].items():
        assert len(points) <= max_points, name
    if max_points == 1:  # one window for the whole range
        assert width == hi - lo + 1
        expected = {
            n: [_old_downsample(p, 1)[0]] if p else []
            for n, p in _points(long_job, names, lo, hi).items()
        }
    else:
        assert width >= math.ceil((hi - lo + 1) / max_points)
        assert width < 4 or any(width % level == 0 for level in metrics_repo.ROLLUP_LEVELS)
        expected = window_series(long_job.rows, names, lo, hi, width)
    assert_same(body["series"], expected)
    assert body["series"]["never/recorded"] == []


def _points(job: LongJob, names: list[str], lo: int, hi: int) -> dict[str, list[Any]]:
    return {
        n: [(s, v[n]) for s, v in job.rows if lo <= s <= hi and v.get(n) is not None] for n in names
    }


def test_a_read_touches_and_returns_a_bounded_number_of_rows(api: Api, long_job: LongJob) -> None:
    for sessions in _sessions(api):
        with session_scope(sessions) as session:
            for max_points in (1, 2, 37, 500, 10_000):
                plan = metrics_service.plan(1, STEPS, max_points)
                blocks = sum(hi - lo + 1 for _, lo, hi in plan.runs)
                singles = sum(hi - lo + 1 for lo, hi in plan.raw)
                # rollup blocks read: under 4 per point asked, plus a few at each edge
                assert blocks <= 4 * max_points + 2 * 3 * len(metrics_repo.ROLLUP_LEVELS)
                assert singles <= max(6, 4 * max_points)
                found = metrics_repo.windows(
                    session,
                    job_id=long_job.job_id,
                    wanted=DENSE + SPARSE,
                    runs=plan.runs,
                    raw=plan.raw,
                    width=plan.width,
                )
                assert set(found) == {*DENSE, *SPARSE, metrics_repo.STEPS}
                assert all(len(rows) <= max_points for rows in found.values())
            available = metrics_repo.names(session, job_id=long_job.job_id)
    assert available == sorted(DENSE + SPARSE)


def test_raw_reads_page_by_step(api: Api, long_job: LongJob) -> None:
    seen: dict[str, list[Any]] = {n: [] for n in DENSE + SPARSE}
    step_from: int | None = None
    pages = 0
    while True:
        params: dict[str, Any] = {"limit": 7_000}
        if step_from is not None:
            params["step_from"] = step_from
        body = api.client.get(long_job.url, params=params, headers=long_job.headers).json()
        pages += 1
        assert body["bucket_steps"] == 1
        assert body["steps"] == STEPS - (step_from or 1) + 1  # the whole requested range
        assert body["available"] == sorted(DENSE + SPARSE)
        for name, points in body["series"].items():
            seen[name] += points
        step_from = body["next_step_from"]
        if step_from is None:
            break
    assert pages == 3
    assert_same(seen, old_series(long_job.rows, DENSE + SPARSE, None))
    # a bounded range, the default page size
    body = api.client.get(
        long_job.url,
        params={"names": "kl", "step_from": 90, "step_to": 200},
        headers=long_job.headers,
    ).json()
    assert [p["step"] for p in body["series"]["kl"]] == [s for s in range(90, 201) if s % 97]
    assert body["next_step_from"] is None
    first = api.client.get(long_job.url, headers=long_job.headers).json()
    assert first["next_step_from"] == 1_001 and len(first["series"]["entropy"]) == 1_000


def test_the_cli_client_follows_pages_for_gates_and_csv(api: Api, long_job: LongJob) -> None:
    client = Client("http://testserver", "unused")
    client._http.close()
    client._http = api.client  # type: ignore[assignment]  # the same requests, in process
    api.client.headers.update(long_job.headers)
    body = client.metrics(long_job.job_id, names=["kl", "eval/accuracy"])
    assert_same(body["series"], old_series(long_job.rows, ["kl", "eval/accuracy"], None))
    final = gates.final_values(body["series"])
    assert final["kl"].step == STEPS and final["eval/accuracy"].step == STEPS
    assert final["kl"].value == long_job.rows[-1][1]["kl"]


def test_bad_names_and_limits_are_422(api: Api, long_job: LongJob) -> None:
    for params, param in (
        ({"names": "a\x00b"}, "names"),
        ({"names": "x" * 201}, "names"),
        ({"limit": 10_001}, "limit"),
        ({"max_points": 0}, "max_points"),
    ):
        response = api.client.get(long_job.url, params=params, headers=long_job.headers)
        assert response.status_code == 422, params
        assert response.json()["error"]["param"] == param


def test_a_repeated_step_counts_once(api: Api) -> None:
    job_id = api.client.post("/v1/jobs", json=tiny_spec(), headers=api.headers).json()["id"]
    for sessions in _sessions(api):
        for _ in range(2):  # a resumed attempt repeats step 5
            with session_scope(sessions) as session:
                progress_repo.add_metrics_once(
                    session, job_id=job_id, step=5, attempt=1, values={"kl": 2.0}, now=utcnow()
                )
    body = api.client.get(
        f"/v1/jobs/{job_id}/metrics", params={"max_points": 1}, headers=api.headers
    ).json()
    assert body["steps"] == 1
    assert body["series"]["kl"] == [{"step": 5, "value": 2.0, "min": 2.0, "max": 2.0, "count": 1}]
    # The rollups too (a read of one step is served from the rows, so check them directly):
    # Postgres reports rowcount -1 for INSERT ... ON CONFLICT DO NOTHING, which once read as
    # "inserted" and counted the repeated step twice.
    for sessions in _sessions(api):
        with session_scope(sessions) as session:
            query = select(JobMetricRollup.count).where(JobMetricRollup.job_id == job_id)
            counts = list(session.scalars(query))
    assert counts and set(counts) == {1}


@pytest.mark.parametrize("backend_name", ["postgres", "sqlite"])
def test_the_migration_backfills_rollups_of_existing_rows(
    backend_name: str, tmp_path: Path
) -> None:
    """Rows stored before the rollups existed get the same rollups the write path makes."""
    if backend_name == "postgres":
        name, url = create_pg_database("grpo_backfill")
    else:
        name, url = "", f"sqlite:///{tmp_path / 'b.db'}"
    try:
        migrations.upgrade(url, "0001")
        rows = make_rows()[:700]
        rows[3][1]["a very long name " * 20] = 1.0  # over MAX_NAME_CHARS: kept out of rollups
        engine = make_engine(url)
        with engine.begin() as conn:  # the schema of revision 0001, in plain SQL
            conn.exec_driver_sql(
                "INSERT INTO projects (id, name, created_at) "
                "VALUES ('proj_b', 'backfill', CURRENT_TIMESTAMP)"
            )
            conn.exec_driver_sql(
                "INSERT INTO jobs (id, project_id, spec, status, queue, attempt, max_attempts, "
                "created_at, updated_at, current_step, total_steps, run_started_step) "
                "VALUES ('job_b', 'proj_b', '{}', 'running', 'q', 1, 3, "
                "CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, 0, 700, 0)"
            )
            conn.execute(
                JobMetric.__table__.insert(),  # type: ignore[attr-defined]
                [
                    {
                        "job_id": "job_b",
                        "step": s,
                        "attempt": 1,
                        "values": v,
                        "created_at": utcnow(),
                    }
                    for s, v in rows
                ],
            )
        migrations.upgrade(url)
        with session_scope(make_session_factory(engine)) as session:
            stored = {
                (r.level, r.name, r.block): [r.count, r.total, r.min, r.max, r.last_step]
                for r in session.scalars(select(JobMetricRollup))
            }
        engine.dispose()
        expected = metrics_repo.rollups_of(rows)
        assert stored.keys() == expected.keys()
        for key, (count, total, low, high, last) in expected.items():
            got = stored[key]
            assert (got[0], got[2], got[3], got[4]) == (count, low, high, last), key
            assert got[1] == pytest.approx(total, rel=1e-9, abs=1e-12), key
    finally:
        if name:
            drop_pg_database(name)
