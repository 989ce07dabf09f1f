"""The AWS World's EventBridge Scheduler schedules on moto (issue #27, items 3 and 8): a run's end (cancelled,
completed) deletes the schedules of its pending deliveries and their records; a delivery sent again after an early
arrival gets a schedule of its own while the one that brought it may still exist."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from celery import Celery

from celery_workflow import Workflows, ids, sleep
from celery_workflow._aws.schedules import schedule_name
from celery_workflow.events import EventType, RunStatus
from celery_workflow.testing import LocalWorker
from celery_workflow.testing._conformance import create, ev
from celery_workflow.world import Delivery
from celery_workflow.world_sqs import AWSWorld
from tests.integration.aws_fixtures import TABLE, Aws, aws_fixture, moto_fixture  # noqa: F401


def _records(aws: Aws) -> list[dict[str, Any]]:
    """The ``QUEUE#`` records in the table."""
    answer = aws.dynamodb.scan(
        TableName=TABLE, FilterExpression="begins_with(pk, :q)", ExpressionAttributeValues={":q": {"S": "QUEUE#"}}
    )
    return list(answer["Items"])


def _meta_schedules(world: AWSWorld, run_id: str) -> set[str]:
    meta = world.table.get({"pk": f"RUN#{run_id}", "sk": "META"}) or {}
    return set(meta.get("schedules", {}).get("SS", []))


def _timer(run_id: str, wait: str, due: Any) -> tuple[list[Any], list[Delivery]]:
    events = [ev(EventType.WAIT_CREATED, wait, resume_at=ids.isoformat(due))]
    return events, [Delivery("celery", f"timer {wait}".encode(), run_id=run_id, not_before=due)]


@pytest.mark.parametrize("end", [EventType.RUN_CANCELLED, EventType.RUN_COMPLETED, EventType.RUN_FAILED])
def test_a_run_end_deletes_its_pending_schedules_and_their_records(aws: Aws, end: EventType) -> None:
    world = aws.world()
    run = create(world, started=True)
    due = ids.utcnow() + timedelta(hours=2)
    events, deliveries = _timer(run.run_id, "wait:1", due)
    soon = Delivery("celery", b"soon", run_id=run.run_id, not_before=ids.utcnow() + timedelta(minutes=1))
    world.append(run.run_id, events, deliveries=[*deliveries, soon])
    assert len(aws.schedules()) == 1
    assert len(_records(aws)) == 2 and len(_meta_schedules(world, run.run_id)) == 1  # the SQS-delayed one is not
    data = {"output": None} if end is EventType.RUN_COMPLETED else {}
    if end is EventType.RUN_FAILED:
        data = {"error": {"type": "E", "message": "m"}}
    world.append(run.run_id, [ev(end, **data)])
    assert aws.schedules() == []  # deleted, not left to fire
    assert [r["payload"]["B"] for r in _records(aws) if "payload" in r] == [b"soon"]  # only the SQS one is left
    assert _meta_schedules(world, run.run_id) == set()
    assert world.get_run(run.run_id).status.terminal


def test_a_schedule_already_gone_is_fine(aws: Aws) -> None:
    world = aws.world()
    run = create(world, started=True)
    events, deliveries = _timer(run.run_id, "wait:1", ids.utcnow() + timedelta(hours=2))
    world.append(run.run_id, events, deliveries=deliveries)
    (schedule,) = aws.schedules()
    aws.scheduler.delete_schedule(Name=schedule["Name"], GroupName="default")  # it ran and went, say
    assert world.append(run.run_id, [ev(EventType.RUN_CANCELLED)]).run.status is RunStatus.CANCELLED
    assert aws.schedules() == [] and _records(aws) == []


def test_a_delivered_timer_leaves_the_runs_schedules(aws: Aws, monkeypatch: pytest.MonkeyPatch) -> None:
    """The delivery of a timer acks its record: its id leaves the run's list, and the next timer's joins it."""
    world = aws.world()
    run = create(world, started=True)
    due = ids.utcnow() + timedelta(hours=2)
    events, deliveries = _timer(run.run_id, "wait:1", due)
    world.append(run.run_id, events, deliveries=deliveries)
    (first,) = _meta_schedules(world, run.run_id)
    assert aws.fire_due_schedules(due) == 1
    later = due + timedelta(seconds=1)
    monkeypatch.setattr(ids, "utcnow", lambda: later)
    (claimed,) = world.claim(["celery"], lease=30)
    events, deliveries = _timer(run.run_id, "wait:2", later + timedelta(hours=2))
    world.append(
        run.run_id, [ev(EventType.WAIT_COMPLETED, "wait:1"), *events], deliveries=deliveries, ack=claimed.receipt
    )
    (second,) = _meta_schedules(world, run.run_id)
    assert second != first and [s["Name"] for s in aws.schedules()] == [schedule_name(second)]
    world.append(run.run_id, [ev(EventType.RUN_CANCELLED)])
    assert aws.schedules() == [] and _records(aws) == []


def test_cancelling_a_sleeping_run_deletes_its_timer(aws: Aws) -> None:
    wf = Workflows(Celery("aws-schedules"), world=aws.world(), broker="app")

    @wf.workflow
    def nap() -> str:
        sleep(3 * 3600)
        return "rested"

    run = nap.start()
    worker = LocalWorker(wf)
    deadline = time.monotonic() + 30
    while not aws.schedules():
        assert time.monotonic() < deadline, "the run never reached its sleep"
        if not worker.run_once():
            time.sleep(0.02)
    (schedule,) = aws.schedules()
    assert schedule["ScheduleExpression"].startswith("at(")
    run.cancel()
    assert run.status is RunStatus.CANCELLED
    assert aws.schedules() == []
    assert not [r for r in _records(aws) if r.get("run_id", {}).get("S") == run.id and r["kind"]["S"] == "delivery"]
    wf.close()


def test_a_resend_gets_a_schedule_of_its_own(aws: Aws) -> None:
    """The Scheduler deletes a one-time schedule after it runs, not as it runs: a message it sent early is sent
    again while it may still exist. The re-send is a new schedule (named after the record's claim), not a
    ConflictException read as "already scheduled", which left the record without a message (issue #27, item 8)."""
    world = aws.world()
    due = ids.utcnow() + timedelta(hours=2)
    world.enqueue([Delivery("celery", b"later", run_id="wrun_resend", not_before=due)])
    (fired,) = aws.schedules()
    target = fired["Target"]
    aws.sqs.send_message(QueueUrl=aws.queue_url, MessageBody=target["Input"])  # fired early, not deleted yet
    assert world.claim(["celery"]) == []  # early: sent again
    names = sorted(s["Name"] for s in aws.schedules())
    assert len(names) == 2 and fired["Name"] in names
    aws.scheduler.delete_schedule(Name=fired["Name"], GroupName="default")  # the Scheduler gets round to it
    (resent,) = aws.schedules()  # the record still has a schedule that will bring its message
    assert resent["Name"] != fired["Name"] and resent["ScheduleExpression"] == fired["ScheduleExpression"]
    assert len(resent["Name"]) <= 64


def test_schedule_names_fit_the_scheduler() -> None:
    assert schedule_name("01J0000000000000000000000A") == "celery-workflow-01J0000000000000000000000A"
    assert schedule_name("01J0000000000000000000000A", 3) == "celery-workflow-01J0000000000000000000000A-3"
    odd = schedule_name("expire-" + "run:with/odd chars" * 10, 2)
    assert len(odd) <= 64 and odd.startswith("celery-workflow-") and odd.endswith("-2")
    assert all(c.isalnum() or c in "-_." for c in odd)
    assert odd == schedule_name("expire-" + "run:with/odd chars" * 10, 2)  # the same id, the same name
