"""Retention by time to live alone on the AWS World (issue #31, item 3): a run's end gives every item of its partition
the end of its retention (``expires_at``) in its own transaction, the items written before by updates, so no expiry
is queued (no ``QUEUE#expire-`` record, schedule, message or delete). Where that cannot serve, the seed's scheduled
expiry stays: a run that retains a token, one whose earlier items the append does not know (planned on fresh reads,
created by an earlier version, or with streams) and one whose earlier items do not fit in the transaction."""

from __future__ import annotations

import math
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner

from celery_workflow import Workflows, ids
from celery_workflow.aws_lambda import queue_handler
from celery_workflow.cli import workflow
from celery_workflow.errors import RunNotFound
from celery_workflow.events import EventType, RunStatus
from celery_workflow.testing._conformance import create, ev, eventually, hook_created, step_created
from celery_workflow.world_sqs import AWSWorld
from tests.integration.aws_fixtures import TABLE, Aws, aws_fixture, moto_fixture, summing_app  # noqa: F401
from tests.integration.test_aws_lambda import Context, invoke, sqs_event

HOUR = timedelta(hours=1)


def _partition(aws: Aws, run_id: str) -> dict[str, dict[str, Any]]:
    """Every item of the run's partition as stored (expired or not), by sort key."""
    items = aws.dynamodb.query(
        TableName=TABLE,
        KeyConditionExpression="pk = :pk",
        ExpressionAttributeValues={":pk": {"S": f"RUN#{run_id}"}},
    )["Items"]
    return {item["sk"]["S"]: item for item in items}


def _expiry(aws: Aws, run_id: str) -> dict[str, Any] | None:
    """The run's ``QUEUE#expire-<runId>`` record, if any."""
    key = {"pk": {"S": f"QUEUE#expire-{run_id}"}, "sk": {"S": "META"}}
    found: dict[str, Any] | None = aws.dynamodb.get_item(TableName=TABLE, Key=key).get("Item")
    return found


def _ttls(aws: Aws, run_id: str) -> dict[str, int | None]:
    return {sk: int(i["expires_at"]["N"]) if "expires_at" in i else None for sk, i in _partition(aws, run_id).items()}


def _due(end: Any, keep: timedelta = HOUR) -> int:
    return math.ceil((end.created_at + keep).timestamp())


@pytest.fixture
def wf(aws: Aws) -> Iterator[Workflows]:
    app = summing_app(aws.world(retention=HOUR), "ttl-app")
    yield app
    app.close()


def test_a_one_step_run_ends_with_every_item_timed_and_no_expiry(aws: Aws, wf: Workflows) -> None:
    """The bench's 1-step workflow through the Lambda handler: its end gives the run's items written before (the
    start's) its time to live in the end's transaction; no expiry record, schedule or message is left."""
    handler = queue_handler(wf)
    run = wf.start("sum_of", 1)
    while not run.status.terminal:
        event = sqs_event(aws)
        if event["Records"]:
            invoke(aws, handler, event, Context(60))
    assert run.result() == 0
    ttls = _ttls(aws, run.id)
    end = wf.world.list_events(run.id)[-1]
    assert end.event_type is EventType.RUN_COMPLETED
    assert set(ttls.values()) == {_due(end)}, ttls  # every item, META and the start's events included
    assert _expiry(aws, run.id) is None
    assert aws.schedules() == []
    assert sqs_event(aws)["Records"] == []  # nothing queued


def test_a_run_end_on_its_kept_snapshot_times_its_earlier_items_and_waits(aws: Aws, monkeypatch: Any) -> None:
    """Several earlier appends (several EVENT# items) and a wait: the end updates each earlier item (and deletes the
    wait, as every end does); readers take the run as gone past its TTL."""
    world = aws.world(retention=HOUR)
    run = create(world, started=True)
    world.append(run.run_id, [step_created("s1")])
    world.append(run.run_id, [ev(EventType.STEP_STARTED, "s1", attempt=1)])
    world.append(run.run_id, [ev(EventType.WAIT_CREATED, "w1", resume_at="2999-01-01T00:00:00+00:00")])
    assert "WAIT#w1" in _partition(aws, run.run_id)
    world.get_run_with_events(run.run_id)  # a delivery's read: the end is planned on it
    (end,) = world.append(run.run_id, [ev(EventType.RUN_COMPLETED, output=1)]).events
    ttls = _ttls(aws, run.run_id)
    assert sorted(ttls) == ["EVENT#" + f"{slot:026d}" for slot in range(2, 7)] + ["META"]  # the wait deleted
    assert set(ttls.values()) == {_due(end)}, ttls
    assert _expiry(aws, run.run_id) is None and aws.schedules() == []
    past = datetime.fromtimestamp(_due(end) + 1, UTC)
    monkeypatch.setattr(ids, "utcnow", lambda: past)  # DynamoDB may still serve them: readers do not
    with pytest.raises(RunNotFound):
        world.get_run(run.run_id)
    assert world.list_runs().items == []
    with pytest.raises(RunNotFound):
        world.list_events(run.run_id)


def test_a_run_end_planned_on_fresh_reads_queues_the_expiry(aws: Aws) -> None:
    """An end that did not read the log (a CLI cancel, a dead letter's failure: World.append without a delivery's
    read) does not know the earlier items: the seed's expiry is queued, and only what the end writes is timed."""
    world = aws.world(retention=HOUR)
    run = create(world, started=True)
    (end,) = world.append(run.run_id, [ev(EventType.RUN_CANCELLED, reason="cli")]).events
    assert world.get_run(run.run_id).status is RunStatus.CANCELLED
    assert _expiry(aws, run.run_id) is not None
    assert [s["Name"] for s in aws.schedules()] == [f"celery-workflow-expire-{run.run_id}"]
    ttls = _ttls(aws, run.run_id)
    assert ttls[f"EVENT#{2:026d}"] is None and ttls["META"] == _due(end)


def test_a_run_that_retains_a_token_keeps_the_scheduled_expiry(aws: Aws) -> None:
    world = aws.world(retention=HOUR)
    run = create(world, started=True)
    until = ids.utcnow() + 2 * HOUR
    world.append(run.run_id, [hook_created("h", "tok-ttl", token_retention_until=ids.isoformat(until))])
    world.get_run_with_events(run.run_id)
    world.append(run.run_id, [ev(EventType.RUN_COMPLETED, output=1)])
    assert _expiry(aws, run.run_id) is not None
    assert [s["Name"] for s in aws.schedules()] == [f"celery-workflow-expire-{run.run_id}"]
    assert all(ttl is None for ttl in _ttls(aws, run.run_id).values())  # its expiry deletes them (it needs META)


def test_a_run_whose_earlier_items_do_not_fit_the_transaction_queues_the_expiry(aws: Aws) -> None:
    """100 earlier EVENT# items need 100 updates beside the end's own actions: more than a transaction takes."""
    world = aws.world(retention=HOUR)
    run = create(world, started=True)
    for i in range(99):
        world.append(run.run_id, [step_created(f"s{i}")])
    world.get_run_with_events(run.run_id)
    (end,) = world.append(run.run_id, [ev(EventType.RUN_COMPLETED, output=1)]).events
    assert _expiry(aws, run.run_id) is not None
    ttls = _ttls(aws, run.run_id)
    assert ttls["META"] == _due(end) and ttls[f"EVENT#{2:026d}"] is None


def test_a_run_an_earlier_version_created_queues_the_expiry(aws: Aws) -> None:
    """A run without META ``run_created`` (an earlier version's: it may have STEP# items the log does not name)."""
    world = aws.world(retention=HOUR)
    run = create(world, started=True)
    aws.dynamodb.update_item(
        TableName=TABLE,
        Key={"pk": {"S": f"RUN#{run.run_id}"}, "sk": {"S": "META"}},
        UpdateExpression="REMOVE run_created",
    )
    world.get_run_with_events(run.run_id)
    world.append(run.run_id, [ev(EventType.RUN_COMPLETED, output=1)])
    assert _expiry(aws, run.run_id) is not None


def test_a_run_with_a_stream_queues_the_expiry_and_a_later_stream_takes_the_ttl(aws: Aws) -> None:
    """A stream's first write names it in META ``streams``: an end planned before it is refused by its condition and
    planned again (fresh: the expiry queued). A stream first written after a TTL-only end takes the run's TTL."""
    world = aws.world(retention=HOUR)
    run = create(world, started=True)
    world.get_run_with_events(run.run_id)
    world.streams.write(run.run_id, "out", [b"a", b"b"])  # after the delivery's read
    world.append(run.run_id, [ev(EventType.RUN_COMPLETED, output=1)])
    assert _expiry(aws, run.run_id) is not None

    other = create(world, started=True)
    world.get_run_with_events(other.run_id)
    (end,) = world.append(other.run_id, [ev(EventType.RUN_COMPLETED, output=1)]).events
    assert _expiry(aws, other.run_id) is None
    world.streams.write(other.run_id, "late", [b"x"])
    world.streams.close(other.run_id, "closed-empty")
    assert set(_ttls(aws, other.run_id).values()) == {_due(end)}
    assert [c.data for c in world.streams.read(other.run_id, "late").chunks] == [b"x"]


def test_a_stream_closed_before_anything_is_written_names_it_in_meta(aws: Aws) -> None:
    world = aws.world(retention=HOUR)
    run = create(world, started=True)
    world.streams.close(run.run_id, "empty")
    world.streams.close(run.run_id, "empty")  # closing again changes nothing
    meta = _partition(aws, run.run_id)["META"]
    assert meta["streams"] == {"SS": ["empty"]}
    page = world.streams.read(run.run_id, "empty")
    assert (page.chunks, page.closed) == ([], True)
    world.get_run_with_events(run.run_id)
    world.append(run.run_id, [ev(EventType.RUN_COMPLETED, output=1)])
    assert _expiry(aws, run.run_id) is not None  # it has stream items: the seed's expiry deletes them


def test_a_kept_world_with_no_retention_writes_no_ttl(aws: Aws) -> None:
    world: AWSWorld = aws.world()
    run = create(world, started=True)
    world.get_run_with_events(run.run_id)
    world.append(run.run_id, [ev(EventType.RUN_COMPLETED, output=1)])
    assert all(ttl is None for ttl in _ttls(aws, run.run_id).values())
    assert _expiry(aws, run.run_id) is None


def test_a_lengthened_retention_reaches_runs_whose_end_queued_no_expiry(aws: Aws) -> None:
    """No expiry comes back to a run ended by time to live alone: ``outlive_runs`` gives the later time to live to
    every item of the ended runs whose retention was lengthened since (and leaves the others)."""
    world = aws.world(retention=HOUR)
    ended = create(world, started=True)
    running = create(world, started=True)
    world.get_run_with_events(ended.run_id)
    (end,) = world.append(ended.run_id, [ev(EventType.RUN_COMPLETED, output=1)]).events
    assert _expiry(aws, ended.run_id) is None
    longer = aws.world(retention=3 * HOUR)

    def listed() -> list[str] | None:  # the index is eventually consistent
        runs = [r.run_id for r in longer.list_runs().items]
        return runs if ended.run_id in runs else None

    eventually(listed, timeout=10, interval=0.05)
    assert longer.outlive_runs(workflow="wf-other") == 0
    wf = Workflows(Celery("outlive"), world=longer, broker="app")  # the operator's command: celery -A app workflow …
    try:
        result = CliRunner().invoke(workflow, ["outlive-runs"], obj=SimpleNamespace(app=wf.celery_app))
    finally:
        wf.close()
    assert (result.exit_code, result.stdout) == (0, "extended 1 run\n"), result.output
    assert set(_ttls(aws, ended.run_id).values()) == {_due(end, 3 * HOUR)}
    assert all(ttl is None for ttl in _ttls(aws, running.run_id).values())
    assert longer.outlive_runs() == 0  # done already
    assert world.outlive_runs(workflow=world.get_run(ended.run_id).workflow_name) == 0  # a shorter one changes nothing
