"""The AWS World plans a delivery's appends on what the delivery read (issue #31, item 1): no read before each append;
a stale kept snapshot is refused by the write's conditions (the refusal returns the run's META, ALL_OLD) and the batch
is planned again on fresh reads; a run's end planned on it still finds the schedules another writer added."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest

from celery_workflow import Workflows, ids
from celery_workflow.aws_lambda import queue_handler
from celery_workflow.events import EventType
from celery_workflow.testing._conformance import create, ev, step_created
from celery_workflow.world import Delivery
from celery_workflow.world_sqs import AWSWorld
from tests.integration.aws_fixtures import Aws, aws_fixture, moto_fixture, summing_app  # noqa: F401
from tests.integration.test_aws_lambda import Context, invoke, sqs_event


def calls(client: Any) -> list[str]:
    """The names of the DynamoDB operations ``client`` makes from now on, refused ones marked ``!``."""
    made: list[str] = []

    def after(http_response: Any, model: Any, **_: Any) -> None:
        made.append(model.name + ("!" if http_response.status_code >= 300 else ""))

    client.meta.events.register("after-call.dynamodb", after)
    return made


@pytest.fixture
def wf(aws: Aws) -> Iterator[Workflows]:
    app = summing_app(aws.world(), "kept-app")
    yield app
    app.close()


def test_a_delivery_reads_nothing_before_its_appends(aws: Aws, wf: Workflows) -> None:
    """Four inline steps in one delivery: each append is planned on the delivery's own read of the run (META and the
    log), advanced by the appends before it; no TransactGetItems (it was one before every append)."""
    world = wf.world
    assert isinstance(world, AWSWorld)
    world.append_limits = replace(world.append_limits, batch_steps=False)  # an append per step, as it was
    made = calls(aws.dynamodb)
    handler = queue_handler(wf)
    run = wf.start("sum_of", 4)
    while not run.status.terminal:
        event = sqs_event(aws)
        if event["Records"]:
            invoke(aws, handler, event, Context(60))
    assert run.result() == 6
    assert made.count("TransactWriteItems") >= 5 and "TransactGetItems" not in made
    assert not any(name.endswith("!") for name in made)  # nothing refused: the kept snapshot was right


def test_a_stale_kept_snapshot_is_refused_and_planned_again(aws: Aws) -> None:
    """Another writer appends after this World read the run: the append planned on the kept snapshot is refused by
    the event count, costs no read to learn it was not its own lost commit (the refusal carried META), and is planned
    again on fresh reads, at the next slot (the step views from the log, one Query)."""
    mine = aws.world()
    other = AWSWorld(aws.config(), aws.client("dynamodb"), aws.sqs)
    run = create(mine, started=True)
    mine.get_run_with_events(run.run_id)  # kept
    other.append(run.run_id, [step_created("s1")])
    made = calls(aws.dynamodb)
    result = mine.append(run.run_id, [step_created("s2")])
    assert [e.slot for e in result.events] == [4]
    # the fresh plan reads META (and what the batch names) and, as it names a step, the log: steps have no items
    assert made == ["TransactWriteItems!", "TransactGetItems", "Query", "TransactWriteItems"]
    log = mine.list_events(run.run_id)
    assert [(e.slot, e.correlation_id) for e in log][2:] == [(3, "s1"), (4, "s2")]
    assert {s.step_id for s in mine.list_steps(run.run_id)} == {"s1", "s2"}


def test_a_run_end_planned_on_a_kept_snapshot_deletes_schedules_added_meanwhile(aws: Aws) -> None:
    """A delivery queued by another writer without an event adds a schedule to the run's META without moving its
    event count: the run's end planned on a kept snapshot (which had none) is refused, read afresh, and deletes it."""
    mine = aws.world()
    other = AWSWorld(aws.config(), aws.client("dynamodb"), aws.sqs)
    run = create(mine, started=True)
    mine.get_run_with_events(run.run_id)
    later = Delivery("celery", b"later", run_id=run.run_id, not_before=ids.utcnow() + timedelta(hours=2))
    other.append(run.run_id, [], deliveries=[later])
    assert len(aws.schedules()) == 1
    mine.append(run.run_id, [ev(EventType.RUN_COMPLETED, output=None)])
    assert aws.schedules() == []
    assert mine.get_run(run.run_id).status.terminal


def test_a_run_end_planned_on_the_kept_snapshot_reads_no_parent_link(aws: Aws) -> None:
    """Whether a run is a child run (its run_created's parent link) comes with the kept snapshot, read with the log:
    the append that ends a run reads nothing before its one TransactWriteItems (issue #30, item 1)."""
    world = aws.world()
    run = create(world, started=True)
    world.get_run_with_events(run.run_id)  # kept
    made = calls(aws.dynamodb)
    world.append(run.run_id, [ev(EventType.RUN_COMPLETED, output=1)])
    assert "Query" not in made and "TransactGetItems" not in made, made
    assert made.count("TransactWriteItems") == 1, made
    world.close()
