"""Postgres: a fan-out of 10,000 steps is one transaction of several statements (issue #26, item 4).

A statement takes at most 65,535 parameters (the protocol counts them in 16 bits); the events of 10,000 step
creations are 70,000. The append splits its statements, never its transaction.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_workflow import Workflows
from celery_workflow._postgres.script import MAX_PARAMETERS, Script
from celery_workflow.errors import EventInvalid
from celery_workflow.events import EventType, RunStatus
from celery_workflow.runtime.batches import step_key
from celery_workflow.runtime.context import gather
from celery_workflow.testing._conformance import create, drain, step_created, unique
from celery_workflow.testing.driver import LocalWorker
from celery_workflow.world import Delivery
from celery_workflow.world_pg import PostgresWorld
from tests.integration.pg_fixtures import pg_schema_fixture, pg_url_fixture  # noqa: F401

WIDE = 10_000


@pytest.fixture(name="world")
def world_fixture(pg_url: str) -> Iterator[PostgresWorld]:
    # an error the append meets is not retried for long (before the fix, the protocol's refusal was retried as a lost
    # connection)
    w = PostgresWorld.open(pg_url, unavailable_timeout=3.0)
    yield w
    w.close()


def test_an_append_of_10000_step_creations_and_their_deliveries(world: PostgresWorld) -> None:
    run = create(world, started=True)
    queue = unique("fan")
    events = [step_created(f"step:s:{i}", "s", [i]) for i in range(1, WIDE + 1)]
    deliveries = [
        Delivery(queue, f"{i}".encode(), run.run_id, idempotency_key=step_key(f"step:s:{i}"))
        for i in range(1, WIDE + 1)
    ]
    assert len(events) * 7 > MAX_PARAMETERS  # one INSERT of them all would not do
    written = world.append(run.run_id, events, expected_count=2, deliveries=deliveries).events
    assert [e.slot for e in written] == list(range(3, WIDE + 3))
    assert len(world.list_steps(run.run_id)) == WIDE
    assert len(world.list_events(run.run_id)) == WIDE + 2
    assert sorted(int(c.payload) for c in drain(world, queue)) == list(range(1, WIDE + 1))


def test_a_statement_over_the_parameter_limit_is_refused_before_it_is_sent(world: PostgresWorld) -> None:
    def attempt(conn: Any) -> None:
        script = Script(conn)
        with pytest.raises(EventInvalid, match="65535"):
            script.add("SELECT 1", [0] * (MAX_PARAMETERS + 1))
        assert len(script) == 0

    world.db.run(attempt, what="test")


def test_the_first_delivery_of_a_10000_step_fan_out_creates_every_step_with_its_delivery(world: PostgresWorld) -> None:
    wf = Workflows(Celery("pgfan"), world=world, broker="app")

    @wf.step
    def one(i: int) -> int:
        return i

    @wf.workflow
    def fan(n: int) -> int:
        return sum(gather(*[one.start(i) for i in range(n)]))

    run = fan.start(WIDE)
    worker = LocalWorker(wf)
    assert worker.run_once()  # the run's first delivery: its start, the 10,000 creations and their deliveries
    assert worker.failures == []
    view, events = world.get_run_with_events(run.id)
    assert view.status is RunStatus.RUNNING
    assert sum(1 for e in events if e.event_type is EventType.STEP_CREATED) == WIDE
    assert len(world.list_steps(run.id)) == WIDE
    run.cancel()
    steps = drain(world, wf.runtime.default_queue)
    assert len(steps) == WIDE
    assert [e.event_type for e in world.list_events(run.id)][-1] is EventType.RUN_CANCELLED
    wf.close()
