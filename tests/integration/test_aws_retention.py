"""Retention on the AWS World (seed aws-world.txt, "Retention") on a real moto server: an expiry delivery that
arrives before the run is due to expire is deferred (its ``QUEUE#expire-<runId>`` record kept, due later), never
lost; a run holding a token whose retention has not ended is kept until it ends."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime, timedelta

import pytest

from celery_workflow import ids
from celery_workflow._aws.queue import Record
from celery_workflow._aws.table import TTL_ATTRIBUTE
from celery_workflow.errors import HookNotFound, RunNotFound
from celery_workflow.events import EventType, RunStatus
from celery_workflow.testing._conformance import create, ev, eventually, hook_created, step_created
from celery_workflow.world_sqs import AWSWorld, create_table
from tests.integration.aws_fixtures import Aws, aws_fixture, moto_fixture  # noqa: F401

_EXPIRE = "celery-workflow-expire-"


def _expired(world: AWSWorld, run_id: str) -> bool | None:
    """Claim what is due (expiry deliveries are handled inside the World); True once the run is gone."""
    world.claim(["celery"], limit=10)
    try:
        world.get_run(run_id)
    except RunNotFound:
        return True
    return None


def _scheduled(aws: Aws, world: AWSWorld) -> list[str] | None:
    world.claim(["celery"], limit=10)
    names = [s["Name"] for s in aws.schedules() if s["Name"].startswith(_EXPIRE)]
    return names or None


def test_an_expiry_that_arrives_early_is_deferred_and_happens_later(aws: Aws, monkeypatch: pytest.MonkeyPatch) -> None:
    short = aws.world(retention=timedelta(seconds=1))
    run = create(short, run_id="wrun_deferred", started=True)
    short.append(run.run_id, [ev(EventType.RUN_COMPLETED, output=1)])  # its expiry is due in a second
    longer = aws.world(retention=timedelta(hours=1))  # the retention was lengthened meanwhile
    (name,) = eventually(lambda: _scheduled(aws, longer), timeout=15, interval=0.1)
    assert name.startswith(f"{_EXPIRE}wrun_deferred")  # a re-send may name its schedule apart
    assert longer.get_run(run.run_id).status is RunStatus.COMPLETED  # deferred: an hour after the run's end
    later = ids.utcnow() + timedelta(hours=2)
    assert aws.fire_due_schedules(later) == 1
    monkeypatch.setattr(ids, "utcnow", lambda: later)  # two hours pass
    eventually(lambda: _expired(longer, run.run_id), timeout=15, interval=0.1)


def test_a_run_that_retains_a_token_expires_when_the_retention_ends(aws: Aws, monkeypatch: pytest.MonkeyPatch) -> None:
    world = aws.world(retention=timedelta(seconds=1))
    retains, plain = (
        create(world, run_id="wrun_retains", started=True),
        create(world, run_id="wrun_plain", started=True),
    )
    until = ids.utcnow() + timedelta(hours=1)
    world.append(retains.run_id, [hook_created("h", "tok-kept", token_retention_until=ids.isoformat(until))])
    for run in (retains, plain):
        world.append(run.run_id, [ev(EventType.RUN_COMPLETED, output=1)])
    eventually(lambda: _expired(world, plain.run_id), timeout=15, interval=0.1)  # a second after its end
    assert [s["Name"] for s in aws.schedules()] == [f"{_EXPIRE}wrun_retains"]  # when the retention ends
    assert world.get_run(retains.run_id).status is RunStatus.COMPLETED
    claimant = create(world, started=True)
    (conflict,) = world.append(claimant.run_id, [hook_created("a", "tok-kept")]).events
    assert conflict.event_type is EventType.HOOK_CONFLICT and conflict.data["conflicting_run_id"] == retains.run_id
    # a delivery of the expiry before the retention ends (here: the schedule fired early) defers it again
    assert aws.fire_due_schedules(until) == 1
    eventually(lambda: _scheduled(aws, world), timeout=15, interval=0.1)
    assert world.get_run(retains.run_id).status is RunStatus.COMPLETED
    later = until + timedelta(seconds=2)
    assert aws.fire_due_schedules(later) == 1
    monkeypatch.setattr(ids, "utcnow", lambda: later)  # the retention has ended
    eventually(lambda: _expired(world, retains.run_id), timeout=15, interval=0.1)
    with pytest.raises(HookNotFound, match="no live hook owns"):  # its holding went with it
        world.get_hook_by_token("tok-kept")
    (created,) = world.append(claimant.run_id, [hook_created("b", "tok-kept")]).events
    assert created.event_type is EventType.HOOK_CREATED


# -- time to live (issue #31, item 3) --------------------------------------------------------------------------------


def _partition(aws: Aws, run_id: str) -> dict[str, dict[str, object]]:
    """Every item of the run's partition as stored (expired or not), by sort key."""
    items = aws.dynamodb.query(
        TableName="workflow",
        KeyConditionExpression="pk = :pk",
        ExpressionAttributeValues={":pk": {"S": f"RUN#{run_id}"}},
    )["Items"]
    return {item["sk"]["S"]: item for item in items}


def test_the_table_has_time_to_live_on_expires_at(aws: Aws) -> None:
    ttl = aws.dynamodb.describe_time_to_live(TableName="workflow")["TimeToLiveDescription"]
    assert (ttl["TimeToLiveStatus"], ttl["AttributeName"]) == ("ENABLED", TTL_ATTRIBUTE)
    create_table(aws.dynamodb, "workflow", poll=0.05)  # an enabled one is left as it is


def test_a_run_end_writes_its_time_to_live_and_the_expiry_deletes_only_the_rest(
    aws: Aws, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The append that ends a run writes the end of its retention as the TTL of every item it writes (the view, its
    events and views): DynamoDB deletes those for free. The expiry deletes the items written before (by one
    BatchWriteItem) and leaves the others, which readers take as gone from then on."""
    world = aws.world(retention=timedelta(hours=1))
    run = create(world, started=True)
    world.append(run.run_id, [step_created("s1")])
    world.append(run.run_id, [ev(EventType.STEP_STARTED, "s1", attempt=1)])
    (end,) = world.append(run.run_id, [ev(EventType.RUN_COMPLETED, output=1)]).events
    due = math.ceil((end.created_at + timedelta(hours=1)).timestamp())
    items = _partition(aws, run.run_id)
    timed = {sk for sk, item in items.items() if TTL_ATTRIBUTE in item}
    assert timed == {"META", f"EVENT#{end.slot:026d}"}
    assert {int(items[sk][TTL_ATTRIBUTE]["N"]) for sk in timed} == {due}  # type: ignore[index]
    assert world.get_run(run.run_id).status is RunStatus.COMPLETED  # kept for the retention
    later = ids.utcnow() + timedelta(hours=2)
    monkeypatch.setattr(ids, "utcnow", lambda: later)
    expire = Record(f"expire-{run.run_id}", "celery", b"", run.run_id, later, "expire")
    assert world.expire_run(expire) is None
    assert set(_partition(aws, run.run_id)) == timed  # left to DynamoDB's time to live
    past = datetime.fromtimestamp(due + 1, UTC)
    monkeypatch.setattr(ids, "utcnow", lambda: past)  # past it: gone for readers, though DynamoDB may serve it
    with pytest.raises(RunNotFound):
        world.get_run(run.run_id)
    assert world.list_runs().items == []


def test_items_past_their_time_to_live_are_gone_for_readers(aws: Aws) -> None:
    """DynamoDB deletes expired items within days and serves them meanwhile: every read leaves them out."""
    world = aws.world()
    run = create(world, started=True)
    world.append(run.run_id, [step_created("s1")])

    def expire(sk: str) -> None:
        aws.dynamodb.update_item(
            TableName="workflow",
            Key={"pk": {"S": f"RUN#{run.run_id}"}, "sk": {"S": sk}},
            UpdateExpression="SET expires_at = :t",
            ExpressionAttributeValues={":t": {"N": str(int(time.time()) - 60)}},
        )

    expire(f"EVENT#{3:026d}")
    assert [e.slot for e in world.list_events(run.run_id)] == [1, 2]
    assert world.list_steps(run.run_id) == []
    expire("META")
    with pytest.raises(RunNotFound):
        world.get_run(run.run_id)
    with pytest.raises(RunNotFound):
        world.get_run_with_events(run.run_id)
    assert world.list_runs().items == []
