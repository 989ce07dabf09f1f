"""SQLiteQueue on real SQLite files: due times, leases, receipts, idempotency, backoff, multi-process claims."""

from __future__ import annotations

import multiprocessing
import sqlite3
from pathlib import Path

import pytest

from celery_workflow._backend.broker import parse_receipt
from celery_workflow._sqlite.queue import SQLiteQueue  # the type of SQLiteWorld.store
from celery_workflow.errors import WorldError
from celery_workflow.world import Delivery
from celery_workflow.world_sqlite import SQLiteWorld
from tests.integration.queue_suite import Clock, QueueStoreSuite, claim_in_processes


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def queue(tmp_path: Path, clock: Clock) -> SQLiteQueue:
    q = SQLiteWorld(tmp_path / "queue.db").store
    q.clock = clock
    return q


def test_insert_and_delete_for_run_join_the_callers_transaction(queue: SQLiteQueue) -> None:
    with queue.db.transaction() as conn:
        assert queue.insert(conn, [Delivery("a", b"1", run_id="r1"), Delivery("a", b"2", run_id="r2")]) == [True, True]
    with pytest.raises(RuntimeError), queue.db.transaction() as conn:
        queue.insert(conn, [Delivery("a", b"3", run_id="r1")])
        raise RuntimeError("rolled back")
    assert len(queue.peek()) == 2
    queue.claim(["a"])  # claimed rows of the run go too
    with queue.db.transaction() as conn:
        assert queue.delete_for_run(conn, "r1") == 1
    assert [c.run_id for c in queue.claim(["a"], limit=5)] == ["r2"]


def test_receipts_and_driver_errors_raise_world_error(queue: SQLiteQueue) -> None:
    assert parse_receipt("12.3") == (12, 3)
    with pytest.raises(WorldError):
        queue.ack("nonsense")
    queue.db.connection().execute("DROP TABLE celery_workflow_queue")
    with pytest.raises(WorldError) as info:
        queue.enqueue([Delivery("a", b"x")])
    assert isinstance(info.value.__cause__, sqlite3.Error)
    with pytest.raises(WorldError):
        queue.claim(["a"])


# -- several processes ---------------------------------------------------------------------------------------------


def _claimer(path: str, start: multiprocessing.synchronize.Event, out: multiprocessing.Queue[list[int]]) -> None:
    q = SQLiteWorld(path, migrate=False).store
    got: list[int] = []
    start.wait(30)
    idle = 0
    while idle < 3:
        claims = q.claim(["work"], limit=1 + len(got) % 3, lease=60)
        if not claims:
            idle += 1
            continue
        idle = 0
        for c in claims:
            got.append(int(c.payload))
            q.ack(c.receipt)
    out.put(got)


def test_concurrent_claimers_in_several_processes_get_each_row_once(tmp_path: Path) -> None:
    path = str(tmp_path / "queue.db")
    q = SQLiteWorld(path).store
    total = 400
    q.enqueue([Delivery("work", str(i).encode()) for i in range(total)])
    results = claim_in_processes(multiprocessing.get_context("fork"), _claimer, (path,), 4, timeout=60)
    everything = [i for r in results for i in r]
    assert sorted(everything) == list(range(total))  # every row exactly once
    assert sum(1 for r in results if r) >= 2  # the work was actually shared
    assert q.peek() == []


class TestSQLiteQueueStore(QueueStoreSuite):
    """The shared queue-store suite on this store."""
