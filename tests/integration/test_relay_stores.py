"""The relay on the SQL Worlds (issue #29, item 2): the election lease kept by their queue stores, the relay shown as
its queues' consumer, and the dead letters of a delivery the broker keeps losing."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_workflow import Workflows
from celery_workflow.dead_letters import MAX_DELIVERIES
from celery_workflow.relay import Relay, leases_of
from celery_workflow.worker_setup import queue_consumers
from celery_workflow.world import ClaimedDelivery
from celery_workflow.world_sqlite import SQLiteWorld
from tests.acceptance.workers import wait_for


class Lossy:
    """A broker that takes every message and loses it."""

    def __init__(self) -> None:
        self.published: list[ClaimedDelivery] = []

    def publish(self, claimed: ClaimedDelivery) -> None:
        self.published.append(claimed)

    def ready(self) -> bool:
        return True

    def close(self) -> None:
        pass


@pytest.fixture(params=["sqlite", "postgres"])
def world(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    if request.param == "sqlite":
        opened: Any = SQLiteWorld(tmp_path / "world.db")
        yield opened
        opened.close()
        return
    try:
        from tests.integration import pg_fixtures
    except pytest.skip.Exception as exc:
        pytest.skip(str(exc))
    from celery_workflow.world_pg import PostgresWorld

    with pg_fixtures.fresh_schema("cw_relay") as schema:
        opened = PostgresWorld.open(pg_fixtures.schema_url(schema))
        yield opened
        opened.close()


def test_the_election_lease_has_one_holder_until_it_runs_out_or_is_dropped(world: Any) -> None:
    leases = leases_of(world)
    assert leases is not None
    assert leases.hold_lease("relay:a", "one", 0.5)
    assert not leases.hold_lease("relay:a", "two", 0.5)
    assert leases.hold_lease("relay:b", "two", 0.5)  # another queue set, another lease
    assert leases.hold_lease("relay:a", "one", 0.5)  # renewed
    wait_for(lambda: leases.hold_lease("relay:a", "two", 0.5), 10)  # "one" died: its lease ran out
    assert not leases.hold_lease("relay:a", "one", 0.5)
    leases.drop_lease("relay:a", "one")  # not the holder: nothing happens
    assert not leases.hold_lease("relay:a", "one", 30)
    leases.drop_lease("relay:a", "two")
    assert leases.hold_lease("relay:a", "one", 30)


def test_a_serving_relay_shows_as_its_queues_consumer(world: Any) -> None:
    relay = Relay(world, ["orders"], Lossy(), lease=60)
    stop = threading.Event()
    thread = threading.Thread(target=relay.serve, args=(stop,))
    thread.start()
    try:
        wait_for(lambda: (queue_consumers(world) or {}).get("orders"), 10)
    finally:
        stop.set()
        thread.join(10)
    assert not (queue_consumers(world) or {}).get("orders")


def test_a_delivery_the_broker_keeps_losing_is_dead_lettered_and_its_run_failed(world: Any) -> None:
    wf = Workflows(Celery("relay-lossy"), world, broker="app")

    @wf.workflow
    def lost() -> int:
        return 1

    world.max_deliveries = 3
    run = lost.start()
    broker = Lossy()
    relay = Relay(world, ["celery"], broker, lease=0.05)
    deadline = time.monotonic() + 30
    while run.status != "failed" and time.monotonic() < deadline:
        relay.round()
        time.sleep(0.02)
    assert run.status == "failed"
    assert [c.attempts for c in broker.published] == [1, 2, 3]  # republished as each lease ran out, then no more
    (letter,) = world.store.list_dead_letters(run_id=run.id)
    assert letter.reason == MAX_DELIVERIES
