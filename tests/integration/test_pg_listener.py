"""The process's one LISTEN connection hears only the channels it waits on, from the first mark of each, and keeps
them across a reconnection."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from celery_workflow._postgres.database import PgDatabase
from celery_workflow._postgres.listener import (
    ALIVE_LOCK,
    CHANNEL_QUEUE,
    CHANNEL_RUNS,
    CHANNEL_STREAMS,
    Listener,
    notify_sql,
)
from celery_workflow._postgres.queue import PostgresQueue
from celery_workflow.testing._conformance import eventually
from tests.integration.pg_fixtures import (  # noqa: F401
    pg_admin_fixture,
    pg_db_fixture,
    pg_schema_fixture,
    pg_url_fixture,
    terminate_backends,
)

DEADLINE = 10.0


@pytest.fixture
def db(pg_db: PgDatabase) -> PgDatabase:
    return pg_db


def _notify(db: PgDatabase, channel: str, payload: str) -> None:
    db.run(lambda conn: conn.execute(f"SELECT {notify_sql(channel)}", (payload,)), what="notify", transaction=False)


def test_a_process_hears_only_the_channels_it_waits_on(db: PgDatabase) -> None:
    """A client waiting for runs' ends is not woken by every message put on a queue (nor a worker by every run's
    end): the listener takes a channel on with its first mark."""
    listener = db.listener
    assert listener.channels == frozenset()
    assert db.listening_mark(CHANNEL_RUNS, "r") is None  # nobody waits on runs yet: create_run keeps no mark
    ended = listener.mark(CHANNEL_RUNS, "r")
    assert listener.channels == {CHANNEL_RUNS}
    assert db.listening_mark(CHANNEL_RUNS, "r") == ended
    PostgresQueue(db).put("celery", b"for a worker")  # its NOTIFY goes to the queue channel
    _notify(db, CHANNEL_RUNS, "r")
    assert listener.wait(CHANNEL_RUNS, ended, DEADLINE, key="r")  # in commit order: the queue's came first
    assert listener.mark(CHANNEL_QUEUE, "celery")[1] == 0  # never heard
    assert listener.channels == {CHANNEL_RUNS, CHANNEL_QUEUE}


def test_what_a_notification_carries_is_kept_only_for_keys_marked_here(db: PgDatabase) -> None:
    """Every consumer hears every hand-off on its queue channel; it keeps only the messages of its own keys."""
    listener = db.listener
    mine = listener.mark(CHANNEL_QUEUE, "mine")
    _notify(db, CHANNEL_QUEUE, "theirs\na message for another consumer")
    _notify(db, CHANNEL_QUEUE, "mine\na message for this one")
    assert listener.wait(CHANNEL_QUEUE, mine, DEADLINE, key="mine")  # in commit order: theirs was heard first
    assert listener.carried(CHANNEL_QUEUE, "mine") == "a message for this one"
    assert listener.carried(CHANNEL_QUEUE, "theirs") is None
    assert listener.mark(CHANNEL_QUEUE, "theirs")[1] == 1  # counted all the same


def test_a_listener_holds_its_process_alive_lock_while_connected(db: PgDatabase, pg_admin: Any) -> None:
    """The lock a producer checks before handing a message to a standing claim (see test_standing_claims.py)."""
    key = eventually(lambda: db.listener.lock_key, timeout=DEADLINE)
    held = pg_admin.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = %s AND objid = %s AND granted",
        (ALIVE_LOCK, key),
    ).fetchone()
    assert held == (1,)


def test_a_first_mark_returns_once_the_server_listens(db: PgDatabase) -> None:
    """A notification sent right after a channel's first mark is heard: the mark waited for the LISTEN."""
    for n in range(10):
        listener = Listener(db.dial_conninfo)  # a new one each round, so every round's mark is a first one
        try:
            key = f"stream-{n}"
            mark = listener.mark(CHANNEL_STREAMS, key)
            _notify(db, CHANNEL_STREAMS, key)
            assert listener.wait(CHANNEL_STREAMS, mark, DEADLINE, key=key), f"round {n}: the notification was missed"
            assert listener.mark(CHANNEL_STREAMS, key) == (mark[0], mark[1] + 1)  # heard, not a reconnection
        finally:
            listener.close()


def test_a_reconnected_listener_listens_on_its_channels_again(
    db: PgDatabase, pg_admin: psycopg.Connection[Any], pg_schema: str
) -> None:
    listener = db.listener
    before = listener.mark(CHANNEL_QUEUE, "q")
    listener.mark(CHANNEL_RUNS)
    assert terminate_backends(pg_admin, pg_schema) >= 1  # the listener's connection among them
    assert listener.wait(CHANNEL_QUEUE, before, DEADLINE, key="q")  # losing the connection wakes every waiter
    eventually(lambda: listener.channels == {CHANNEL_QUEUE, CHANNEL_RUNS} or None, timeout=DEADLINE)
    mark = listener.mark(CHANNEL_QUEUE, "q")
    _notify(db, CHANNEL_QUEUE, "q")
    assert listener.wait(CHANNEL_QUEUE, mark, DEADLINE, key="q")
    assert listener.mark(CHANNEL_QUEUE, "q") == (mark[0], mark[1] + 1)
