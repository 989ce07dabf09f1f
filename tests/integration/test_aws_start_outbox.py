"""A run's start on the AWS World has no ``QUEUE#`` record: the pending run's META is its outbox, its message carries
the payload, and the outbox sweep sends a start its writer never sent (issue #31; celery_workflow._aws.starts)."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest

from celery_workflow import Workflows, ids
from celery_workflow._aws import starts as starts_module
from celery_workflow._aws.items import item_size
from celery_workflow._aws.queue import Receipt
from celery_workflow.app import decode_message
from celery_workflow.aws_lambda import queue_handler
from celery_workflow.errors import WorldUnavailable
from celery_workflow.events import EventType
from celery_workflow.world import Delivery, NewRun
from celery_workflow.world_sqs import AWSConfig
from tests.integration.aws_fixtures import TABLE, Aws, aws_fixture, moto_fixture, summing_app  # noqa: F401
from tests.integration.test_aws_lambda import Context, invoke, sqs_event


def _items(aws: Aws) -> list[dict[str, Any]]:
    return list(aws.dynamodb.scan(TableName=TABLE, ConsistentRead=True)["Items"])


def _queue_records(aws: Aws) -> list[dict[str, Any]]:
    return [i for i in _items(aws) if i["pk"]["S"].startswith("QUEUE#")]


def _meta(aws: Aws, run_id: str) -> dict[str, Any]:
    return dict(aws.dynamodb.get_item(TableName=TABLE, Key={"pk": {"S": f"RUN#{run_id}"}, "sk": {"S": "META"}})["Item"])


def _drive(aws: Aws, wf: Workflows, run: Any) -> None:
    handler = queue_handler(wf)
    for _ in range(50):
        if run.status.terminal:
            return
        event = sqs_event(aws)
        if event["Records"]:
            invoke(aws, handler, event, Context(60))
    raise AssertionError(f"run {run.id} did not end: {run.status}")


def _step_events(run: Any) -> list[EventType]:
    return [e.event_type for e in run.events()]


ONE_STEP = [
    EventType.RUN_CREATED,
    EventType.RUN_STARTED,
    EventType.STEP_CREATED,
    EventType.STEP_STARTED,
    EventType.STEP_COMPLETED,
    EventType.RUN_COMPLETED,
]


def test_a_start_writes_no_queue_record_and_its_meta_holds_it_until_done(aws: Aws) -> None:
    world = aws.world()
    deadline = ids.utcnow() + timedelta(hours=1)
    world.create_run(
        NewRun("wrun_nostart", "wf", {"args": [], "kwargs": {}}),
        [
            Delivery("celery", b"start", run_id="wrun_nostart"),
            Delivery("celery", b"deadline", run_id="wrun_nostart", not_before=deadline),
        ],
    )
    (record,) = _queue_records(aws)  # the deadline's delivery keeps its record; the start has none
    assert record["run_id"]["S"] == "wrun_nostart" and "start" not in record
    meta = _meta(aws, "wrun_nostart")
    assert "start" in meta and "start_z" not in meta and "start_queue" not in meta  # sent: only "not done" is left
    (claimed,) = world.claim(["celery"], lease=30)
    assert claimed.payload == b"start" and claimed.run_id == "wrun_nostart" and claimed.attempts == 1
    receipt = Receipt.parse(claimed.receipt)
    assert receipt.start and receipt.id == "wrun_nostart" and Receipt.parse(str(receipt)) == receipt
    world.ack(claimed.receipt)
    assert "start" not in _meta(aws, "wrun_nostart")
    assert world.claim(["celery"]) == []


def test_a_one_step_run_leaves_no_queue_record_of_its_start(aws: Aws) -> None:
    wf = summing_app(aws.world(), "start-app")
    try:
        run = wf.start("sum_of", 1)
        assert _queue_records(aws) == []
        _drive(aws, wf, run)
        assert run.result() == 0 and _step_events(run) == ONE_STEP
        assert "start" not in _meta(aws, run.id)  # the delivery's append acked the start in its META update
    finally:
        wf.close()


def test_a_new_runs_meta_with_its_unsent_start_is_billed_as_one_kilobyte(
    aws: Aws, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start's Celery message (about 960 bytes) deflated against the preset dictionary keeps a new run's META
    within 1 KB: its transactional put is 2 write units, not 4, and the clean-up after the send 1, not 2."""
    world = aws.world()
    wf = summing_app(world, "small-meta-app")
    try:
        monkeypatch.setattr(world.queue, "send_body", lambda *a, **k: (_ for _ in ()).throw(WorldUnavailable("gone")))
        with pytest.raises(WorldUnavailable):
            wf.start("sum_of", 3, run_id="wrun_small_meta")
        meta = _meta(aws, "wrun_small_meta")
        assert item_size(meta) <= 1024
        message = decode_message(starts_module.inflate(meta["start_z"]["B"]))
        assert (message.name, message.args) == ("workflow.sum_of", ["wrun_small_meta"])
    finally:
        wf.close()


def test_a_lost_start_is_sent_by_the_sweep_and_the_run_completes(aws: Aws, monkeypatch: pytest.MonkeyPatch) -> None:
    world = aws.world()
    wf = summing_app(world, "lost-start-app")
    try:
        original = world.queue.send_body
        monkeypatch.setattr(world.queue, "send_body", lambda *a, **k: (_ for _ in ()).throw(WorldUnavailable("gone")))
        with pytest.raises(WorldUnavailable):
            wf.start("sum_of", 2, run_id="wrun_lost_start")
        monkeypatch.setattr(world.queue, "send_body", original)
        run = wf.get_run("wrun_lost_start")
        assert "start_z" in _meta(aws, run.id)  # committed, unsent: META holds it
        assert sqs_event(aws)["Records"] == []
        before = ids.utcnow() - timedelta(minutes=1)
        assert world.sweep_outbox(before, ids.utcnow()) == 1
        assert "start_z" not in _meta(aws, run.id)
        assert world.sweep_outbox(before, ids.utcnow()) == 0  # sent once
        _drive(aws, wf, run)
        assert run.result() == 1
    finally:
        wf.close()


def test_the_workers_upkeep_sweeps_from_where_it_stopped(aws: Aws, monkeypatch: pytest.MonkeyPatch) -> None:
    world = aws.world()
    monkeypatch.setattr(starts_module, "SWEEP_GRACE", timedelta(0))
    monkeypatch.setattr(world.queue, "send_body", lambda *a, **k: (_ for _ in ()).throw(WorldUnavailable("gone")))
    with pytest.raises(WorldUnavailable):
        world.create_run(
            NewRun("wrun_upkeep", "wf", {"args": [], "kwargs": {}}), [Delivery("celery", b"s", run_id="wrun_upkeep")]
        )
    monkeypatch.undo()
    monkeypatch.setattr(starts_module, "SWEEP_GRACE", timedelta(0))
    sweeper = starts_module.OutboxSweeper(world.queue.starts, interval=3600)
    assert sweeper.sweep_once() == 1
    assert sweeper.sweep_once() == 0  # the next sweep starts where this one stopped
    assert [c.payload for c in world.claim(["celery"], lease=30)] == [b"s"]
    upkeep = world.start_upkeep()
    assert upkeep is not None
    upkeep.stop()


def test_a_duplicated_start_records_each_step_once(aws: Aws) -> None:
    world = aws.world()
    wf = summing_app(world, "dup-start-app")
    try:
        run = wf.start("sum_of", 3)
        (message,) = sqs_event(aws, visibility=60)["Records"]
        aws.sqs.send_message(QueueUrl=aws.queue_url, MessageBody=message["body"])  # SQS delivers it twice
        (copy,) = sqs_event(aws, visibility=60)["Records"]
        handler = queue_handler(wf)
        results: list[Any] = []
        threads = [
            threading.Thread(target=lambda m=m: results.append(invoke(aws, handler, {"Records": [m]}, Context(60))))
            for m in (message, copy)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        _drive(aws, wf, run)
        assert run.result() == 3
        events = _step_events(run)
        assert events.count(EventType.STEP_COMPLETED) == 3 and events.count(EventType.RUN_STARTED) == 1
        assert len({e.slot for e in run.events()}) == len(events)
        # a later copy of the start finds it done and is acknowledged unrun
        aws.sqs.send_message(QueueUrl=aws.queue_url, MessageBody=message["body"])
        late = sqs_event(aws)
        assert world.accept_message(late["Records"][0]) is None
        assert len(run.events()) == len(events)
    finally:
        wf.close()


def test_a_start_of_an_earlier_version_with_its_queue_record_still_runs(aws: Aws) -> None:
    world = aws.world()
    wf = summing_app(world, "old-start-app")
    try:
        run_id, queue = "wrun_old_layout", wf.runtime.queue_for("sum_of")
        world.create_run(NewRun(run_id, "sum_of", {"args": [0], "kwargs": {}}, queue))  # no start in its META
        first = wf.runtime.dispatcher.workflow_delivery(
            run_id, "sum_of", queue, not_before=None, idempotency_key="wake"
        )
        world.enqueue([first])  # an earlier version's start: a QUEUE# record and a message pointing at it
        assert len(_queue_records(aws)) == 1 and "start" not in _meta(aws, run_id)
        run = wf.get_run(run_id)
        _drive(aws, wf, run)
        assert run.result() == 0
        assert _queue_records(aws) == []
    finally:
        wf.close()


def test_start_records_keep_the_earlier_layout_for_a_rolling_upgrade(aws: Aws) -> None:
    world = aws.world(start_records=True)
    world.create_run(
        NewRun("wrun_upgrade", "wf", {"args": [], "kwargs": {}}), [Delivery("celery", b"s", run_id="wrun_upgrade")]
    )
    assert len(_queue_records(aws)) == 1 and "start" not in _meta(aws, "wrun_upgrade")
    (claimed,) = world.claim(["celery"], lease=30)  # what an earlier version's worker can receive
    assert claimed.payload == b"s" and not Receipt.parse(claimed.receipt).start
    world.ack(claimed.receipt)
    assert _queue_records(aws) == []
    assert AWSConfig.from_env(
        {"WORKFLOW_TABLE": TABLE, "WORKFLOW_QUEUE_URL": aws.queue_url, "WORKFLOW_START_RECORDS": "1"}
    ).start_records
