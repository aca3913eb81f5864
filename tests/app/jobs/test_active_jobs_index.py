"""The per-project counts taken under the project's lock on every job creation (quota, dispatch
slots) read the partial index of active jobs (ix_jobs_active_project), not every job the project
ever had, and stay exact. On Postgres: the planner's choice is read from EXPLAIN, for the plan of
a prepared statement too (psycopg prepares a statement run often, and a generic plan cannot see
bound values, hence the statuses written into the SQL)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, text

from app.core.db import make_engine, make_session_factory, session_scope
from app.core.models import Job
from app.jobs import slots_repository as slots_repo
from tests.conftest import Api, tiny_spec

INDEX = "ix_jobs_active_project"
JOBS = 600  # 1 in 10 queued, one of those dispatched; the rest ended


@pytest.fixture
def engine(api: Api) -> Iterator[Engine]:
    engine = make_engine(api.settings.resolved_database_url)
    yield engine
    # The database is shared with the tests that follow, whose dispatch sweeps would take
    # these copies for jobs of their own to send.
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM jobs WHERE id LIKE 'job%\\_c%' ESCAPE '\\'"))
    engine.dispose()


def _fill(api: Api, engine: Engine) -> str:
    """JOBS jobs copied from one made through the API, spread over the caller's project and
    four others (as on a shared service), half of them active; returns the caller's project.
    Its share: JOBS / 10 queued copies, one of them dispatched, and JOBS / 10 ended ones."""
    created = api.client.post("/v1/jobs", json=tiny_spec(), headers=api.headers)
    assert created.status_code == 201, created.text
    template = created.json()["id"]
    projects = [api.project_id] + [api.new_key()[1] for _ in range(4)]
    project_of = " ".join(f"WHEN {i} THEN '{p}'" for i, p in enumerate(projects))
    columns = [column.name for column in Job.__table__.columns]
    chosen = {
        "id": "jobs.id || '_c' || g",
        "project_id": f"CASE g % 5 {project_of} END",
        "status": "CASE WHEN g % 2 = 0 THEN 'queued' ELSE 'succeeded' END",
        "dispatched_at": "CASE WHEN g = 10 THEN created_at END",
    }
    select_list = ", ".join(chosen.get(name, name) for name in columns)
    series = (
        f"generate_series(1, {JOBS}) AS s(g)"
        if engine.dialect.name == "postgresql"
        else f"(WITH RECURSIVE s(g) AS (SELECT 1 UNION ALL SELECT g + 1 FROM s WHERE g < {JOBS}) "
        "SELECT g FROM s)"
    )
    with engine.begin() as conn:
        conn.execute(
            text(
                f"INSERT INTO jobs ({', '.join(columns)}) SELECT {select_list} "
                f"FROM jobs, {series} WHERE jobs.id = :template"
            ),
            {"template": template},
        )
        conn.execute(text("ANALYZE jobs"))
    return api.project_id


def _index_names(plan: Any) -> set[str]:
    """Every index a JSON plan (Postgres' EXPLAIN (FORMAT JSON)) reads."""
    found: set[str] = set()
    if isinstance(plan, dict):
        if "Index Name" in plan:
            found.add(str(plan["Index Name"]))
        for value in plan.values():
            found |= _index_names(value)
    elif isinstance(plan, list):
        for value in plan:
            found |= _index_names(value)
    return found


def test_the_counts_are_exact_over_a_long_history(api: Api, engine: Engine) -> None:
    project_id = _fill(api, engine)
    with session_scope(make_session_factory(engine)) as session:
        queue = api.settings.queue_name  # the copies' size class (one device)
        active, dispatched, devices = slots_repo.count_active_and_dispatched(
            session, project_id=project_id, queue=queue
        )
        assert slots_repo.count_active(session, project_id=project_id) == active
        assert (
            slots_repo.count_dispatched(session, project_id=project_id, queue=queue) == dispatched
        )
    # The 60 queued copies and the template (queued: nothing consumes the test's queue); the
    # copy at 10 holds a slot, and so does the template once it was sent.
    assert active == JOBS // 10 + 1
    assert dispatched in (1, 2)
    assert devices == active  # one device each, the ended jobs' not counted


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
def test_the_quota_count_reads_the_active_jobs_index(api: Api, engine: Engine) -> None:
    project_id = _fill(api, engine)
    statement = slots_repo._COUNT_ACTIVE_AND_DISPATCHED.params(
        project_id=project_id, queue=api.settings.queue_name
    )
    compiled = statement.compile(
        dialect=engine.dialect, compile_kwargs={"render_postcompile": True}
    )
    params = dict(compiled.params)
    sql = str(compiled)
    with engine.connect() as conn:
        plan = conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {sql}", params).scalar_one()
        assert INDEX in _index_names(plan)

        # As a prepared statement's generic plan (what a busy connection ends up running): every
        # parameter a $n the planner cannot see.
        names = re.findall(r"%\((\w+)\)s", sql)
        numbered = sql
        for number, name in enumerate(names, start=1):
            numbered = numbered.replace(f"%({name})s", f"${number}", 1)
        conn.exec_driver_sql("SET plan_cache_mode = force_generic_plan")
        conn.exec_driver_sql(f"PREPARE quota_count AS {numbered}".replace("%", "%%"))
        values = ", ".join(f"'{params[name]}'" for name in names)
        generic = conn.exec_driver_sql(
            f"EXPLAIN (FORMAT JSON) EXECUTE quota_count({values})"
        ).scalar_one()
        assert INDEX in _index_names(generic)
        conn.rollback()
