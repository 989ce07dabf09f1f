"""The schema built by replaying every migration equals the one the code expects, on SQLite and on Postgres.

What the code expects is declared next to the code that reads and writes each table (``TABLES`` of the World's
rows and of the queue, plus the schema version table): columns in order, primary key, and the other indexes with
their uniqueness. Each test applies the packaged migrations one at a time (``migrate(up_to=…)``), checking that the
version table grows with them and that rows written at one version survive the next, then reads the catalog and
compares it with the declaration, both ways: a table, column or index the code does not know fails the test as much
as one it misses.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_workflow._backend.migrations import SCHEMA_VERSION_TABLE, Table, migrations
from celery_workflow._sqlite import queue as sqlite_queue
from celery_workflow._sqlite import rows as sqlite_rows
from celery_workflow._sqlite.database import Database

SQLITE_EXPECTED: dict[str, Table] = {**sqlite_rows.TABLES, **sqlite_queue.TABLES, **SCHEMA_VERSION_TABLE}


def test_every_dialect_ships_numbered_migrations_from_one() -> None:
    for dialect in ("sqlite", "postgres"):
        versions = [m.version for m in migrations(dialect)]
        assert versions == list(range(1, len(versions) + 1)), dialect


# -- SQLite ----------------------------------------------------------------------------------------------------------


def _sqlite_catalog(conn: sqlite3.Connection) -> dict[str, Table]:
    found: dict[str, Table] = {}
    names = [
        r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")
    ]
    for name in names:
        info = conn.execute(f"PRAGMA table_info({name})").fetchall()
        key = tuple(r[1] for r in sorted((r for r in info if r[5]), key=lambda r: r[5]))
        indexes = {
            r[1]: bool(r[2])
            for r in conn.execute(f"PRAGMA index_list({name})")
            if r[3] == "c"  # created, not pk
        }
        found[name] = Table(tuple(r[1] for r in info), key, indexes)
    return found


@pytest.fixture
def sqlite_db(tmp_path: Path) -> Iterator[Database]:
    db = Database(tmp_path / "schema.db", migrate=False)
    yield db
    db.close()


def test_sqlite_migrations_one_by_one_give_the_schema_the_code_expects(sqlite_db: Database) -> None:
    known = migrations("sqlite")
    for migration in known:
        assert sqlite_db.migrate(up_to=migration.version) == migration.version
        conn = sqlite_db.connection()
        versions = [r[0] for r in conn.execute("SELECT version FROM celery_workflow_schema_version ORDER BY version")]
        assert versions == [m.version for m in known if m.version <= migration.version]
        if migration.version == 1:  # a run written at version 1 survives the later migrations
            conn.execute(
                "INSERT INTO celery_workflow_runs (run_id, workflow_name, status, input, event_count, created_at,"
                " updated_at) VALUES ('r', 'wf', 'pending', x'00', 1, 0, 0)"
            )
    conn = sqlite_db.connection()
    assert conn.execute("SELECT run_id FROM celery_workflow_runs").fetchall() == [("r",)]
    assert _sqlite_catalog(conn) == SQLITE_EXPECTED
    assert sqlite_db.migrate() == known[-1].version  # idempotent
    assert conn.execute("PRAGMA foreign_key_check").fetchall() == []


def test_sqlite_listings_and_claims_use_their_indexes(sqlite_db: Database) -> None:
    sqlite_db.migrate()
    conn = sqlite_db.connection()

    def plan(sql: str, *params: Any) -> str:
        return " ".join(str(r[3]) for r in conn.execute(f"EXPLAIN QUERY PLAN {sql}", params))

    assert "celery_workflow_runs_workflow" in plan(
        "SELECT run_id FROM celery_workflow_runs WHERE workflow_name = ? ORDER BY run_id DESC", "wf"
    )
    assert "celery_workflow_queue_due" in plan(
        "SELECT id FROM celery_workflow_queue WHERE queue = ? AND not_before <= ? ORDER BY not_before, id", "q", 0
    )


# -- Postgres --------------------------------------------------------------------------------------------------------


@pytest.fixture
def pg() -> Iterator[tuple[Any, str, Any]]:
    """A Postgres database on a schema of its own, not migrated: (PgDatabase, schema, admin connection)."""
    try:
        from tests.integration import pg_fixtures
    except pytest.skip.Exception as exc:  # the server is unreachable
        pytest.skip(str(exc))
    from celery_workflow._postgres.database import PgDatabase

    with pg_fixtures.fresh_schema("cw_migr") as schema, pg_fixtures.admin_connection() as admin:
        db = PgDatabase.open(pg_fixtures.schema_url(schema), max_size=2)
        try:
            yield db, schema, admin
        finally:
            db.close()


def _pg_catalog(admin: Any, schema: str) -> dict[str, Table]:
    found: dict[str, Table] = {}
    tables = [r[0] for r in admin.execute("SELECT tablename FROM pg_tables WHERE schemaname = %s", (schema,))]
    for name in tables:
        columns = admin.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_schema = %s AND table_name = %s"
            " ORDER BY ordinal_position",
            (schema, name),
        ).fetchall()
        key = admin.execute(
            "SELECT a.attname FROM pg_index AS x JOIN unnest(x.indkey) WITH ORDINALITY AS k(attnum, n) ON true"
            " JOIN pg_attribute AS a ON a.attrelid = x.indrelid AND a.attnum = k.attnum"
            " WHERE x.indrelid = %s::regclass AND x.indisprimary ORDER BY k.n",
            (f'"{schema}".{name}',),
        ).fetchall()
        indexes = admin.execute(
            "SELECT i.relname, x.indisunique FROM pg_index AS x JOIN pg_class AS i ON i.oid = x.indexrelid"
            " WHERE x.indrelid = %s::regclass AND NOT x.indisprimary",
            (f'"{schema}".{name}',),
        ).fetchall()
        found[name] = Table(tuple(r[0] for r in columns), tuple(r[0] for r in key), {n: bool(u) for n, u in indexes})
    return found


def test_postgres_migrations_one_by_one_give_the_schema_the_code_expects(pg: tuple[Any, str, Any]) -> None:
    from celery_workflow._postgres import queue_sql
    from celery_workflow._postgres import rows as pg_rows

    db, schema, admin = pg
    known = migrations("postgres")
    for migration in known:
        assert db.migrate(up_to=migration.version) == migration.version
        versions = admin.execute(f'SELECT version FROM "{schema}".celery_workflow_schema_version ORDER BY version')
        assert [r[0] for r in versions] == [m.version for m in known if m.version <= migration.version]
        if migration.version == 1:  # a run written at version 1 survives the later migrations
            admin.execute(
                f'INSERT INTO "{schema}".celery_workflow_runs (run_id, workflow_name, status, input, event_count,'
                " created_at, updated_at) VALUES ('r', 'wf', 'pending', '\\x00', 1, now(), now())"
            )
    assert admin.execute(f'SELECT run_id FROM "{schema}".celery_workflow_runs').fetchall() == [("r",)]
    expected = {**pg_rows.TABLES, **queue_sql.TABLES, **SCHEMA_VERSION_TABLE}
    assert _pg_catalog(admin, schema) == expected
    assert db.migrate() == known[-1].version  # idempotent


def test_postgres_column_types_and_cascades(pg: tuple[Any, str, Any]) -> None:
    db, schema, admin = pg
    db.migrate()
    for name, column, kind in admin.execute(
        "SELECT table_name, column_name, data_type FROM information_schema.columns WHERE table_schema = %s",
        (schema,),
    ).fetchall():
        if column in ("input", "output", "error", "metadata", "respond_with", "data", "payload"):
            assert kind == "bytea", (name, column)
        if column.endswith("_at") or column in ("retry_after", "resume_at", "not_before", "lease_until", "last_used"):
            assert kind == "timestamp with time zone", (name, column)
    # every foreign key cascades, so deleting a run deletes everything it owns
    actions = admin.execute(
        "SELECT DISTINCT c.confdeltype FROM pg_constraint AS c JOIN pg_namespace AS n ON n.oid = c.connamespace"
        " WHERE n.nspname = %s AND c.contype = 'f'",
        (schema,),
    ).fetchall()
    assert actions == [("c",)]
    with admin.transaction():
        admin.execute(f'SET LOCAL search_path = "{schema}"')
        admin.execute("SET LOCAL enable_seqscan = off")
        plan = " ".join(
            str(r[0])
            for r in admin.execute(
                "EXPLAIN SELECT run_id FROM celery_workflow_runs WHERE workflow_name = 'wf' ORDER BY run_id DESC"
            )
        )
    assert "celery_workflow_runs_workflow" in plan
