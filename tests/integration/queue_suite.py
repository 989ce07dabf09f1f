"""What every queue store does (SQLiteQueue, PostgresQueue): due times, leases, receipts, idempotency, backoff, TTL.

A test module subclasses :class:`QueueStoreSuite` and provides the ``clock`` fixture (a :class:`Clock`) and the
``queue`` fixture (a store whose ``clock`` is it). The suite talks to the store through its API only (``peek`` shows
what is stored), so both stores run it unchanged, and a third one would too.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from multiprocessing.context import BaseContext
from typing import Any

import pytest

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


def claim_in_processes(
    ctx: BaseContext, claimer: Callable[..., None], args: tuple[Any, ...], processes: int, timeout: float
) -> list[list[int]]:
    """Run ``claimer(*args, start, out)`` in ``processes`` processes released at once; what each one claimed."""
    start = ctx.Event()
    out: Any = ctx.Queue()
    procs = [ctx.Process(target=claimer, args=(*args, start, out)) for _ in range(processes)]  # type: ignore[attr-defined]
    for p in procs:
        p.start()
    try:
        start.set()
        return [out.get(timeout=timeout) for _ in procs]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


class QueueStoreSuite:
    """The store-level behaviour of the queue both transports and Worlds rely on."""

    #: Whether the store answers ``delayed`` (the SQL stores do; the Redis store does not yet).
    lists_delayed = True

    def test_claims_oldest_due_first_across_queues(self, queue: Any) -> None:
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

    def test_limit_takes_only_the_oldest_even_across_queues(self, queue: Any) -> None:
        queue.enqueue([Delivery("ab"[i % 2], str(i).encode(), not_before=at(-10 + i)) for i in range(6)])
        assert [c.payload for c in queue.claim(["a", "b"], limit=2)] == [b"0", b"1"]
        assert [c.payload for c in queue.claim(["b", "a"], limit=3)] == [b"2", b"3", b"4"]
        assert [c.payload for c in queue.claim(["a", "b", "a"], limit=3)] == [b"5"]
        assert queue.peek()[0].idempotency_key is None

    def test_rows_not_yet_due_are_invisible(self, queue: Any, clock: Clock) -> None:
        queue.enqueue([Delivery("a", b"later", not_before=at(60))])
        assert queue.claim(["a"]) == []
        assert queue.next_due(["a"]) == pytest.approx(T0 + 60)
        clock.advance(59.9)
        assert queue.claim(["a"]) == []
        clock.advance(0.1)
        assert [c.payload for c in queue.claim(["a"])] == [b"later"]

    def test_a_lease_hides_the_row_until_it_runs_out(self, queue: Any, clock: Clock) -> None:
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

    def test_a_stale_receipt_cannot_touch_a_reclaimed_row(self, queue: Any, clock: Clock) -> None:
        queue.enqueue([Delivery("a", b"x")])
        (stale,) = queue.claim(["a"], lease=10)
        clock.advance(11)
        (fresh,) = queue.claim(["a"], lease=10)
        queue.ack(stale.receipt)
        queue.extend([stale.receipt], 1000)
        queue.release(stale.receipt)
        queue.retry_later(stale.receipt, 0)
        assert len(queue.peek()) == 1
        clock.advance(9)
        assert queue.claim(["a"]) == []  # the fresh lease is untouched (not released, not extended)
        queue.ack(fresh.receipt)
        assert queue.peek() == []

    def test_peek_shows_what_is_stored_in_claim_order(self, queue: Any, clock: Clock) -> None:
        queue.enqueue(
            [
                Delivery("a", b"later", run_id="r1", not_before=at(30), idempotency_key="k"),
                Delivery("b", b"now!", not_before=at(0)),
            ]
        )
        assert queue.peek([]) == []
        first, second = queue.peek()
        assert (first.queue, first.run_id, first.attempts, first.payload) == ("b", None, 0, b"now!")
        assert first.due == pytest.approx(T0) and first.leased_until is None and first.expires_at is None
        assert (second.queue, second.run_id, second.idempotency_key) == ("a", "r1", "k")
        assert second.due == pytest.approx(T0 + 30)
        (claim,) = queue.claim(["b"], lease=10)
        (held,) = queue.peek(["b"])
        assert held.attempts == 1 and held.leased_until == pytest.approx(T0 + 10)
        assert claim.receipt.startswith(f"{held.id}.")
        assert [m.queue for m in queue.peek(["a", "zzz"])] == ["a"]

    def test_delayed_lists_what_is_held_for_later_soonest_first(self, queue: Any, clock: Clock) -> None:
        """What ``celery inspect scheduled`` answers on these transports (issue #33, item 3): the store, not a worker,
        holds a countdown task until it is due."""
        if not self.lists_delayed:
            pytest.skip("this store lists no delayed messages")
        queue.enqueue(
            [
                Delivery("a", b"in 60", run_id="r1", not_before=at(60)),
                Delivery("a", b"now", not_before=at(0)),
                Delivery("b", b"in 30", not_before=at(30)),
                Delivery("c", b"in 10, elsewhere", not_before=at(10)),
            ]
        )
        queue.put("b", b"in 20, expires in 5", not_before=T0 + 20, ttl=5)
        assert queue.delayed([]) == []
        listed = queue.delayed(["a", "b", "zzz"])
        assert [(m.queue, m.payload) for m in listed] == [
            ("b", b"in 20, expires in 5"),
            ("b", b"in 30"),
            ("a", b"in 60"),
        ]
        assert listed[2].due == pytest.approx(T0 + 60) and listed[2].run_id == "r1"
        assert [m.payload for m in queue.delayed(["a", "b"], limit=1)] == [b"in 20, expires in 5"]
        clock.advance(5)  # expired: never to be delivered
        assert [m.payload for m in queue.delayed(["a", "b"], limit=1)] == [b"in 30"]
        clock.advance(25)  # "in 30" is due now: waiting, not held for later
        assert [m.payload for m in queue.delayed(["a", "b"])] == [b"in 60"]
        assert [c.payload for c in queue.claim(["b"])] == [b"in 30"]
        assert [m.payload for m in queue.delayed(["a", "b"])] == [b"in 60"]

    def test_release_ends_the_claim(self, queue: Any) -> None:
        queue.enqueue([Delivery("a", b"x")])
        (claim,) = queue.claim(["a"])
        queue.release(claim.receipt)
        queue.ack(claim.receipt)  # the released claim is over: its receipt deletes nothing
        (again,) = queue.claim(["a"])
        assert again.attempts == 2

    def test_idempotency_key_dedups_while_pending_and_is_released_by_the_claim(self, queue: Any) -> None:
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
        assert queue.put("a", b"4b", idempotency_key="k") is False
        assert queue.put("a", b"1b", run_id="r1", idempotency_key="k") is False

        claimed = queue.claim(["a"], limit=1)
        assert [c.payload for c in claimed] == [b"1"]
        assert queue.enqueue([Delivery("a", b"9", run_id="r1", idempotency_key="k")]) == [True]  # key released
        assert queue.enqueue([Delivery("a", b"10", run_id="r1", idempotency_key="k")]) == [False]

    def test_retry_later_backs_off(self, queue: Any, clock: Clock) -> None:
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

    def test_extend_pushes_the_lease(self, queue: Any, clock: Clock) -> None:
        queue.enqueue([Delivery("a", b"x"), Delivery("a", b"y")])
        a, b = queue.claim(["a"], limit=2, lease=10)
        clock.advance(8)
        queue.extend([b.receipt, a.receipt], 10)
        clock.advance(9)  # 17 s after the claim, 9 s after the extension
        assert queue.claim(["a"]) == []
        clock.advance(1)
        assert {c.payload for c in queue.claim(["a"], limit=5)} == {b"x", b"y"}

    def test_size_purge_message_ttl_and_no_ack_receive(self, queue: Any, clock: Clock) -> None:
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
        assert len(queue.peek()) == 1
        queue.put("events", b"new")
        queue.put("plain", b"r")
        got = queue.receive(["events", "plain"], no_ack={"events"}, limit=5)
        assert sorted((c.queue, c.attempts) for c in got) == [("events", 1), ("plain", 1)]
        assert [m.queue for m in queue.peek()] == ["plain", "plain"]  # the no_ack row went at receipt

    def test_an_expired_message_releases_its_idempotency_key(self, queue: Any, clock: Clock) -> None:
        queue.declare_queue("events", message_ttl=5)
        assert queue.put("events", b"old", idempotency_key="k") is True
        assert queue.put("events", b"again", idempotency_key="k") is False  # pending: deduplicated
        clock.advance(5)
        assert queue.gc()["messages"] == 1
        assert queue.put("events", b"new", idempotency_key="k") is True

    def test_expired_queues_and_dead_consumers_are_collected(self, queue: Any, clock: Clock) -> None:
        queue.declare_queue("idle", expires=10)
        queue.declare_queue("orphan", auto_delete=True)
        queue.declare_queue("alive", auto_delete=True)
        queue.bind("fan", "", None, "idle")
        queue.bind("fan", "", None, "orphan")
        queue.put("orphan", b"m")
        queue.touch("dead-process", ["orphan"])
        clock.advance(30)
        assert queue.touch("live-process", ["alive", "undeclared"]) == ["undeclared"]
        clock.advance(40)
        assert queue.gc(consumer_timeout=60) == {"queues": 2, "consumers": 1, "messages": 1}
        assert not queue.has_queue("idle") and not queue.has_queue("orphan")
        assert queue.has_queue("alive")
        assert queue.queues() == ["alive"] and queue.consumers() == {"alive": 1, "undeclared": 1}
        assert queue.bindings() == []
        assert queue.drop_consumer("live-process", ["alive"]) == ["alive"]
        assert not queue.has_queue("alive")

    def test_dead_letters_keep_the_failure_history_and_are_selected_exactly(self, queue: Any, clock: Clock) -> None:
        """A message's failed deliveries (a retry with an error, a lease that ran out) travel with it to the dead
        letters; listing filters by queue, run and cursor; only letters with a run wait to be settled; unknown ids
        are a typed error, and a redrive or purge of them moves nothing."""
        from celery_workflow.errors import DeadLetterNotFound

        queue.enqueue([Delivery("a", b"with run", run_id="wrun_1"), Delivery("b", b"no run")])
        first = {c.payload: c for c in queue.claim(["a", "b"], limit=2, lease=10)}
        queue.retry_later(first[b"no run"].receipt, 0, error="boom " * 5000)
        clock.advance(30)  # the first claim's lease runs out unacked
        again = {c.payload: c for c in queue.claim(["a", "b"], limit=2, lease=10)}
        assert set(again) == {b"with run", b"no run"}
        letter_a = queue.dead_letter(again[b"with run"].receipt, reason="max-deliveries")
        letter_b = queue.dead_letter(again[b"no run"].receipt, reason="rejected", error="rejected by its consumer")
        assert queue.dead_letter(again[b"no run"].receipt, reason="rejected") is None  # stale: moved already
        assert first[b"with run"].receipt != again[b"with run"].receipt and queue.peek() == []

        assert (letter_a.attempts, letter_a.run_id, letter_a.payload) == (2, "wrun_1", b"with run")
        assert "lease ran out" in (letter_a.last_error or "")
        assert letter_a.first_failed_at == at(10) and letter_a.last_failed_at == at(10)
        assert letter_b.last_error == "rejected by its consumer" and letter_b.first_failed_at == at(0)
        assert letter_b.dead_at == at(30) and letter_b.enqueued_at == at(0)

        ids = [letter_a.id, letter_b.id]
        assert [d.id for d in queue.list_dead_letters()] == ids
        assert [d.id for d in queue.list_dead_letters(queue="b")] == [letter_b.id]
        assert [d.id for d in queue.list_dead_letters(run_id="wrun_1")] == [letter_a.id]
        assert [d.id for d in queue.list_dead_letters(after=letter_a.id)] == [letter_b.id]
        assert [d.id for d in queue.list_dead_letters(limit=1)] == [letter_a.id]
        assert [d.id for d in queue.unsettled_dead_letters()] == [letter_a.id]
        queue.settle_dead_letters([letter_a.id])
        assert queue.unsettled_dead_letters() == []
        with pytest.raises(DeadLetterNotFound):
            queue.get_dead_letter(10_000_000)
        with pytest.raises(DeadLetterNotFound):
            queue.get_dead_letter("not-an-id")
        assert queue.redrive_dead_letters([10_000_000]) == 0 and queue.purge_dead_letters([]) == 0
        assert queue.redrive_dead_letters(queue="b") == 1
        (back,) = queue.peek()
        assert (back.queue, back.attempts, back.payload) == ("b", 0, b"no run")
        assert queue.purge_dead_letters() == 1 and queue.list_dead_letters() == []
