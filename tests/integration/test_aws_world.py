"""AWSWorld on a real moto server (DynamoDB, SQS, Scheduler): the World conformance suite, then what only AWS shows."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import botocore.awsrequest
import pytest
from celery import Celery

from celery_workflow import Workflows, cli, ids
from celery_workflow.app import build_message
from celery_workflow.aws_costs import item_size
from celery_workflow.errors import (
    ConfigurationError,
    EventInvalid,
    EventTooLarge,
    RunNotFound,
    WorldUnavailable,
)
from celery_workflow.events import EventType, RunStatus
from celery_workflow.testing._conformance import create, ev, eventually, hook_created, step_created
from celery_workflow.testing.conformance import WorldConformance
from celery_workflow.world import Delivery, NewRun, World, open_world
from celery_workflow.world_sqs import AWSConfig, AWSWorld, QueueConfig, SchedulerConfig, create_table
from tests.integration.aws_fixtures import REGION, ROLE_ARN, TABLE, Aws, aws_fixture, moto_fixture  # noqa: F401


class QueuesOnDemand(AWSWorld):
    """For the conformance suite, whose tests make up queue names: an unknown name gets a new SQS queue (a real AWS
    World only knows the queues of its config)."""

    def __init__(self, aws: Aws, **config: Any) -> None:
        super().__init__(aws.config(**config), aws.dynamodb, aws.sqs)
        self._aws = aws
        self._made: dict[str, QueueConfig] = {}

    def queue_config(self, name: str) -> QueueConfig:
        try:
            return super().queue_config(name)
        except ConfigurationError:
            if name not in self._made:
                self._made[name] = self._aws.queue(name)
            return self._made[name]


class TestAWSWorld(WorldConformance):
    @pytest.fixture
    def world(self, aws: Aws) -> Iterator[World]:
        w = QueuesOnDemand(aws)
        yield w
        w.close()


# -- configuration -------------------------------------------------------------------------------------------------


class Bomb:
    """A client that fails the test on any call."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the constructor called AWS ({name})")


def test_the_constructor_makes_no_aws_call(aws: Aws) -> None:
    world = AWSWorld(aws.config(), Bomb(), Bomb())
    assert world.queue_names == frozenset({"celery"}) and world.capabilities.lacking()


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"routes": {"nightly": "backfill"}}, "routes['nightly']"),
        ({"queues": {"ordered": QueueConfig("https://q/ordered.fifo", "arn:q", fifo=True)}, "scheduler": None},
         "queues['ordered']"),
        ({"queues": {"ordered": QueueConfig("https://q/ordered.fifo", None, fifo=True)}}, "queues['ordered'].arn"),
        ({"queues": {"backfill": QueueConfig("https://q/backfill")}}, "queues['backfill'].arn"),
        ({"retention": timedelta(hours=1), "scheduler": None}, "retention"),
        ({"retentions": {"audit": timedelta(days=1)}, "scheduler": None}, "retentions['audit']"),
        ({"table_name": ""}, "table_name"),
        ({"table_name": "  "}, "table_name"),
        ({"queue_url": ""}, "queue_url"),
        ({"queue_url": "https://sqs.us-east-1.amazonaws.com/1/tasks.fifo"}, "queue_url"),
        ({"base_url": ""}, "base_url"),
        ({"control_url": " "}, "control_url"),
        ({"default_queue": ""}, "default_queue"),
        ({"queues": {"": QueueConfig("https://q/x", "arn:x")}}, "queues"),
        ({"queues": {"celery": QueueConfig("https://q/x", "arn:x")}}, "queues['celery']"),
        ({"queues": {"backfill": QueueConfig("", "arn:x")}}, "queues['backfill'].url"),
        ({"queues": {"backfill": QueueConfig("https://q/b", "")}}, "queues['backfill'].arn"),
        ({"queues": {"backfill": QueueConfig("https://q/b", "arn:b")}, "routes": {"": "backfill"}}, "routes"),
        ({"scheduler": SchedulerConfig(object(), "", ROLE_ARN)}, "scheduler.target_arn"),
        ({"scheduler": SchedulerConfig(object(), "arn:q", "")}, "scheduler.role_arn"),
        ({"scheduler": SchedulerConfig(object(), "arn:q", ROLE_ARN, "")}, "scheduler.group"),
    ],
)  # fmt: skip
def test_configuration_errors_name_the_field(aws: Aws, settings: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        aws.config(**settings)
    assert str(info.value).startswith(field)


def test_a_valid_configuration_routes_and_knows_its_queues(aws: Aws) -> None:
    backfill = aws.queue("backfill")
    world = aws.world(queues={"backfill": backfill}, routes={"nightly": "backfill"}, retention=timedelta(days=30))
    assert world.queue_names == {"celery", "backfill"} and world.routes == {"nightly": "backfill"}
    with pytest.raises(ConfigurationError, match="no SQS queue named 'nowhere'"):
        world.enqueue([Delivery("nowhere", b"x")])
    wf = Workflows(Celery("aws-config"), world=world, broker="app")
    assert wf.routes == {"nightly": "backfill"}
    # the config's base_url (WORKFLOW_BASE_URL) builds webhook URLs, unless Workflows is given its own
    assert wf.base_url == wf.runtime.base_url == "https://workflows.example.com/v1/workflow"
    own = Workflows(Celery("aws-own"), world=world, broker="app", base_url="https://elsewhere/v1")
    assert own.runtime.base_url == "https://elsewhere/v1"
    with pytest.raises(ConfigurationError, match="does not have"):
        wf.route("x", "nowhere")


def test_from_env_reads_the_terraform_environment(aws: Aws, monkeypatch: pytest.MonkeyPatch) -> None:
    ordered = aws.queue("ordered.fifo", fifo=True)
    env = {
        "AWS_ENDPOINT_URL": aws.endpoint,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "WORKFLOW_TABLE": TABLE,
        "WORKFLOW_QUEUE_URL": aws.queue_url,
        "WORKFLOW_QUEUE_ARN": aws.queue_arn,
        "WORKFLOW_QUEUES": json.dumps({"ordered": {"url": ordered.url, "arn": ordered.arn, "fifo": True}}),
        "WORKFLOW_SCHEDULER_GROUP": "default",
        "WORKFLOW_SCHEDULER_ROLE_ARN": ROLE_ARN,
        "WORKFLOW_BASE_URL": "https://example.com/v1/workflow",
        "WORKFLOW_CONTROL_URL": "redis://127.0.0.1:6379/0",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = AWSConfig.from_env()
    assert config.queues == {"ordered": ordered} and config.scheduler is not None
    assert (config.scheduler.target_arn, config.scheduler.role_arn) == (aws.queue_arn, ROLE_ARN)
    assert config.control_url == "redis://127.0.0.1:6379/0" and config.base_url == "https://example.com/v1/workflow"
    world = open_world("aws://")  # clients built with no arguments: AWS_ENDPOINT_URL points them at moto
    assert isinstance(world, AWSWorld) and world.queue_names == {"celery", "ordered"}
    _, created = world.create_run(NewRun("env-run", "wf", {"args": [], "kwargs": {}}))
    assert created and world.get_run("env-run").event_count == 1
    out = io.StringIO()
    assert cli.main(["create-table", "made-by-the-cli"], out=out) == 0  # the same clients, from the environment
    assert aws.dynamodb.describe_table(TableName="made-by-the-cli")["Table"]["TableStatus"] == "ACTIVE"
    assert "is active" in out.getvalue()
    assert cli.main(["--world", "aws://", "runs", "list"], out=out) == 0 and "env-run" in out.getvalue()
    monkeypatch.delenv("WORKFLOW_TABLE")
    with pytest.raises(ConfigurationError, match="WORKFLOW_TABLE"):
        AWSConfig.from_env()
    with pytest.raises(ConfigurationError, match="aws://"):
        AWSWorld.from_url("aws://somewhere/else")


# -- the table -----------------------------------------------------------------------------------------------------


def _keys(aws: Aws) -> set[tuple[str, str]]:
    items = aws.dynamodb.scan(TableName=TABLE)["Items"]
    return {(i["pk"]["S"], i["sk"]["S"]) for i in items}


def test_the_table_is_laid_out_as_the_seed_says(aws: Aws) -> None:
    world = aws.world()
    run = create(world, run_id="wrun_layout", started=True)
    world.append(
        run.run_id,
        [step_created("step:a:1"), hook_created("hook:1", "tok-layout"), ev(EventType.WAIT_CREATED, "wait:1",
                                                                           resume_at=ids.isoformat(ids.utcnow()))],
        deliveries=[Delivery("celery", b"m", run_id=run.run_id)],
    )  # fmt: skip
    world.write_stream(run.run_id, "progress", [b"j1" + b"1"])
    keys = _keys(aws)
    record = next(pk for pk, _ in keys if pk.startswith("QUEUE#"))
    assert keys == {
        ("RUN#wrun_layout", "META"),
        *{("RUN#wrun_layout", f"EVENT#{n:026d}") for n in (2, 3)},  # the append of three events: one item
        # (run_created, slot 1, is kept in META: issue #31, item 3)
        ("RUN#wrun_layout", "WAIT#wait:1"),
        ("RUN#wrun_layout", "STREAM#cHJvZ3Jlc3M"),
        ("RUN#wrun_layout", "CHUNK#cHJvZ3Jlc3M#0000000000"),
        ("HOOK#wrun_layout#hook:1", "META"),  # hook ids are per run: the key carries the run id
        ("TOKEN#tok-layout", "META"),
        (record, "META"),
    }
    listed = aws.dynamodb.query(
        TableName=TABLE,
        IndexName="list_group",
        KeyConditionExpression="list_group_pk = :k",
        ExpressionAttributeValues={":k": {"S": "HOOKS#wrun_layout"}},
    )["Items"]
    assert [i["pk"]["S"] for i in listed] == ["HOOK#wrun_layout#hook:1"]
    description = aws.dynamodb.describe_table(TableName=TABLE)["Table"]
    assert {i["IndexName"]: i["Projection"] for i in description["GlobalSecondaryIndexes"]} == {
        "list": {"ProjectionType": "INCLUDE", "NonKeyAttributes": ["status"]},
        "list_group": {"ProjectionType": "KEYS_ONLY"},  # its readers take the status from META
    }
    create_table(aws.dynamodb, TABLE)  # an existing table is waited for, not an error


def test_a_record_keeps_a_celery_message_compressed_under_one_write_unit(aws: Aws) -> None:
    """A record is put once and deleted once, each billed per started KB (twice in a transaction): a ~1 KB Celery
    message compressed keeps both at the minimum. A payload that does not compress is kept as it is."""
    world = aws.world()
    app = Celery("records")
    message = build_message(app, "celery_workflow.run", [], {"run_id": "wrun_" + "r" * 26}, queue="celery",
                            task_id=ids.ulid())  # fmt: skip
    noise = os.urandom(300)
    world.enqueue([Delivery("celery", message), Delivery("celery", noise)])
    items = [i for i in aws.dynamodb.scan(TableName=TABLE)["Items"] if i["pk"]["S"].startswith("QUEUE#")]
    packed = next(i for i in items if "payload_z" in i)
    assert item_size(packed) <= 1024 and "payload" not in packed
    unpacked = {**{k: v for k, v in packed.items() if k != "payload_z"}, "payload": {"B": message}}
    assert item_size(unpacked) > 1024  # as it is, the message would not fit
    assert next(i for i in items if "payload" in i)["payload"]["B"] != message
    assert sorted(c.payload for c in world.claim(["celery"], limit=2)) == sorted([message, noise])


def test_list_runs_reads_the_indexes_with_filters_and_cursors(aws: Aws) -> None:
    world = aws.world()
    made = [create(world, workflow="even" if i % 2 == 0 else "odd", run_id=f"wrun_list_{i}") for i in range(5)]
    world.append(made[2].run_id, [ev(EventType.RUN_CANCELLED)])
    assert [r.run_id for r in world.list_runs().items] == [r.run_id for r in reversed(made)]
    assert [r.run_id for r in world.list_runs(workflow="even").items] == ["wrun_list_4", "wrun_list_2", "wrun_list_0"]
    assert [r.run_id for r in world.list_runs(status="cancelled").items] == ["wrun_list_2"]
    seen, cursor = [], None
    while True:
        page = world.list_runs(workflow="even", limit=2, cursor=cursor)
        seen += [r.run_id for r in page.items]
        if page.cursor is None:
            break
        cursor = page.cursor
    assert seen == ["wrun_list_4", "wrun_list_2", "wrun_list_0"]


# -- limits and errors ---------------------------------------------------------------------------------------------


def test_an_item_over_400_kb_is_event_invalid_and_writes_nothing(aws: Aws) -> None:
    world = aws.world()
    half = "x" * 250_000
    run = world.create_run(NewRun("wrun_big", "wf", {"args": [half], "kwargs": {}}))[0]
    world.append(run.run_id, [ev(EventType.RUN_STARTED)])
    with pytest.raises(EventTooLarge) as info:  # the run view would hold the input and the output: over 400 KB
        world.append(run.run_id, [ev(EventType.RUN_COMPLETED, output=half)])
    assert isinstance(info.value, EventInvalid)
    assert world.get_run(run.run_id).status is RunStatus.RUNNING
    assert [e.slot for e in world.list_events(run.run_id)] == [1, 2]


def test_transaction_and_stream_limits(aws: Aws) -> None:
    world = aws.world()
    run = create(world, started=True)
    due = ids.isoformat(ids.utcnow())
    with pytest.raises(EventInvalid, match="at most 100"):  # the run, the events' item and 99 waits
        world.append(run.run_id, [ev(EventType.WAIT_CREATED, f"w{i}", resume_at=due) for i in range(99)])
    with pytest.raises(EventInvalid, match="at most 100"):  # 2 (run, events) + 50 waits + 50 deliveries
        world.append(
            run.run_id,
            [ev(EventType.WAIT_CREATED, f"w{i}", resume_at=due) for i in range(50)],
            deliveries=[Delivery("celery", b"x")] * 50,
        )
    world.append(run.run_id, [step_created(f"s{i}") for i in range(101)])  # steps have no items: one for all
    assert world.get_run(run.run_id).event_count == 103
    with pytest.raises(EventInvalid, match="at most 99 chunks"):
        world.write_stream(run.run_id, "s", [b"b1x"] * 100)
    assert world.write_stream(run.run_id, "s", [b"b1x"] * 99) == 99
    assert world.read_stream(run.run_id, "s", start=97).chunks[-1].index == 98


def test_throttling_is_unavailable_and_loses_nothing(aws: Aws) -> None:
    client = aws.client("dynamodb")
    world = AWSWorld(aws.config(), client, aws.sqs)
    run = create(world, started=True)
    throttled = {"left": 2}

    def throttle(**kwargs: Any) -> Any:
        if throttled["left"] == 0:
            return None
        throttled["left"] -= 1
        response = {"Error": {"Code": "ThrottlingException", "Message": "Rate exceeded"},
                    "ResponseMetadata": {"HTTPStatusCode": 400}}  # fmt: skip
        return (botocore.awsrequest.AWSResponse(aws.endpoint, 400, {}, None), response)

    client.meta.events.register("before-call.dynamodb.TransactWriteItems", throttle)
    with pytest.raises(WorldUnavailable, match="ThrottlingException"):
        world.append(run.run_id, [step_created("s")])
    assert world.get_run(run.run_id).event_count == 2  # nothing was written
    with pytest.raises(WorldUnavailable):
        world.append(run.run_id, [step_created("s")])
    assert [e.event_type for e in world.append(run.run_id, [step_created("s")]).events] == [EventType.STEP_CREATED]
    assert world.get_run(run.run_id).event_count == 3


# -- deliveries ----------------------------------------------------------------------------------------------------


def _messages(aws: Aws, url: str, *, attributes: bool = False) -> list[dict[str, Any]]:
    answer = aws.sqs.receive_message(
        QueueUrl=url, MaxNumberOfMessages=10, VisibilityTimeout=0, AttributeNames=["All"], WaitTimeSeconds=0
    )
    return list(answer.get("Messages", []))


def test_a_long_delay_goes_through_the_scheduler(aws: Aws, monkeypatch: pytest.MonkeyPatch) -> None:
    world = aws.world()
    due = ids.utcnow() + timedelta(hours=2)
    world.enqueue([Delivery("celery", b"later", run_id="r1", not_before=due)])
    assert _messages(aws, aws.queue_url) == []  # no SQS message yet: a schedule
    (schedule,) = aws.schedules()
    assert schedule["Name"].startswith("celery-workflow-")
    assert schedule["ScheduleExpression"] == f"at({due:%Y-%m-%dT%H:%M:%S})"
    assert schedule["ActionAfterCompletion"] == "DELETE" and schedule["Target"]["Arn"] == aws.queue_arn
    assert aws.fire_due_schedules(due) == 1  # two hours early by this process's clock: sent again
    assert world.claim(["celery"]) == []
    # rescheduled for the remaining time, under a name of its own (the schedule that fired may not be deleted yet)
    assert [s["Name"] for s in aws.schedules()] == [schedule["Name"] + "-1"]
    assert aws.fire_due_schedules(due) == 1
    later = due + timedelta(seconds=1)
    monkeypatch.setattr(ids, "utcnow", lambda: later)  # two hours pass
    (claimed,) = world.claim(["celery"], lease=30)
    assert claimed.payload == b"later" and claimed.run_id == "r1"
    world.ack(claimed.receipt)
    assert world.claim(["celery"]) == []


def test_without_a_scheduler_a_long_delay_is_refused_before_anything_is_written(aws: Aws) -> None:
    world = aws.world(scheduler=None)
    run = create(world, started=True)
    later = ids.utcnow() + timedelta(hours=1)
    with pytest.raises(ConfigurationError, match="needs the Scheduler"):
        world.append(run.run_id, [step_created("s")], deliveries=[Delivery("celery", b"x", not_before=later)])
    assert world.get_run(run.run_id).event_count == 2
    assert not [k for k in _keys(aws) if k[0].startswith("QUEUE#")]
    world.enqueue([Delivery("celery", b"soon", not_before=ids.utcnow() + timedelta(seconds=2))])  # SQS delay
    assert world.claim(["celery"]) == []


def test_fifo_queues_group_by_run_and_schedule_their_delays(aws: Aws) -> None:
    ordered = aws.queue("ordered.fifo", fifo=True)
    world = aws.world(queues={"ordered": ordered})
    world.enqueue([Delivery("ordered", f"m{i}".encode(), run_id="run-a") for i in range(3)])
    world.enqueue([Delivery("ordered", b"b0", run_id="run-b")])
    messages = aws.sqs.receive_message(
        QueueUrl=ordered.url, MaxNumberOfMessages=10, AttributeNames=["All"], VisibilityTimeout=5
    )["Messages"]
    groups = [m["Attributes"]["MessageGroupId"] for m in messages]
    assert sorted(groups) == ["run-a", "run-a", "run-a", "run-b"]
    for m in messages:
        assert json.loads(m["Body"])["id"] == m["Attributes"]["MessageDeduplicationId"]
        aws.sqs.change_message_visibility(QueueUrl=ordered.url, ReceiptHandle=m["ReceiptHandle"], VisibilityTimeout=0)
    got = world.claim(["ordered"], limit=10, lease=30)
    assert [c.payload for c in got if c.run_id == "run-a"] == [b"m0", b"m1", b"m2"]  # in order within the run
    for c in got:
        world.ack(c.receipt)
    world.enqueue([Delivery("ordered", b"retry", run_id="run-a", not_before=ids.utcnow() + timedelta(seconds=30))])
    (schedule,) = aws.schedules()  # FIFO queues take no per-message delay: the Scheduler, into the run's group
    assert schedule["Target"]["SqsParameters"] == {"MessageGroupId": "run-a"}
    assert aws.fire_due_schedules(ids.utcnow() + timedelta(seconds=31)) == 1
    assert [c.payload for c in world.claim(["ordered"])] == []  # it arrived early here: sent again
    assert len(aws.schedules()) == 1


def test_foreign_bodies_and_missing_records_are_acknowledged(aws: Aws) -> None:
    world = aws.world()
    aws.sqs.send_message(QueueUrl=aws.queue_url, MessageBody="not ours")
    aws.sqs.send_message(QueueUrl=aws.queue_url, MessageBody=json.dumps({"celery_workflow": 1, "id": "gone"}))
    assert world.claim(["celery"], limit=10) == []
    assert _messages(aws, aws.queue_url) == []  # both deleted: nothing retried forever


def test_a_stale_receipt_changes_nothing(aws: Aws) -> None:
    world = aws.world()
    world.enqueue([Delivery("celery", b"x")])
    (first,) = world.claim(["celery"], lease=1)
    second = eventually(lambda: (world.claim(["celery"], lease=30) or [None])[0], timeout=5)
    assert second.attempts == 2 and second.receipt != first.receipt
    world.ack(first.receipt)  # SQS would honour the old handle: the record's claim does not
    world.release(first.receipt)
    assert world.claim(["celery"]) == []
    world.ack(second.receipt)
    assert world.claim(["celery"]) == [] and not [k for k in _keys(aws) if k[0].startswith("QUEUE#")]


def test_an_outbox_publishes_what_a_stopped_writer_left(aws: Aws, monkeypatch: pytest.MonkeyPatch) -> None:
    world = aws.world()
    original = world.queue.send_body

    def lost(*args: Any, **kwargs: Any) -> None:
        raise WorldUnavailable("SQS went away after the commit")

    monkeypatch.setattr(world.queue, "send_body", lost)
    with pytest.raises(WorldUnavailable):
        world.create_run(
            NewRun("wrun_outbox", "wf", {"args": [], "kwargs": {}}),
            [Delivery("celery", b"start", run_id="wrun_outbox")],
        )
    assert world.get_run("wrun_outbox").event_count == 1  # committed, its start in META, but never sent
    assert world.claim(["celery"]) == []
    monkeypatch.setattr(world.queue, "send_body", original)
    _, created = world.create_run(
        NewRun("wrun_outbox", "wf", {"args": [], "kwargs": {}}), [Delivery("celery", b"start", run_id="wrun_outbox")]
    )
    assert not created  # the retried start finds the run and publishes what it left
    (claimed,) = world.claim(["celery"], lease=30)
    assert claimed.payload == b"start"
    monkeypatch.setattr(world.queue, "send_body", lost)
    with pytest.raises(WorldUnavailable):  # the delivery's next append committed, its publication failed
        world.append(
            "wrun_outbox", [ev(EventType.RUN_STARTED)], deliveries=[Delivery("celery", b"next", run_id="wrun_outbox")]
        )
    monkeypatch.setattr(world.queue, "send_body", original)
    world.release(claimed.receipt)  # the worker died: its message comes back (a redelivery) ...
    again = world.claim(["celery"], lease=30)  # ... and republishes the run's outbox
    assert [c.payload for c in again] == [b"start"] and again[0].attempts == 2
    assert [c.payload for c in world.claim(["celery"], lease=30)] == [b"next"]


def test_sqs_throttling_after_the_commit_loses_nothing(aws: Aws) -> None:
    sqs = aws.client("sqs")
    world = AWSWorld(aws.config(), aws.dynamodb, sqs)
    run = create(world, run_id="wrun_sqs_throttled", started=True)
    throttled = {"left": 1}

    def throttle(**kwargs: Any) -> Any:
        if throttled["left"] == 0:
            return None
        throttled["left"] -= 1
        response = {"Error": {"Code": "ThrottlingException", "Message": "Rate exceeded"},
                    "ResponseMetadata": {"HTTPStatusCode": 400}}  # fmt: skip
        return (botocore.awsrequest.AWSResponse(aws.endpoint, 400, {}, None), response)

    sqs.meta.events.register("before-call.sqs.SendMessage", throttle)
    with pytest.raises(WorldUnavailable, match="SQS SendMessage: ThrottlingException"):
        world.append(run.run_id, [step_created("s")], deliveries=[Delivery("celery", b"wake", run_id=run.run_id)])
    assert world.get_run(run.run_id).event_count == 3  # the append committed; its message is in the outbox
    assert world.claim(["celery"]) == []
    _, created = world.create_run(NewRun(run.run_id, "wf", {"args": [1], "kwargs": {}}))  # e.g. a retried start
    assert not created
    assert [c.payload for c in world.claim(["celery"])] == [b"wake"]


def test_finished_runs_expire_after_their_retention(aws: Aws) -> None:
    world = aws.world(retention=timedelta(seconds=1), retentions={"kept": None, "long": timedelta(days=1)})
    done = create(world, run_id="wrun_done", started=True)
    world.append(done.run_id, [hook_created("h", "tok-expire"), step_created("s")])
    world.write_stream(done.run_id, "s", [b"b1x"])
    world.append(done.run_id, [ev(EventType.RUN_COMPLETED, output=1)])
    running = create(world, run_id="wrun_running", started=True)
    kept = create(world, workflow="kept", run_id="wrun_kept", started=True)
    world.append(kept.run_id, [ev(EventType.RUN_COMPLETED, output=1)])
    long = create(world, workflow="long", run_id="wrun_long", started=True)
    world.append(long.run_id, [ev(EventType.RUN_COMPLETED, output=1)])
    assert [s["Name"] for s in aws.schedules()] == ["celery-workflow-expire-wrun_long"]  # a day: the Scheduler

    def gone() -> bool | None:
        world.claim(["celery"], limit=10)  # expiry deliveries are handled inside the World
        try:
            world.get_run(done.run_id)
        except RunNotFound:
            return True
        return None

    eventually(gone, timeout=10)
    # what its end wrote carries the retention's end as its time to live: DynamoDB deletes it (issue #31, item 3)
    timed = {("RUN#wrun_done", "META"), ("RUN#wrun_done", f"EVENT#{5:026d}")}

    def deleted() -> bool | None:
        world.claim(["celery"], limit=10)
        left = {k for k in _keys(aws) if "wrun_done" in k[0] or k[0] == "TOKEN#tok-expire"}
        return True if left == timed else None

    eventually(deleted, timeout=10)
    assert world.get_run(running.run_id).status is RunStatus.RUNNING  # pending and running runs never expire
    assert world.get_run(kept.run_id).status is RunStatus.COMPLETED
    assert world.get_run(long.run_id).status is RunStatus.COMPLETED


def test_a_child_end_and_its_parent_wake_up_are_one_transaction(aws: Aws, monkeypatch: pytest.MonkeyPatch) -> None:
    """The child's end, the parent's child_ended (its META update and event item) and the parent's wake-up record go
    in one TransactWriteItems: no process can die between them."""
    world = aws.world()
    parent = create(world, started=True).run_id
    link = {
        "run_id": parent,
        "correlation_id": "child:1",
        "queue": "celery",
        "wake": json.dumps({"headers": {"id": "t", "root_id": "t"}, "properties": {"correlation_id": "t"}}),
    }
    child = f"{parent}!1"
    world.create_run(NewRun(child, "child", {"args": [], "kwargs": {}}, parent=link))
    world.append(child, [ev(EventType.RUN_STARTED)])
    sent: list[list[str]] = []
    transact = world.table.transact

    def recording(what: str, actions: Any) -> None:
        bodies = [next(iter(a.values())) for a in actions]  # {"Put": {...}} -> {...}
        sent.append([str((b.get("Key") or b["Item"])["pk"]["S"]) for b in bodies])
        transact(what, actions)

    monkeypatch.setattr(world.table, "transact", recording)
    world.append(child, [ev(EventType.RUN_COMPLETED, output=3)])
    assert len(sent) == 1, sent
    assert any(parent in pk and "!" not in pk for pk in sent[0]) and any(child in pk for pk in sent[0])
    assert [e.event_type for e in world.list_events(parent)][-1] is EventType.CHILD_ENDED
    world.close()
