"""``list_runs`` on the SQL Worlds: newest first by creation time, whatever the run ids (issue #26, item 18), and
each way of listing (no filter, by workflow, by status; with a cursor or not) is one backward index range, with no
sort, on the index migration 0005 (SQLite) / 0007 (Postgres) made for it. The order itself is held by the
conformance suite (``test_list_runs_is_newest_first_by_creation_whatever_the_run_ids``) on every World."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from psycopg.sql import Literal

from celery_workflow import ids
from celery_workflow._backend.listing import RunFilter, position_of
from celery_workflow._postgres import rows as pg_rows
from celery_workflow._sqlite import rows as sqlite_rows
from celery_workflow._sqlite.database import Database
from celery_workflow.errors import InvalidCursor
from celery_workflow.events import RunStatus
from tests.integration.pg_fixtures import pg_db_fixture, pg_schema_fixture, pg_url_fixture  # noqa: F401

#: A fixed position (1 December 2026): a parameter computed at collection would differ between xdist workers.
CURSOR = "1796083200000000#wrun_x"
#: Each way of listing and the indexes that serve it (a status is common enough that Postgres may rather walk the
#: creation order and filter: a plan without a sort either way).
LISTINGS: list[tuple[dict[str, Any], tuple[str, ...]]] = [
    ({}, ("celery_workflow_runs_created",)),
    ({"workflow": "wf.7"}, ("celery_workflow_runs_workflow",)),
    ({"status": RunStatus.RUNNING}, ("celery_workflow_runs_status", "celery_workflow_runs_created")),
]


@pytest.fixture
def sqlite_db(tmp_path: Path) -> Iterator[Database]:
    db = Database(tmp_path / "listing.db")
    yield db
    db.close()


@pytest.mark.parametrize("cursor", [None, CURSOR])
@pytest.mark.parametrize(("filters", "index"), LISTINGS)
def test_sqlite_lists_through_one_index_without_sorting(
    sqlite_db: Database, filters: dict[str, Any], index: tuple[str, ...], cursor: str | None
) -> None:
    sql, params = RunFilter.of(**filters, cursor=cursor, limit=50).sql(
        sqlite_rows.RUN, "celery_workflow_runs", "?", sqlite_rows.CODEC.store_time
    )
    plan = " | ".join(str(r[3]) for r in sqlite_db.connection().execute(f"EXPLAIN QUERY PLAN {sql}", params))
    assert index[0] in plan and "TEMP B-TREE" not in plan, plan


@pytest.mark.parametrize("cursor", [None, CURSOR])
@pytest.mark.parametrize(("filters", "index"), LISTINGS)
def test_postgres_lists_through_one_index_without_sorting(
    pg_db: Any, filters: dict[str, Any], index: tuple[str, ...], cursor: str | None
) -> None:
    """With 20,000 runs, analysed, and the generic plan the World's sessions use."""
    sql, params = RunFilter.of(**filters, cursor=cursor, limit=50).sql(
        pg_rows.RUN, "celery_workflow_runs", "%s", pg_rows.CODEC.store_time
    )
    with pg_db.pool.connection() as conn:
        conn.execute(
            "INSERT INTO celery_workflow_runs (run_id, workflow_name, status, input, event_count, created_at,"
            " updated_at) SELECT 'wrun_' || i, 'wf.' || (i % 50), (ARRAY['pending', 'running', 'completed'])[i % 3 + 1],"
            " '\\x00', 1, now() - i * interval '1 second', now() FROM generate_series(1, 20000) AS i"
        )
        conn.execute("ANALYZE celery_workflow_runs")
        conn.execute("SET plan_cache_mode = force_generic_plan")
        placeholders = sql.replace("%s", "$%d") % tuple(range(1, len(params) + 1))
        conn.execute(f"PREPARE listing AS {placeholders}")
        values = ", ".join(Literal(str(p)).as_string(conn) for p in params)
        plan = " | ".join(str(r[0]) for r in conn.execute(f"EXPLAIN EXECUTE listing ({values})"))
        conn.execute("DEALLOCATE listing")
    assert any(f"Index Scan Backward using {i} " in plan for i in index) and "Sort" not in plan, plan


def test_a_cursor_is_the_position_of_the_last_run_and_nothing_else_is_one() -> None:
    micros = ids.to_micros(ids.utcnow())
    assert position_of(f"{micros:016d}#run#with#hashes") == (micros, "run#with#hashes")
    for bad in ("wrun_1", "", "123#wrun", f"{micros:016d}#", f"{micros:016d}#\ud800", f"x{micros:015d}#r"):
        with pytest.raises(InvalidCursor):
            position_of(bad)
