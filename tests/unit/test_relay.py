"""The relay's core on the in-memory World (issue #29, item 2): what it publishes, when again, and who relays."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest

from celery_workflow.relay import Election, Relay, lease_for, lease_name
from celery_workflow.testing import MemoryWorld
from celery_workflow.world import ClaimedDelivery, Delivery


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


class Recorder:
    def __init__(self) -> None:
        self.published: list[ClaimedDelivery] = []
        self.fail = False
        self.answers = True

    def publish(self, claimed: ClaimedDelivery) -> None:
        if self.fail:
            raise ConnectionError("broker down")
        self.published.append(claimed)

    def ready(self) -> bool:
        return self.answers

    def close(self) -> None:
        pass


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def world(clock: Clock) -> MemoryWorld:
    return MemoryWorld(clock=clock)


def test_only_due_deliveries_are_published_with_their_claim(world: MemoryWorld, clock: Clock) -> None:
    world.enqueue(
        [Delivery("celery", b"now", "r1"), Delivery("celery", b"later", "r2", clock.now + timedelta(days=90))]
    )
    world.enqueue([Delivery("other", b"elsewhere", "r3")])
    out = Recorder()
    relay = Relay(world, ["celery"], out, lease=60)
    assert relay.round() == 1
    assert [(c.payload, c.attempts) for c in out.published] == [(b"now", 1)]
    assert relay.round() == 0  # leased: not published twice
    clock.advance(90 * 86400)
    world.ack(out.published[0].receipt)  # the worker's append acked the first
    assert relay.round() == 1
    assert out.published[-1].payload == b"later"


def test_a_lost_message_is_published_again_when_its_lease_runs_out_with_a_longer_lease(
    world: MemoryWorld, clock: Clock
) -> None:
    world.enqueue([Delivery("celery", b"m", "r1")])
    out = Recorder()
    relay = Relay(world, ["celery"], out, lease=60)
    relay.round()
    clock.advance(59)
    assert relay.round() == 0
    clock.advance(2)  # the broker lost it: nobody acked, the lease ran out
    assert relay.round() == 1
    first, second = out.published
    assert (second.attempts, second.payload) == (2, b"m") and second.receipt != first.receipt
    clock.advance(61)  # the second claim is leased twice as long
    assert relay.round() == 0
    clock.advance(60)
    assert relay.round() == 1
    world.ack(first.receipt)  # a stale receipt (the first message, delivered late) changes nothing
    assert world.next_due(["celery"]) is not None
    world.ack(out.published[-1].receipt)
    assert world.next_due(["celery"]) is None


def test_lease_growth_is_capped() -> None:
    assert [lease_for(10, n) for n in (1, 2, 3)] == [10, 20, 40]
    assert lease_for(10, 50) == 640


def test_a_failed_publish_gives_the_claims_back_and_claims_nothing_until_the_broker_answers(
    world: MemoryWorld,
) -> None:
    world.enqueue([Delivery("celery", f"m{i}".encode(), f"r{i}") for i in range(3)])
    out = Recorder()
    out.fail = True
    relay = Relay(world, ["celery"], out, lease=60)
    assert relay.round() == 0
    out.fail, out.answers = False, False
    assert relay.round() == 0  # not ready: nothing claimed (no attempt spent)
    out.answers = True
    assert relay.round() == 3
    assert sorted(c.attempts for c in out.published) == [2, 2, 2]  # one attempt spent by the outage, no more


def test_one_relay_at_a_time_per_queue_set(world: MemoryWorld, clock: Clock) -> None:
    name = lease_name(["b", "a"])
    assert name == lease_name(["a", "b", "a"])

    def seconds() -> float:
        return clock.now.timestamp()

    first = Election(world, name, seconds=15, holder="one", clock=seconds)
    second = Election(world, name, seconds=15, holder="two", clock=seconds)
    assert first.hold() and not second.hold()
    clock.advance(10)
    assert first.hold() and not second.hold()  # renewed
    clock.advance(16)  # the first died: its lease ran out
    assert second.hold()
    second.drop()
    assert Election(world, name, seconds=15, holder="three", clock=seconds).hold()


def test_serve_publishes_what_becomes_due_and_stops(world: MemoryWorld) -> None:
    out = Recorder()
    relay = Relay(world, ["celery"], out, lease=60)
    stop = threading.Event()
    thread = threading.Thread(target=relay.serve, args=(stop,))
    thread.start()
    try:
        world.enqueue([Delivery("celery", b"woken", "r1")])
        deadline = threading.Event()
        for _ in range(200):
            if out.published:
                break
            deadline.wait(0.02)
        assert [c.payload for c in out.published] == [b"woken"]
    finally:
        stop.set()
        thread.join(5)
    assert not thread.is_alive()
    assert Election(world, relay.election.name, holder="next").hold()  # the lease was given up


def test_an_undecodable_delivery_is_put_back_with_its_error_not_published(world: MemoryWorld, clock: Clock) -> None:
    from celery import Celery

    from celery_workflow.relay_celery import CeleryPublisher

    class Checked(Recorder):
        def publish(self, claimed: ClaimedDelivery) -> None:
            CeleryPublisher(Celery("undecodable")).message(claimed)  # PayloadError
            super().publish(claimed)

    world.enqueue([Delivery("celery", b"not a task message", "r1")])
    out = Checked()
    relay = Relay(world, ["celery"], out, lease=60)
    assert relay.round() == 0
    assert out.published == [] and relay._failures == 0  # not taken for a broker failure
    assert relay.round() == 0  # due again after a backoff, not at once
    clock.advance(2)
    assert relay.round() == 0 and world.next_due(["celery"]) is not None


def test_a_relayed_message_is_the_stored_task_with_its_claim_and_no_eta() -> None:
    from celery import Celery

    from celery_workflow.app import build_message
    from celery_workflow.relay_celery import CeleryPublisher
    from celery_workflow.world import Claim

    app = Celery("relayed")
    due = datetime(2026, 1, 2, tzinfo=UTC)
    payload = build_message(app, "workflow.w", ["run-1"], {}, queue="orders", task_id="dlv_1", not_before=due)
    name, message = CeleryPublisher(app).message(ClaimedDelivery("7.3", "orders", payload, 3, "run-1"))
    assert name == "workflow.w"
    assert message.headers["id"] == "dlv_1" and message.headers["task"] == "workflow.w"
    assert message.headers["eta"] is None
    assert (message.headers["cw_receipt"], message.headers["cw_attempts"]) == ("7.3", 3)
    assert message.body == (["run-1"], {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None})
    assert message.properties["correlation_id"] == "dlv_1"

    class Request:  # what a Celery worker shows a task: the message's headers as attributes
        pass

    request = Request()
    for key, value in message.headers.items():
        setattr(request, key, value)
    assert Claim.from_attributes(request) == Claim("7.3", 3)
    assert Claim.from_attributes(Request()) is None
