"""The AWS World writes no ``STEP#`` items (issue #31, item 2): a step's view is the one its run's log gives, for
``get_step``, ``list_steps`` and the rules of an append, kept or read afresh. ``STEP#`` items of tables written by
earlier versions are not read, and go with their run's partition when it expires."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from celery_workflow import ids
from celery_workflow._aws.queue import Record
from celery_workflow._aws.table import TTL_ATTRIBUTE
from celery_workflow.errors import EntityTerminal, RunNotFound, StepNotFound
from celery_workflow.events import EventType, StepStatus
from celery_workflow.testing._conformance import create, ev, step_created
from tests.integration.aws_fixtures import TABLE, Aws, aws_fixture, moto_fixture  # noqa: F401
from tests.integration.aws_legacy import step_item


def partition(aws: Aws, run_id: str) -> dict[str, dict[str, Any]]:
    items = aws.dynamodb.query(
        TableName=TABLE,
        KeyConditionExpression="pk = :pk",
        ExpressionAttributeValues={":pk": {"S": f"RUN#{run_id}"}},
        ConsistentRead=True,
    )["Items"]
    return {i["sk"]["S"]: i for i in items}


def test_steps_have_no_items_and_read_from_the_log(aws: Aws) -> None:
    world = aws.world()
    run = create(world, started=True)
    world.append(run.run_id, [step_created("a"), step_created("b")])
    world.append(run.run_id, [ev(EventType.STEP_STARTED, "a"), ev(EventType.STEP_COMPLETED, "a", result=7)])
    assert not any(sk.startswith("STEP#") for sk in partition(aws, run.run_id))
    fresh = aws.world()  # nothing kept: reads the log
    a = fresh.get_step(run.run_id, "a")
    assert (a.status, a.output, a.attempt) == (StepStatus.COMPLETED, 7, 1)
    assert [(s.step_id, s.status) for s in fresh.list_steps(run.run_id)] == [
        ("a", StepStatus.COMPLETED),
        ("b", StepStatus.PENDING),
    ]
    with pytest.raises(StepNotFound):
        fresh.get_step(run.run_id, "nope")
    with pytest.raises(RunNotFound):
        fresh.get_step("wrun_missing", "a")
    with pytest.raises(RunNotFound):
        fresh.list_steps("wrun_missing")


def test_an_append_planned_on_fresh_reads_takes_step_views_from_the_log(aws: Aws) -> None:
    world = aws.world()
    run = create(world, started=True)
    world.append(run.run_id, [step_created("a")])
    other = aws.world()  # no kept snapshot: META, then the log for the step the batch names
    (started,) = other.append(run.run_id, [ev(EventType.STEP_STARTED, "a")]).events
    assert started.data["attempt"] == 1
    with pytest.raises(StepNotFound):
        aws.world().append(run.run_id, [ev(EventType.STEP_STARTED, "nope")])
    assert aws.world().get_step(run.run_id, "a").status is StepStatus.RUNNING


def test_step_items_of_earlier_versions_are_not_read_and_expire_with_the_run(
    aws: Aws, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table an earlier version wrote has a STEP# item per step; it goes stale once this version appends (it never
    updates one), is not read, and the run's expiry deletes it with the rest of the partition."""
    world = aws.world(retention=timedelta(hours=1))
    run = create(world, started=True)
    (created,) = world.append(run.run_id, [step_created("a")]).events
    old = world.get_step(run.run_id, "a")
    aws.dynamodb.put_item(TableName=TABLE, Item=step_item(old, created.slot))  # as the earlier version left it
    world.append(run.run_id, [ev(EventType.STEP_STARTED, "a"), ev(EventType.STEP_COMPLETED, "a", result=1)])
    assert aws.world().get_step(run.run_id, "a").status is StepStatus.COMPLETED  # the log's, not the item's
    assert partition(aws, run.run_id)["STEP#a"]["status"] == {"S": "pending"}
    with pytest.raises(EntityTerminal, match="already completed"):
        aws.world().append(run.run_id, [ev(EventType.STEP_STARTED, "a")])
    world.append(run.run_id, [ev(EventType.RUN_COMPLETED, output=1)])
    later = ids.utcnow() + timedelta(hours=2)
    monkeypatch.setattr(ids, "utcnow", lambda: later)
    assert world.expire_run(Record(f"expire-{run.run_id}", "celery", b"", run.run_id, later, "expire")) is None
    left = partition(aws, run.run_id)
    assert "STEP#a" not in left and all(TTL_ATTRIBUTE in item for item in left.values())


def test_a_step_read_plans_the_next_append_without_reading_again(aws: Aws) -> None:
    """A queued step's delivery reads its step (``get_step``: META and the log, as a delivery reads its run) and then
    appends its outcome: planned on that read, with no read of its own."""
    world = aws.world()
    run = create(world, started=True)
    world.append(run.run_id, [step_created("a")])
    reader = aws.world()
    made: list[str] = []
    aws.dynamodb.meta.events.register("after-call.dynamodb", lambda model, **_: made.append(model.name))
    assert reader.get_step(run.run_id, "a").status is StepStatus.PENDING
    assert made == ["GetItem", "Query"]
    reader.append(run.run_id, [ev(EventType.STEP_STARTED, "a"), ev(EventType.STEP_COMPLETED, "a", result=3)])
    assert made == ["GetItem", "Query", "TransactWriteItems"]
