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
