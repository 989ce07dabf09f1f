"""PostgresQueue on a real PostgreSQL: due times, leases, receipts, idempotency, SKIP LOCKED claims, NOTIFY."""

from __future__ import annotations

import multiprocessing
import multiprocessing.synchronize
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from celery_workflow._postgres.database import PgDatabase
from celery_workflow._postgres.listener import CHANNEL_QUEUE, SCHEMA_TAG
from celery_workflow._postgres.queue import PostgresQueue
from celery_workflow.errors import WorldError
from celery_workflow.world import Delivery
from tests.integration.pg_fixtures import (  # noqa: F401
    fresh_schema,
    pg_db_fixture,
    pg_schema_fixture,
    pg_url_fixture,
    schema_url,
)
from tests.integration.queue_suite import Clock, QueueStoreSuite, at, claim_in_processes


@pytest.fixture
def url(pg_url: str) -> str:
    """A URL on a fresh schema of this test's own (``application_name`` is the schema's name)."""
    return pg_url


@pytest.fixture
def db(pg_db: PgDatabase) -> PgDatabase:
    return pg_db


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def queue(db: PgDatabase, clock: Clock) -> PostgresQueue:
    q = PostgresQueue(db)
    q.clock = clock
    return q


def test_insert_delete_for_run_and_delete_claim_join_the_callers_transaction(queue: PostgresQueue) -> None:
    results = queue.db.run(
        lambda conn: queue.insert(conn, [Delivery("a", b"1", run_id="r1"), Delivery("a", b"2", run_id="r2")])
    )
    assert results == [True, True]

    def fail(conn: psycopg.Connection[Any]) -> None:
        queue.insert(conn, [Delivery("a", b"3", run_id="r1")])
        raise RuntimeError("rolled back")

    with pytest.raises(RuntimeError):
        queue.db.run(fail)
    assert len(queue.peek()) == 2
    queue.claim(["a"])  # claimed rows of the run go too
    assert queue.db.run(lambda conn: queue.delete_for_run(conn, "r1")) == 1
    (claim,) = queue.claim(["a"], limit=5)
    assert claim.run_id == "r2"
    queue.db.run(lambda conn: queue.delete_claim(conn, "99.1"))  # stale: nothing happens
    assert len(queue.peek()) == 1
    queue.db.run(lambda conn: queue.delete_claim(conn, claim.receipt))
    assert queue.peek() == []


def test_receipts_and_driver_errors_raise_world_error(queue: PostgresQueue) -> None:
    with pytest.raises(WorldError):
        queue.ack("nonsense")
    queue.db.run(lambda conn: conn.execute("DROP TABLE celery_workflow_queue"))
    with pytest.raises(WorldError) as info:
        queue.enqueue([Delivery("a", b"x")])
    assert isinstance(info.value.__cause__, psycopg.Error)
    with pytest.raises(WorldError):
        queue.claim(["a"])


def test_the_database_clock_is_the_default(db: PgDatabase) -> None:
    queue = PostgresQueue(db)
    before = time.time()
    queue.enqueue([Delivery("a", b"now"), Delivery("a", b"soon", not_before=datetime.now(UTC) + timedelta(hours=1))])
    (claim,) = queue.claim(["a"], lease=30)
    assert claim.payload == b"now"
    row = db.run(
        lambda conn: conn.execute(
            "SELECT EXTRACT(EPOCH FROM max(lease_until) - now())::float8,"
            " EXTRACT(EPOCH FROM max(not_before) - now())::float8 FROM celery_workflow_queue"
        ).fetchone()
    )
    assert row is not None
    lease_left, due_in = row
    assert lease_left == pytest.approx(30, abs=2)
    assert due_in == pytest.approx(3600, abs=2)
    next_due = queue.next_due(["a"])
    assert next_due is not None and next_due == pytest.approx(before + 30, abs=2)  # the lease runs out first


def test_a_claim_skips_rows_locked_by_another_transaction(queue: PostgresQueue, url: str) -> None:
    """SKIP LOCKED: a claimer neither waits for nor takes a row someone else holds a lock on."""
    queue.enqueue([Delivery("a", b"locked", not_before=at(-2)), Delivery("a", b"free", not_before=at(-1))])
    with psycopg.connect(url) as other:
        other.execute("SELECT id FROM celery_workflow_queue WHERE payload = 'locked'::bytea FOR UPDATE")
        started = time.monotonic()
        assert [c.payload for c in queue.claim(["a"], limit=2)] == [b"free"]
        assert time.monotonic() - started < 2
        other.rollback()
    assert [c.payload for c in queue.claim(["a"])] == [b"locked"]


@pytest.mark.parametrize("run_id", ["r1", None], ids=["run key", "queue key"])
def test_a_duplicate_holds_the_pending_row_it_joined_until_its_transaction_ends(
    queue: PostgresQueue, url: str, run_id: str | None
) -> None:
    """A step's result and its run's wake-up are written together; the wake-up joins one already pending. Until that
    transaction commits, the pending delivery must not be claimed: run now, it would replay a log without the
    result, and the wake-up that came with the result would be gone (the run stuck)."""
    queue.enqueue([Delivery("a", b"pending", run_id=run_id, idempotency_key="wake")])
    with psycopg.connect(url, autocommit=True) as writer:
        writer.execute("BEGIN")  # the transaction of a World's append
        assert queue.insert(writer, [Delivery("a", b"joined", run_id=run_id, idempotency_key="wake")]) == [False]
        started = time.monotonic()
        assert queue.claim(["a"]) == []  # skipped, not waited for
        assert time.monotonic() - started < 2
        writer.execute("COMMIT")
    (claim,) = queue.claim(["a"])
    assert claim.payload == b"pending"
    assert queue.enqueue([Delivery("a", b"later", run_id=run_id, idempotency_key="wake")]) == [True]  # claimed: free


# -- notifications -------------------------------------------------------------------------------------------------


def test_notify_is_sent_in_the_inserting_transaction(queue: PostgresQueue, url: str) -> None:
    tag = uuid.uuid4().hex[:8]
    jobs, other, q1, q2 = (f"{name}-{tag}" for name in ("jobs", "other", "q1", "q2"))
    with psycopg.connect(url, autocommit=True) as listener:
        (schema_tag,) = listener.execute(f"SELECT {SCHEMA_TAG}").fetchone() or ("",)
        listener.execute(f'LISTEN "{CHANNEL_QUEUE}_{schema_tag}"')  # this schema's channel

        def heard(expected: int = 0) -> list[str]:
            """This test's next ``expected`` notifications (within 5 s), or those within 0.3 s when none is expected."""
            deadline = time.monotonic() + (5.0 if expected else 0.3)
            got: list[str] = []
            while (left := deadline - time.monotonic()) > 0 and (not expected or len(got) < expected):
                for n in listener.notifies(timeout=left, stop_after=1):
                    key, _, carried = n.payload.partition("\n")
                    if key.endswith(tag):
                        got.append(key)
                        announced.append(carried)
            return got

        announced: list[str] = []  # what each notification carried after the queue's name

        with queue.db.pool.connection() as conn:
            with conn.transaction():
                queue.insert(conn, [Delivery(jobs, b"1"), Delivery(jobs, b"2"), Delivery(other, b"3")])
                assert heard() == []  # not before commit
            assert sorted(heard(2)) == [jobs, other]
            assert heard() == []  # one per queue and transaction
            with pytest.raises(RuntimeError), conn.transaction():
                queue.insert(conn, [Delivery(jobs, b"rolled back")])
                raise RuntimeError
        assert heard() == []
        assert announced == ["", ""]  # inserted together: the queue's name alone
        announced.clear()
        queue.put(jobs, b"4", idempotency_key="k")
        assert heard(1) == [jobs]
        row = max(queue.peek([jobs]), key=lambda m: m.id)
        assert announced == [str(row.id)]  # inserted alone and due: its row id, to be claimed by its key
        queue.put(jobs, b"5", idempotency_key="k")  # deduplicated: nothing new, no notification
        assert heard() == []
        (claim,) = queue.claim([jobs])
        queue.release(claim.receipt)  # claimable again: waiters hear it
        assert heard(1) == [jobs]
        queue.bind("fan", "", None, q1)
        queue.bind("fan", "", None, q2)
        assert queue.put_fanout("fan", b"6") == 2
        assert sorted(heard(2)) == [q1, q2]


def test_waiters_wake_on_their_queues_only(db: PgDatabase) -> None:
    queue = PostgresQueue(db)
    mine, also_mine, elsewhere = (f"{name}-{uuid.uuid4().hex[:8]}" for name in ("mine", "also-mine", "elsewhere"))
    token = queue.change_token([mine])
    queue.put(elsewhere, b"x")
    started = time.monotonic()
    assert queue.wait_for_change(token, 0.5) is False
    assert time.monotonic() - started >= 0.45
    token = queue.change_token([mine, also_mine])
    queue.put(also_mine, b"y")
    started = time.monotonic()
    assert queue.wait_for_change(token, 10) is True
    assert time.monotonic() - started < 5
    token = queue.change_token([mine])
    queue.poke(mine)  # a local wake-up, e.g. after an ack freed prefetch room
    assert queue.wait_for_change(token, 10) is True
    anything = queue.change_token()
    queue.put(elsewhere, b"z")
    assert queue.wait_for_change(anything, 10) is True


def test_two_schemas_of_one_database_never_hear_each_other(db: PgDatabase) -> None:
    """NOTIFY channels are per database: each schema's are tagged, so another app's inserts (in its own schema) wake
    nobody here, and nothing of this schema's queue names or run ids reaches its listeners."""
    queue = PostgresQueue(db)
    with fresh_schema("cw_other") as other_schema:
        other = PgDatabase.open(schema_url(other_schema), max_size=2)
        try:
            other.migrate()
            listener, other_listener = db.listener, other.listener  # both connected before anything is sent
            mine, marker = listener.mark(CHANNEL_QUEUE, "celery"), listener.mark(CHANNEL_QUEUE, "marker")
            theirs_marker, theirs_end = (
                other_listener.mark(CHANNEL_QUEUE, "marker"),
                other_listener.mark(CHANNEL_QUEUE, "end"),
            )
            PostgresQueue(other).put("celery", b"theirs")
            queue.put("celery", b"mine")
            queue.put("marker", b"mine too")
            PostgresQueue(other).put("end", b"theirs, last")
            # a listener hears notifications in commit order: once the last one of its own schema is in, any
            # leaked one would be too
            assert listener.wait(CHANNEL_QUEUE, marker, 10, key="marker")
            assert listener.mark(CHANNEL_QUEUE, "celery")[1] == mine[1] + 1  # its own insert, not theirs
            assert other_listener.wait(CHANNEL_QUEUE, theirs_end, 10, key="end")
            assert other_listener.mark(CHANNEL_QUEUE, "marker")[1] == theirs_marker[1]  # never heard this one
            assert listener.tag != other_listener.tag
        finally:
            other.close()


# -- several processes ---------------------------------------------------------------------------------------------


def _claimer(url: str, start: multiprocessing.synchronize.Event, out: multiprocessing.Queue[list[int]]) -> None:
    db = PgDatabase.open(url, max_size=2)
    q = PostgresQueue(db)
    got: list[int] = []
    start.wait(30)
    idle = 0
    while idle < 3:
        claims = q.claim(["work", "other"], limit=1 + len(got) % 3, lease=60)
        if not claims:
            idle += 1
            continue
        idle = 0
        for c in claims:
            got.append(int(c.payload))
            q.ack(c.receipt)
    db.close()
    out.put(got)


def test_concurrent_claimers_in_several_processes_get_each_row_once(queue: PostgresQueue, url: str) -> None:
    total = 1000
    queue.clock = None
    queue.enqueue([Delivery(("work", "other")[i % 2], str(i).encode()) for i in range(total)])
    results = claim_in_processes(multiprocessing.get_context("spawn"), _claimer, (url,), 6, timeout=120)
    everything = [i for r in results for i in r]
    assert sorted(everything) == list(range(total))  # every row exactly once
    assert sum(1 for r in results if r) >= 3  # the work was actually shared
    assert queue.peek() == []


class TestPostgresQueueStore(QueueStoreSuite):
    """The shared queue-store suite on this store."""
