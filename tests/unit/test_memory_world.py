"""MemoryWorld passes the World conformance suite; plus its test-driver extras."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta

import pytest

from celery_workflow import ids
from celery_workflow.errors import ConfigurationError
from celery_workflow.testing.conformance import WorldConformance
from celery_workflow.testing.memory import MemoryWorld
from celery_workflow.world import Delivery, World


class TestMemoryWorld(WorldConformance):
    @pytest.fixture
    def world(self) -> Iterator[World]:
        w = MemoryWorld()
        yield w
        w.close()


class FakeClock:
    def __init__(self) -> None:
        self.now = datetime(2030, 1, 1, tzinfo=ids.utcnow().tzinfo)

    def __call__(self) -> datetime:
        return self.now


def test_memory_world_is_a_world() -> None:
    assert isinstance(MemoryWorld(), World)


def test_broker_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError):
        MemoryWorld().broker()


def test_fake_clock_drives_due_times_and_leases() -> None:
    clock = FakeClock()
    world = MemoryWorld(clock=clock)
    due = clock.now + timedelta(hours=1)
    world.enqueue([Delivery("q", b"later", not_before=due)])
    assert world.claim(["q"]) == []
    assert world.next_due(["q"]) == due
    assert world.next_due(["other"]) is None
    clock.now = due
    (claimed,) = world.claim(["q"], lease=30)
    assert world.next_due() == due + timedelta(seconds=30)
    assert [d.payload for d in world.pending(["q"])] == [b"later"]
    clock.now += timedelta(seconds=31)
    (again,) = world.claim(["q"])
    assert again.attempts == 2
    world.ack(claimed.receipt)  # stale
    assert len(world.pending()) == 1
    world.ack(again.receipt)
    assert world.pending() == [] and world.next_due() is None
