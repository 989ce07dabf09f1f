"""World conformance: the delivery queue (due times, leases, receipts, idempotency keys, queue names)."""

from __future__ import annotations

import time

import pytest

from celery_workflow.errors import EntityExists
from celery_workflow.events import EventType
from celery_workflow.testing._conformance import (
    Conformance,
    claim_one,
    create,
    delivery,
    drain,
    ev,
    eventually,
    in_seconds,
    requires,
    step_created,
    unique,
)
from celery_workflow.world import ClaimedDelivery, World


class QueueConformance(Conformance):
    """Deliveries are claimed when due, hidden by their lease, and deduplicated while pending."""

    def test_enqueue_then_claim_and_ack(self, world: World) -> None:
        queue = unique("q")
        assert world.enqueue([delivery(queue, b"one", run_id="r1")]) == [True]
        claimed = claim_one(world, queue)
        assert claimed is not None
        assert (claimed.queue, claimed.payload, claimed.attempts, claimed.run_id) == (queue, b"one", 1, "r1")
        assert claimed.receipt
        assert claim_one(world, queue) is None  # leased
        world.ack(claimed.receipt)
        assert drain(world, queue) == []

    def test_append_acks_the_claimed_delivery_in_the_same_write(self, world: World) -> None:
        run = create(world, started=True)
        queue = unique("q")
        world.enqueue([delivery(queue, b"trigger", run_id=run.run_id), delivery(queue, b"other", run_id=run.run_id)])
        first = claim_one(world, queue)
        second = claim_one(world, queue)
        assert first is not None and second is not None
        with pytest.raises(EntityExists):  # a rejected append acks nothing
            world.append(run.run_id, [step_created("s"), step_created("s")], ack=first.receipt)
        world.append(run.run_id, [step_created("s")], ack=first.receipt, durable=False)
        world.release(first.receipt)  # gone with the append: nothing to release
        world.release(second.receipt)
        assert [d.payload for d in drain(world, queue)] == [b"other"]
        stale = ClaimedDelivery(receipt=second.receipt, queue=queue, payload=b"", attempts=1)
        world.append(run.run_id, [ev(EventType.STEP_STARTED, "s")], ack=stale.receipt)  # stale: deletes nothing
        assert world.get_run(run.run_id).event_count == 4

    def test_claim_only_from_the_named_queues(self, world: World) -> None:
        a, b, c = unique("qa"), unique("qb"), unique("qc")
        world.enqueue([delivery(a, b"a"), delivery(b, b"b"), delivery(c, b"c")])
        got = world.claim([a, c], limit=10)
        assert sorted(d.payload for d in got) == [b"a", b"c"]
        assert [d.payload for d in drain(world, b)] == [b"b"]
        assert world.claim([], limit=10) == []

    @requires("ordered_claims")
    def test_claim_takes_oldest_due_first_up_to_limit(self, world: World) -> None:
        queue = unique("q")
        world.enqueue([delivery(queue, b"later", not_before=in_seconds(-1))])
        world.enqueue([delivery(queue, b"earliest", not_before=in_seconds(-5))])
        world.enqueue([delivery(queue, b"now")])
        first = world.claim([queue], limit=2)
        assert [d.payload for d in first] == [b"earliest", b"later"]
        assert [d.payload for d in world.claim([queue], limit=2)] == [b"now"]

    @requires("subsecond_times")
    def test_delivery_is_not_claimed_before_it_is_due(self, world: World) -> None:
        queue = unique("q")
        due = in_seconds(0.3)
        world.enqueue([delivery(queue, b"later", not_before=due), delivery(queue, b"far", not_before=in_seconds(3600))])
        assert claim_one(world, queue) is None
        claimed = eventually(lambda: claim_one(world, queue))
        assert claimed.payload == b"later"
        assert time.time() >= due.timestamp() - 0.01
        assert claim_one(world, queue) is None

    @requires("subsecond_times")
    def test_lease_hides_a_claimed_delivery_until_it_expires(self, world: World) -> None:
        queue = unique("q")
        world.enqueue([delivery(queue, b"x")])
        first = claim_one(world, queue, lease=0.5)
        assert first is not None and first.attempts == 1
        assert claim_one(world, queue) is None
        second = eventually(lambda: claim_one(world, queue, lease=60))
        assert second.payload == b"x" and second.attempts == 2 and second.receipt != first.receipt
        # the first claimant's receipt is stale: it cannot ack, release, retry or extend the new claim
        world.ack(first.receipt)
        world.release(first.receipt)
        world.retry_later(first.receipt, 0)
        world.extend([first.receipt], 0.01)
        time.sleep(0.05)
        assert claim_one(world, queue) is None
        world.ack(second.receipt)
        assert drain(world, queue) == []

    @requires("ordered_claims")
    def test_release_makes_the_delivery_claimable_at_once(self, world: World) -> None:
        queue = unique("q")
        world.enqueue([delivery(queue, b"x")])
        world.enqueue([delivery(queue, b"y")])
        first = claim_one(world, queue)
        assert first is not None and first.payload == b"x"
        world.release(first.receipt)
        again = claim_one(world, queue)  # keeps its place ahead of "y"
        assert again is not None and again.payload == b"x" and again.receipt != first.receipt
        assert again.attempts == 2
        world.ack(first.receipt)  # stale since the release
        world.ack(again.receipt)
        assert [d.payload for d in drain(world, queue)] == [b"y"]

    @requires("subsecond_times")
    def test_retry_later_delays_the_delivery(self, world: World) -> None:
        queue = unique("q")
        world.enqueue([delivery(queue, b"x")])
        first = claim_one(world, queue)
        assert first is not None
        released_at = time.monotonic()
        world.retry_later(first.receipt, 0.3)
        assert claim_one(world, queue) is None
        again = eventually(lambda: claim_one(world, queue))
        assert time.monotonic() - released_at >= 0.25
        assert again.attempts == 2

    @requires("subsecond_times")
    def test_extend_keeps_the_delivery_hidden(self, world: World) -> None:
        queue = unique("q")
        world.enqueue([delivery(queue, b"x"), delivery(queue, b"y")])
        claimed = world.claim([queue], limit=2, lease=0.2)
        assert len(claimed) == 2
        world.extend([c.receipt for c in claimed], 30)
        time.sleep(0.4)  # past the original lease
        assert claim_one(world, queue) is None
        for c in claimed:
            world.ack(c.receipt)
        assert drain(world, queue) == []

    def test_receipts_of_acked_deliveries_are_ignored(self, world: World) -> None:
        queue = unique("q")
        world.enqueue([delivery(queue, b"x"), delivery(queue, b"y")])
        gone = claim_one(world, queue)
        assert gone is not None
        world.ack(gone.receipt)
        world.ack(gone.receipt)
        world.release(gone.receipt)
        world.retry_later(gone.receipt, 1)
        world.extend([gone.receipt], 1)
        assert [d.payload for d in drain(world, queue)] == [b"y"]

    @requires("dedup_pending")
    def test_idempotency_key_dedupes_a_pending_delivery_of_the_same_run(self, world: World) -> None:
        queue = unique("q")
        assert world.enqueue([delivery(queue, b"1", run_id="r1", idempotency_key="k")]) == [True]
        assert world.enqueue([delivery(queue, b"2", run_id="r1", idempotency_key="k")]) == [False]
        assert world.enqueue([delivery(queue, b"3", run_id="r2", idempotency_key="k")]) == [True]
        assert world.enqueue([delivery(queue, b"4", run_id="r1", idempotency_key="other")]) == [True]
        assert world.enqueue([delivery(queue, b"5", run_id="r1")]) == [True]
        assert world.enqueue(
            [
                delivery(queue, b"6", run_id="r3", idempotency_key="k"),
                delivery(queue, b"7", run_id="r3", idempotency_key="k"),
            ]
        ) == [True, False]
        # without a run, a key deduplicates against pending deliveries of the same queue
        other = unique("q")
        assert world.enqueue([delivery(queue, b"8", idempotency_key="solo")]) == [True]
        assert world.enqueue([delivery(queue, b"9", idempotency_key="solo")]) == [False]
        assert world.enqueue([delivery(other, b"10", idempotency_key="solo")]) == [True]
        assert sorted(d.payload for d in drain(world, queue)) == [b"1", b"3", b"4", b"5", b"6", b"8"]
        assert [d.payload for d in drain(world, other)] == [b"10"]

    @requires("dedup_pending")
    def test_claim_releases_the_idempotency_key(self, world: World) -> None:
        queue = unique("q")
        world.enqueue([delivery(queue, b"first", run_id="r", idempotency_key="k")])
        claimed = claim_one(world, queue, lease=60)
        assert claimed is not None
        # queued while the first one executes: never dropped
        assert world.enqueue([delivery(queue, b"second", run_id="r", idempotency_key="k")]) == [True]
        second = claim_one(world, queue)
        assert second is not None and second.payload == b"second"
        # the key stays released after release / retry_later / extend of the claimed deliveries
        world.extend([claimed.receipt], 60)
        world.release(claimed.receipt)
        world.retry_later(second.receipt, 0)
        assert world.enqueue([delivery(queue, b"third", run_id="r", idempotency_key="k")]) == [True]
        assert world.enqueue([delivery(queue, b"fourth", run_id="r", idempotency_key="k")]) == [False]
        assert sorted(d.payload for d in drain(world, queue)) == [b"first", b"second", b"third"]

    def test_acked_delivery_is_gone_for_every_claimant(self, world: World) -> None:
        queue = unique("q")
        world.enqueue([delivery(queue, bytes([i])) for i in range(5)])
        got: list[ClaimedDelivery] = []
        while batch := world.claim([queue], limit=2, lease=60):
            got.extend(batch)
        assert sorted(d.payload for d in got) == [bytes([i]) for i in range(5)]
        assert len({d.receipt for d in got}) == 5
        for d in got:
            world.ack(d.receipt)
        assert drain(world, queue) == []
