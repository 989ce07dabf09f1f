"""The AWS World writes the events of one append as one item (issue #31, item 2): ``EVENT#<first slot>`` holding the
append's events, several items at consecutive first slots when they do not fit in one; the log reads the same by slot,
from a slot inside an item, and whole; items of earlier versions (one event each) are read as packs of one."""

from __future__ import annotations

from typing import Any

import pytest

from celery_workflow import ids
from celery_workflow._aws.items import item_size
from celery_workflow._aws.log import events_of, pack_items
from celery_workflow._aws.table import MAX_ITEM_BYTES
from celery_workflow.errors import EventTooLarge
from celery_workflow.events import Event, EventType
from celery_workflow.testing._conformance import create, ev, step_created
from tests.integration.aws_fixtures import TABLE, Aws, aws_fixture, moto_fixture  # noqa: F401
from tests.integration.aws_legacy import rewrite_as_single_events


def event_items(aws: Aws, run_id: str) -> list[dict[str, Any]]:
    return aws.dynamodb.query(
        TableName=TABLE,
        KeyConditionExpression="pk = :pk AND begins_with(sk, :e)",
        ExpressionAttributeValues={":pk": {"S": f"RUN#{run_id}"}, ":e": {"S": "EVENT#"}},
        ConsistentRead=True,
    )["Items"]


def steps(*ids_: str) -> list[Any]:
    out = []
    for sid in ids_:
        out += [step_created(sid), ev(EventType.STEP_STARTED, sid), ev(EventType.STEP_COMPLETED, sid, result=sid)]
    return out


def test_an_appends_events_are_one_item(aws: Aws) -> None:
    world = aws.world()
    run = create(world, started=True)
    world.append(run.run_id, steps("a", "b"))
    items = event_items(aws, run.run_id)
    # run_created (slot 1) is kept in the run's META (issue #31, item 3): the log's items begin at slot 2
    assert [i["sk"]["S"] for i in items] == [f"EVENT#{n:026d}" for n in (2, 3)]
    assert [len(events_of(i)) for i in items] == [1, 6]
    log = world.list_events(run.run_id)
    assert [e.slot for e in log] == list(range(1, 9))
    assert [e.event_type for e in log[2:5]] == [
        EventType.STEP_CREATED,
        EventType.STEP_STARTED,
        EventType.STEP_COMPLETED,
    ]
    assert log[4].data == {"result": "a"} and log[4].correlation_id == "a"
    # from a slot inside the item, with and without a limit; the run's read for a delivery
    assert [e.slot for e in world.list_events(run.run_id, after_slot=4)] == [5, 6, 7, 8]
    assert [e.slot for e in world.list_events(run.run_id, after_slot=4, limit=2)] == [5, 6]
    assert [e.slot for e in world.list_events(run.run_id, after_slot=2, limit=1)] == [3]
    assert world.list_events(run.run_id, after_slot=8) == []
    view, read = world.get_run_with_events(run.run_id)
    assert read == log and view.event_count == 8


def test_events_that_do_not_fit_in_one_item_go_to_several(aws: Aws) -> None:
    world = aws.world()
    run = create(world, started=True)
    big = "x" * 150_000
    world.append(run.run_id, [step_created(f"s{i}", args=[big]) for i in range(5)])
    items = event_items(aws, run.run_id)
    sizes = [len(events_of(i)) for i in items[1:]]  # after run_started's (run_created is in META)
    assert sum(sizes) == 5 and len(sizes) > 1 and all(n >= 1 for n in sizes)
    firsts = [int(i["sk"]["S"][len("EVENT#") :]) for i in items[1:]]
    assert firsts == [3 + sum(sizes[:k]) for k in range(len(sizes))]  # consecutive first slots
    assert [e.slot for e in world.list_events(run.run_id)] == list(range(1, 8))
    assert [e.correlation_id for e in world.list_events(run.run_id, after_slot=3)] == ["s1", "s2", "s3", "s4"]


def test_an_event_too_large_for_an_item_by_itself_is_refused() -> None:
    now = ids.utcnow()
    huge = Event("r", 2, EventType.STEP_COMPLETED, "s", {"result": "x" * MAX_ITEM_BYTES}, now)
    with pytest.raises(EventTooLarge):
        pack_items([Event("r", 1, EventType.RUN_STARTED, None, {}, now), huge])


def test_a_pack_keeps_each_events_own_time() -> None:
    now = ids.utcnow()
    later = ids.from_micros(ids.to_micros(now) + 5)
    events = [
        Event("r", 4, EventType.RUN_STARTED, None, {}, now),
        Event("r", 5, EventType.RUN_STARTED, None, {}, later),
    ]
    (item,) = pack_items(events, "w1", ttl=123)
    assert events_of(item) == events and item["write_id"] == {"S": "w1"} and item["expires_at"] == {"N": "123"}


def test_a_log_written_by_an_earlier_version_reads_the_same(aws: Aws) -> None:
    """One item per event (the old attributes): read whole, by slot and from a slot, then appended to by this
    version (packs after single events) and read again: no migration."""
    world = aws.world()
    run = create(world, started=True)
    world.append(run.run_id, steps("a"))
    log = world.list_events(run.run_id)
    rewrite_as_single_events(aws.dynamodb, TABLE, run.run_id, log)
    assert len(event_items(aws, run.run_id)) == 5
    fresh = aws.world()
    assert fresh.list_events(run.run_id) == log
    assert fresh.list_events(run.run_id, after_slot=3) == log[3:]
    _, read = fresh.get_run_with_events(run.run_id)
    assert read == log
    fresh.append(run.run_id, steps("b"))  # planned on the kept snapshot of the old log
    aws.world().append(run.run_id, [ev(EventType.RUN_COMPLETED, output=2)])  # fresh reads of the old log
    whole = aws.world().list_events(run.run_id)
    assert whole[:5] == log and [e.slot for e in whole] == list(range(1, 10))
    assert [e.slot for e in aws.world().list_events(run.run_id, after_slot=4, limit=3)] == [5, 6, 7]
    assert aws.world().get_run(run.run_id).status.value == "completed"


def test_packs_are_filled_up_to_the_item_limit() -> None:
    now = ids.utcnow()
    events = [Event("r", 3 + i, EventType.STEP_COMPLETED, f"s{i}", {"result": "x" * 150_000}, now) for i in range(5)]
    items = pack_items(events, "w", ttl=5)
    assert [len(events_of(i)) for i in items] == [2, 2, 1]
    assert all(item_size(i) <= MAX_ITEM_BYTES for i in items)
    assert [e for i in items for e in events_of(i)] == events
