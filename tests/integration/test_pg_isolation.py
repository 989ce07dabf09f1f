"""The Postgres World and transport pin READ COMMITTED, whatever the session's default isolation (issue #27, item 9).

Migrations after ``pg_advisory_xact_lock``, locked reads and token claims rely on each statement seeing what was
committed before it. A DBA may set ``default_transaction_isolation`` (``ALTER ROLE``/``ALTER DATABASE ... SET``, or
``options=-c default_transaction_isolation=...`` in the connection string, as here: scoped to the test's own
connections). Every test runs with the server's default and with the stricter ones, on pools the World opens and on a
caller's pool, which keeps its own session settings.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from celery_workflow import ids
from celery_workflow._backend.migrations import migrations
from celery_workflow._postgres.database import PgDatabase
from celery_workflow._postgres.script import Script, query
from celery_workflow.events import EventType, NewEvent
from celery_workflow.transport.postgres import broker_database
from celery_workflow.world import NewRun
from celery_workflow.world_pg import PostgresWorld
from tests.integration.pg_fixtures import (  # noqa: F401
    DATABASE_URL,
    pg_admin_fixture,
    pg_schema_fixture,
)

DEADLINE = 60.0
LEVELS = ["read committed", "repeatable read", "serializable"]


@pytest.fixture(name="level", params=LEVELS)
def level_fixture(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(name="iso_url")
def iso_url_fixture(pg_schema: str, level: str) -> str:
    """A URL on the test's schema whose sessions default to ``level`` (libpq ``options``: these connections only)."""
    escaped = level.replace(" ", "\\ ")
    options = quote(f"-csearch_path={pg_schema} -cdefault_transaction_isolation={escaped}", safe="")
    sep = "&" if "?" in DATABASE_URL else "?"
    return f"{DATABASE_URL}{sep}options={options}&application_name={pg_schema}"


@pytest.fixture(name="callers_pool")
def callers_pool_fixture(iso_url: str) -> Iterator[ConnectionPool]:
    with ConnectionPool(iso_url, min_size=1, max_size=16, open=True) as pool:
        yield pool


def _isolation(conn: psycopg.Connection[Any]) -> str:
    return str(query(conn, "SELECT current_setting('transaction_isolation')").one()[0])


def _seen_by(db: PgDatabase) -> dict[str, str]:
    """The isolation of each kind of transaction a PgDatabase runs."""

    def script(conn: psycopg.Connection[Any]) -> str:
        s = Script(conn)
        s.begin()
        seen = s.add("SELECT current_setting('transaction_isolation')")
        s.add("COMMIT")
        return str(s.send()[seen].one()[0])

    def statement(conn: psycopg.Connection[Any]) -> str:
        row = conn.execute("SELECT current_setting('transaction_isolation')").fetchone()
        assert row is not None
        return str(row[0])

    return {
        "transaction": db.run(statement),
        "implicit script": db.run(_isolation, transaction=False),
        "script with BEGIN": db.run(script, transaction=False),
    }


def test_the_session_default_is_what_the_test_says(iso_url: str, level: str) -> None:
    with psycopg.connect(iso_url, autocommit=True) as conn:
        row = conn.execute("SELECT current_setting('transaction_isolation')").fetchone()
        assert row is not None and row[0] == level


def test_every_transaction_runs_in_read_committed(iso_url: str, level: str, callers_pool: ConnectionPool) -> None:
    world = PostgresWorld.open(iso_url)
    on_callers = PostgresWorld(callers_pool)
    transport = broker_database(iso_url)
    try:
        for db in (world.db, on_callers.db, transport):
            assert _seen_by(db) == dict.fromkeys(_seen_by(db), "read committed")
        # a whole run's read keeps its own REPEATABLE READ snapshot
        run_id = ids.new_run_id()
        world.create_run(NewRun(run_id, "wf", {"args": [], "kwargs": {}}))
        assert world.get_run_with_events(run_id)[0].run_id == run_id
    finally:
        transport.close()
        on_callers.close()
        world.close()
    # the caller's connections keep their own default and attributes
    with callers_pool.connection() as conn:
        assert conn.isolation_level is None
        row = conn.execute("SELECT current_setting('default_transaction_isolation')").fetchone()
        assert row is not None and row[0] == level


def _together(count: int, fn: Callable[[int], object]) -> list[object]:
    """``fn(0..count-1)`` in threads released together; each one's result or exception."""
    results: list[object] = [None] * count
    barrier = threading.Barrier(count)

    def one(i: int) -> None:
        barrier.wait(DEADLINE)
        try:
            results[i] = fn(i)
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE)
    assert not any(t.is_alive() for t in threads)
    return results


@pytest.mark.parametrize("pooled", [False, True], ids=["own pool", "caller's pool"])
def test_worlds_opening_together_migrate_once(
    iso_url: str, pg_schema: str, pg_admin: Any, callers_pool: ConnectionPool, pooled: bool
) -> None:
    def open_one(i: int) -> None:
        world = PostgresWorld(callers_pool) if pooled and i % 2 else PostgresWorld.open(iso_url)
        world.close()

    assert _together(4, open_one) == [None] * 4
    rows = pg_admin.execute(f'SELECT version FROM "{pg_schema}".celery_workflow_schema_version').fetchall()
    assert sorted(r[0] for r in rows) == [m.version for m in migrations("postgres")]


@pytest.mark.parametrize("pooled", [False, True], ids=["own pool", "caller's pool"])
def test_twelve_claimants_of_a_free_token_have_one_winner(
    iso_url: str, callers_pool: ConnectionPool, pooled: bool
) -> None:
    world = PostgresWorld(callers_pool) if pooled else PostgresWorld.open(iso_url, concurrency=12)
    try:
        token = f"tok_{ids.ulid()}"
        runs = []
        for _ in range(12):
            run_id = ids.new_run_id()
            world.create_run(NewRun(run_id, "wf", {"args": [], "kwargs": {}}))
            world.append(run_id, [NewEvent(EventType.RUN_STARTED)])
            runs.append(run_id)

        def claim(i: int) -> str:
            (event,) = world.append(runs[i], [NewEvent(EventType.HOOK_CREATED, "h", {"token": token})]).events
            return event.event_type.value

        outcome = _together(len(runs), claim)
        assert sorted(map(str, outcome)) == ["hook_conflict"] * (len(runs) - 1) + ["hook_created"], outcome
    finally:
        world.close()
