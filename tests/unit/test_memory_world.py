"""MemoryWorld passes the World conformance suite; plus its test-driver extras."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta

import pytest

from celery_workflow import ids
from celery_workflow.errors import ConfigurationError
from celery_workflow.testing._conformance import REQUIRES, skip_reason
from celery_workflow.testing.conformance import WorldConformance, requires
from celery_workflow.testing.memory import MemoryWorld
from celery_workflow.world import Capabilities, Delivery, World


class TestMemoryWorld(WorldConformance):
    @pytest.fixture
    def world(self) -> Iterator[World]:
        w = MemoryWorld()
        yield w
        w.close()


class _LackingWorld(MemoryWorld):
    """A World declaring that its broker has none of the optional capabilities (as standard SQS + DynamoDB would)."""

    capabilities = Capabilities(
        ordered_claims=False, subsecond_times=False, dedup_pending=False, consistent_listings=False
    )


class TestWorldLackingCapabilities(WorldConformance):
    """The suite on a World without the optional capabilities: the marked cases skip, everything else runs."""

    @pytest.fixture
    def world(self) -> Iterator[World]:
        w = _LackingWorld()
        yield w
        w.close()


#: The cases that need each capability (what a World lacking it skips, and nothing else).
NEEDS = {
    "ordered_claims": {
        "test_claim_takes_oldest_due_first_up_to_limit",
        "test_release_makes_the_delivery_claimable_at_once",
    },
    "subsecond_times": {
        "test_delivery_is_not_claimed_before_it_is_due",
        "test_lease_hides_a_claimed_delivery_until_it_expires",
        "test_retry_later_delays_the_delivery",
        "test_extend_keeps_the_delivery_hidden",
    },
    "dedup_pending": {
        "test_idempotency_key_dedupes_a_pending_delivery_of_the_same_run",
        "test_claim_releases_the_idempotency_key",
    },
    "consistent_listings": {"test_list_runs_newest_first_with_filters_and_paging"},
}


def test_exactly_the_marked_cases_need_each_capability() -> None:
    found: dict[str, set[str]] = {}
    for name in dir(WorldConformance):
        for capability in getattr(getattr(WorldConformance, name), REQUIRES, ()):
            found.setdefault(capability, set()).add(name)
    assert found == NEEDS
    assert sorted(found) == sorted(Capabilities().lacking() or _LackingWorld.capabilities.lacking())


def test_a_lacking_world_skips_with_the_capability_as_reason() -> None:
    reason = skip_reason(_LackingWorld(), WorldConformance.test_list_runs_newest_first_with_filters_and_paging)
    assert reason == (
        "_LackingWorld declares it lacks consistent_listings (list_runs shows a run as soon as create_run returned)"
    )
    assert skip_reason(_LackingWorld(), WorldConformance.test_enqueue_then_claim_and_ack) is None  # needs nothing
    assert skip_reason(MemoryWorld(), WorldConformance.test_claim_releases_the_idempotency_key) is None


def test_requires_refuses_an_unknown_capability() -> None:
    with pytest.raises(KeyError):
        requires("telepathy")


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
