"""The Postgres World's scripts (``celery_workflow._postgres.script``): statements sent at once through libpq's
pipeline mode, with the World's own prepared statements.

On a real server: placeholders (positional, named, ``%%``), rows and row counts, errors raised as psycopg's typed
errors with the rest of the script skipped, implicit transactions (all or nothing without ``BEGIN``), transactions
spanning two sends, and prepared statements that survive what psycopg itself does to a connection (its rollback
deallocates every statement of a connection when it holds prepared statements of its own) or a pool's
``DISCARD ALL``.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from psycopg import errors as pg_errors

from celery_workflow._postgres.database import PgDatabase
from celery_workflow._postgres.script import Script, commit_setting
from tests.integration.pg_fixtures import pg_schema_fixture, pg_url_fixture  # noqa: F401


@pytest.fixture(name="conn")
def conn_fixture(pg_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (k int PRIMARY KEY, v text, b bytea, at timestamptz)")
        yield conn


def count(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM t").fetchone()
    assert row is not None
    return int(row[0])


def test_placeholders_rows_and_counts(conn: psycopg.Connection[Any]) -> None:
    at = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    script = Script(conn)
    script.add("INSERT INTO t VALUES (%s, %s, %s, %s), (%s, %s, %s, %s)", (1, "a", b"\x00\xff", at, 2, "b%", None, at))
    script.add("UPDATE t SET v = v || '%%' WHERE k = %(key)s AND v <> %(key)s::text", {"key": 1, "unused": 0})
    script.add("SELECT k, v, b, at FROM t WHERE k = ANY(%s) ORDER BY k", ([1, 2, 3],))
    script.add("SELECT 1 WHERE false")
    inserted, updated, selected, empty = script.send()
    assert (inserted.rowcount, updated.rowcount, selected.rowcount) == (2, 1, 2)
    assert selected.rows == [(1, "a%", b"\x00\xff", at), (2, "b%", None, at)]
    assert empty.rows == [] and empty.one() is None
    assert script.send() == []  # nothing queued: no round trip


@pytest.mark.parametrize("size", [10, 200_000], ids=["sent whole", "sent while answers are read"])
def test_large_and_small_scripts_answer_alike(conn: psycopg.Connection[Any], size: int) -> None:
    """A small script goes out in one write before any answer is read; a large one (parameters past the socket
    buffers) is sent while the answers are read, so neither side waits for the other with a full buffer."""
    blob = bytes(range(256)) * (size // 256 + 1)
    script = Script(conn)
    for k in range(5):
        script.add("INSERT INTO t (k, b) VALUES (%s, %s)", (k, blob[: size + k]))
    script.add("SELECT k, length(b) FROM t ORDER BY k")
    script.add("SELECT b FROM t ORDER BY k")  # answers as large as the script: both buffers fill
    *inserts, lengths, blobs = script.send()
    assert [r.rowcount for r in inserts] == [1] * 5
    assert lengths.rows == [(k, size + k) for k in range(5)]
    assert [bytes(b) for (b,) in blobs.rows] == [blob[: size + k] for k in range(5)]


def test_an_error_is_typed_and_skips_the_rest_of_an_implicit_transaction(conn: psycopg.Connection[Any]) -> None:
    script = Script(conn)
    script.add("INSERT INTO t (k) VALUES (%s)", (1,))
    script.add("INSERT INTO t (k) VALUES (%s)", (1,))
    script.add("INSERT INTO t (k) VALUES (%s)", (2,))
    with pytest.raises(pg_errors.UniqueViolation):
        script.send()
    assert count(conn) == 0  # without BEGIN the script is one implicit transaction: nothing of it stays
    again = Script(conn)
    again.add("INSERT INTO t (k) VALUES (%s)", (3,))
    assert again.send()[0].rowcount == 1  # the connection goes on, its prepared statements too
    assert count(conn) == 1


def test_a_transaction_may_span_two_sends(conn: psycopg.Connection[Any]) -> None:
    script = Script(conn)
    script.begin(synchronous_commit=False)
    script.add("INSERT INTO t (k) VALUES (%s)", (1,))
    script.add("SELECT current_setting('synchronous_commit')")
    assert script.send()[-1].rows == [("off",)]
    assert conn.info.transaction_status is psycopg.pq.TransactionStatus.INTRANS
    script.add("INSERT INTO t (k) VALUES (%s)", (2,))
    script.add("COMMIT")
    script.send()
    assert count(conn) == 2


def test_commit_setting_lasts_to_the_commit_of_an_implicit_transaction(conn: psycopg.Connection[Any]) -> None:
    conn.execute("SET synchronous_commit = off")
    script = Script(conn)
    script.add(*commit_setting(True))
    check = script.add("SELECT current_setting('synchronous_commit')")
    assert script.send()[check].rows == [("on",)]
    row = conn.execute("SELECT current_setting('synchronous_commit')").fetchone()
    assert row == ("off",)  # local to that transaction


def test_statements_deallocated_under_a_script_are_prepared_again(conn: psycopg.Connection[Any]) -> None:
    script = Script(conn)
    script.add("INSERT INTO t (k) VALUES (%s)", (1,))
    script.send()
    # what psycopg runs after rolling back a transaction while it holds prepared statements of its own, and what a
    # pool's reset may run
    conn.execute("DEALLOCATE ALL")
    script.add("INSERT INTO t (k) VALUES (%s)", (2,))
    with pytest.raises(pg_errors.InvalidSqlStatementName):
        script.send()  # the server lost them: the script says so, and forgets them
    script.add("INSERT INTO t (k) VALUES (%s)", (2,))
    assert script.send()[0].rowcount == 1  # prepared again


def test_a_database_retries_a_call_whose_statements_were_deallocated(pg_url: str) -> None:
    db = PgDatabase(url=pg_url, max_size=1)
    try:
        db.run(lambda c: c.execute("CREATE TABLE IF NOT EXISTS t (k int PRIMARY KEY)"), transaction=False)

        def insert(key: int) -> int:
            def fn(conn: psycopg.Connection[Any]) -> int:
                script = Script(conn)
                script.add("INSERT INTO t (k) VALUES (%s)", (key,))
                return script.send()[0].rowcount

            return db.run(fn, what="insert", transaction=False)

        assert insert(1) == 1
        db.run(lambda c: c.execute("DISCARD ALL"), transaction=False)  # a pool's reset, say
        assert insert(2) == 1  # retried once with the statement prepared again
        # the World's own sessions leave preparing to scripts, so psycopg's rollback deallocates nothing of theirs
        assert db.run(lambda c: c.prepare_threshold, transaction=False) is None
    finally:
        db.close()


def test_bad_parameters_are_refused_before_anything_is_sent(conn: psycopg.Connection[Any]) -> None:
    script = Script(conn)
    script.add("SELECT %s, %(name)s", {"name": 1})
    with pytest.raises(TypeError, match="cannot mix"):
        script.send()
    script.add("SELECT %(name)s", (1,))
    with pytest.raises(TypeError, match="mapping"):
        script.send()
    script.add("SELECT %s", {"name": 1})
    with pytest.raises(TypeError, match="sequence"):
        script.send()
