"""A claim does not look at sleeping rows (issue #13, scenario 2): its cost stays flat as the queue table fills with
rows due later, on Postgres in the generic plan our sessions use and in a custom one, and on SQLite.

The measure is the work, not the time: shared buffers touched (Postgres, ``EXPLAIN (ANALYZE, BUFFERS)``) and SQLite
virtual-machine instructions, at 1,000 and at 30,000 sleeping rows. ``python -m bench --scenario claims`` prints the
same at up to a million rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from bench.claims import pg_claim_plan, pg_fill, sqlite_claim_cost, sqlite_fill
from celery_workflow._postgres.database import PgDatabase
from celery_workflow.world_sqlite import SQLiteWorld
from tests.integration.pg_fixtures import pg_schema_fixture, pg_url_fixture  # noqa: F401

SMALL, LARGE = 1_000, 30_000


@pytest.fixture
def pg_conn(pg_url: str) -> Iterator[Any]:
    db = PgDatabase.open(pg_url, max_size=1)
    db.migrate()
    db.close()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        yield conn


@pytest.mark.parametrize("generic", [True, False], ids=["generic plan", "custom plan"])
def test_a_postgres_claim_reads_the_same_pages_whatever_sleeps_in_the_queue(pg_conn: Any, generic: bool) -> None:
    pg_fill(pg_conn, SMALL)
    small = pg_claim_plan(pg_conn, generic=generic)
    pg_fill(pg_conn, LARGE - SMALL)
    large = pg_claim_plan(pg_conn, generic=generic)
    assert (small.rows, large.rows) == (SMALL, LARGE)
    assert not [s for s in large.plan if s.startswith("Seq Scan")], large.plan
    assert large.work <= small.work + 8, (small, large)  # an index one level deeper at most, never the table


def test_a_sqlite_claim_runs_the_same_instructions_whatever_sleeps_in_the_queue(tmp_path: Path) -> None:
    world = SQLiteWorld(str(tmp_path / "world.sqlite3"))
    try:
        sqlite_fill(world.store, SMALL)
        small = sqlite_claim_cost(world.store)
        sqlite_fill(world.store, LARGE - SMALL)
        large = sqlite_claim_cost(world.store)
    finally:
        world.close()
    assert (small.rows, large.rows) == (SMALL, LARGE)
    assert all("USING INDEX celery_workflow_queue_due" in step for step in large.plan), large.plan
    assert large.work <= small.work * 1.1 + 50, (small, large)
