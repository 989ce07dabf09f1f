"""SQLiteQueue on real SQLite files: due times, leases, receipts, idempotency, backoff, multi-process claims."""

from __future__ import annotations

import multiprocessing
import sqlite3
from datetime import UTC, datetime
from pathlib import Path

import pytest

from celery_workflow._sqlite import Database
from celery_workflow.errors import WorldError
from celery_workflow.sqlite_queue import SQLiteQueue, parse_receipt
from celery_workflow.transport.base import backoff
from celery_workflow.world import Delivery

T0 = 1_800_000_000.0


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def at(offset: float) -> datetime:
    return datetime.fromtimestamp(T0 + offset, UTC)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def queue(tmp_path: Path, clock: Clock) -> SQLiteQueue:
    q = SQLiteQueue(Database(tmp_path / "queue.db"))
    q.clock = clock
    return q


def rows(q: SQLiteQueue) -> list[tuple[object, ...]]:
    conn = q.db.connection()
    sql = "SELECT id, queue, attempts, lease_until, idempotency_key FROM celery_workflow_queue ORDER BY id"
    return [tuple(r) for r in conn.execute(sql).fetchall()]


def test_claims_oldest_due_first_across_queues(queue: SQLiteQueue) -> None:
    queue.enqueue(
        [
            Delivery("a", b"third", not_before=at(-1)),
            Delivery("b", b"first", not_before=at(-30)),
            Delivery("a", b"second", not_before=at(-20)),
            Delivery("c", b"other queue", not_before=at(-100)),
        ]
    )
    claimed = queue.claim(["a", "b"], limit=10)
    assert [c.payload for c in claimed] == [b"first", b"second", b"third"]
    assert [c.attempts for c in claimed] == [1, 1, 1]
    assert queue.claim(["a", "b"], limit=10) == []
    assert [c.payload for c in queue.claim(["c"])] == [b"other queue"]


def test_limit_takes_only_the_oldest(queue: SQLiteQueue) -> None:
    queue.enqueue([Delivery("a", str(i).encode(), not_before=at(-10 + i)) for i in range(5)])
    assert [c.payload for c in queue.claim(["a"], limit=2)] == [b"0", b"1"]
    assert [c.payload for c in queue.claim(["a"], limit=2)] == [b"2", b"3"]


def test_rows_not_yet_due_are_invisible(queue: SQLiteQueue, clock: Clock) -> None:
    queue.enqueue([Delivery("a", b"later", not_before=at(60))])
    assert queue.claim(["a"]) == []
    assert queue.next_due(["a"]) == pytest.approx(T0 + 60)
    clock.advance(59.9)
    assert queue.claim(["a"]) == []
    clock.advance(0.1)
    assert [c.payload for c in queue.claim(["a"])] == [b"later"]


def test_a_lease_hides_the_row_until_it_runs_out(queue: SQLiteQueue, clock: Clock) -> None:
    queue.enqueue([Delivery("a", b"x", run_id="wrun_1")])
    (first,) = queue.claim(["a"], lease=30)
    assert first.run_id == "wrun_1"
    clock.advance(29)
    assert queue.claim(["a"]) == []
    assert queue.next_due(["a"]) == pytest.approx(T0 + 30)
    clock.advance(1)
    (second,) = queue.claim(["a"], lease=30)
    assert second.attempts == 2
    assert second.receipt != first.receipt


def test_a_stale_receipt_cannot_touch_a_reclaimed_row(queue: SQLiteQueue, clock: Clock) -> None:
    queue.enqueue([Delivery("a", b"x")])
    (stale,) = queue.claim(["a"], lease=10)
    clock.advance(11)
    (fresh,) = queue.claim(["a"], lease=10)
    queue.ack(stale.receipt)
    queue.extend([stale.receipt], 1000)
    queue.release(stale.receipt)
    queue.retry_later(stale.receipt, 0)
    assert len(rows(queue)) == 1
    clock.advance(9)
    assert queue.claim(["a"]) == []  # the fresh lease is untouched (not released, not extended)
    queue.ack(fresh.receipt)
    assert rows(queue) == []


def test_release_ends_the_claim(queue: SQLiteQueue) -> None:
    queue.enqueue([Delivery("a", b"x")])
    (claim,) = queue.claim(["a"])
    queue.release(claim.receipt)
    queue.ack(claim.receipt)  # the released claim is over: its receipt deletes nothing
    (again,) = queue.claim(["a"])
    assert again.attempts == 2


def test_idempotency_key_dedups_while_pending_and_is_released_by_the_claim(queue: SQLiteQueue) -> None:
    assert queue.enqueue([Delivery("a", b"1", run_id="r1", idempotency_key="k")]) == [True]
    assert queue.enqueue([Delivery("a", b"2", run_id="r1", idempotency_key="k")]) == [False]
    assert queue.enqueue([Delivery("b", b"2b", run_id="r1", idempotency_key="k")]) == [False]  # scope: the run
    assert queue.enqueue([Delivery("a", b"3", run_id="r2", idempotency_key="k")]) == [True]
    assert queue.enqueue([Delivery("a", b"4", idempotency_key="k"), Delivery("a", b"5", idempotency_key="k")]) == [
        True,
        False,
    ]
    assert queue.enqueue([Delivery("b", b"6", idempotency_key="k")]) == [True]  # no run: scope is the queue
    assert queue.enqueue([Delivery("a", b"7", run_id="r1"), Delivery("a", b"8", run_id="r1")]) == [True, True]

    claimed = queue.claim(["a"], limit=1)
    assert [c.payload for c in claimed] == [b"1"]
    assert queue.enqueue([Delivery("a", b"9", run_id="r1", idempotency_key="k")]) == [True]  # key released
    assert queue.enqueue([Delivery("a", b"10", run_id="r1", idempotency_key="k")]) == [False]


def test_insert_and_delete_for_run_join_the_callers_transaction(queue: SQLiteQueue) -> None:
    with queue.db.transaction() as conn:
        assert queue.insert(conn, [Delivery("a", b"1", run_id="r1"), Delivery("a", b"2", run_id="r2")]) == [True, True]
    with pytest.raises(RuntimeError), queue.db.transaction() as conn:
        queue.insert(conn, [Delivery("a", b"3", run_id="r1")])
        raise RuntimeError("rolled back")
    assert len(rows(queue)) == 2
    queue.claim(["a"])  # claimed rows of the run go too
    with queue.db.transaction() as conn:
        assert queue.delete_for_run(conn, "r1") == 1
    assert [c.run_id for c in queue.claim(["a"], limit=5)] == ["r2"]


def test_retry_later_backs_off(queue: SQLiteQueue, clock: Clock) -> None:
    assert [backoff(n) for n in (1, 2, 3, 4, 9, 10, 50, 10_000)] == [1, 2, 4, 8, 256, 300, 300, 300]
    queue.enqueue([Delivery("a", b"x")])
    for attempt in (1, 2, 3):
        (claim,) = queue.claim(["a"])
        assert claim.attempts == attempt
        queue.retry_later(claim.receipt, backoff(claim.attempts))
        clock.advance(backoff(attempt) - 0.01)
        assert queue.claim(["a"]) == []
        clock.advance(0.01)
    assert queue.claim(["a"])[0].attempts == 4


def test_extend_pushes_the_lease(queue: SQLiteQueue, clock: Clock) -> None:
    queue.enqueue([Delivery("a", b"x"), Delivery("a", b"y")])
    a, b = queue.claim(["a"], limit=2, lease=10)
    clock.advance(8)
    queue.extend([a.receipt, b.receipt], 10)
    clock.advance(9)  # 17 s after the claim, 9 s after the extension
    assert queue.claim(["a"]) == []
    clock.advance(1)
    assert {c.payload for c in queue.claim(["a"], limit=5)} == {b"x", b"y"}


def test_size_purge_and_message_ttl(queue: SQLiteQueue, clock: Clock) -> None:
    queue.declare_queue("events", auto_delete=True, message_ttl=5)
    queue.put("events", b"old")
    queue.put("plain", b"p")
    assert queue.size("events") == 1
    clock.advance(5)
    assert queue.size("events") == 0
    assert queue.claim(["events"]) == []
    assert queue.gc()["messages"] == 1
    assert queue.size("plain") == 1
    queue.claim(["plain"])
    queue.put("plain", b"q")
    assert queue.purge("plain") == 1  # the claimed row stays with its holder
    assert len(rows(queue)) == 1


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
    q = SQLiteQueue(Database(path, migrate=False))
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
    q = SQLiteQueue(Database(path))
    total = 400
    q.enqueue([Delivery("work", str(i).encode()) for i in range(total)])
    ctx = multiprocessing.get_context("fork")
    start = ctx.Event()
    out: multiprocessing.Queue[list[int]] = ctx.Queue()
    procs = [ctx.Process(target=_claimer, args=(path, start, out)) for _ in range(4)]
    for p in procs:
        p.start()
    try:
        start.set()
        results = [out.get(timeout=60) for _ in procs]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    everything = [i for r in results for i in r]
    assert sorted(everything) == list(range(total))  # every row exactly once
    assert sum(1 for r in results if r) >= 2  # the work was actually shared
    assert rows(q) == []
