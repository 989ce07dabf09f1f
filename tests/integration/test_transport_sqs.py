"""The SQS transport through kombu.Connection (no worker) on a moto server: task queues are the World's SQS
queues, the control channel is Redis."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue

from celery_workflow import ids
from celery_workflow.errors import ConfigurationError
from celery_workflow.transport.sqs import Transport
from celery_workflow.world import Delivery
from celery_workflow.world_sqs import AWSWorld
from tests.integration.aws_fixtures import Aws, aws_fixture, moto_fixture  # noqa: F401
from tests.integration.redis_fixtures import REDIS_URL, redis_prefix_fixture  # noqa: F401
from tests.integration.transport_suite import collector, drain


@pytest.fixture
def world(aws: Aws) -> AWSWorld:
    return aws.world(queues={"backfill": aws.queue("backfill")})


@pytest.fixture
def control_world(aws: Aws, redis_prefix: str) -> Iterator[AWSWorld]:
    yield aws.world(queues={"backfill": aws.queue("backfill")}, control_url=REDIS_URL, table_name="workflow")


@pytest.fixture
def connect() -> Iterator[Callable[..., Connection]]:
    opened: list[Connection] = []

    def make(world: AWSWorld, **options: Any) -> Connection:
        conn = Connection("aws://", transport=Transport, transport_options={"world": world, **options})
        conn.connect()
        opened.append(conn)
        return conn

    yield make
    for conn in opened:
        conn.release()


def _visible(aws: Aws, url: str) -> int:
    return int(
        aws.sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages"])["Attributes"][
            "ApproximateNumberOfMessages"
        ]
    )


def _held(aws: Aws, url: str) -> int:
    """Messages received and not yet deleted or made visible again."""
    attributes = aws.sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["ApproximateNumberOfMessagesNotVisible"])
    return int(attributes["Attributes"]["ApproximateNumberOfMessagesNotVisible"])


def test_publish_consume_ack_on_the_default_queue(
    aws: Aws, world: AWSWorld, connect: Callable[..., Connection]
) -> None:
    conn = connect(world)
    queue = Queue("celery", Exchange("celery", type="direct"), routing_key="celery")
    received: list[Any] = []
    with Consumer(conn.channel(), [queue], callbacks=[collector(received)], accept=["json"]):
        Producer(conn.channel()).publish(
            {"n": 1}, exchange="celery", routing_key="celery", serializer="json", declare=[queue]
        )
        drain(conn, lambda: bool(received), timeout=10)
    body, message = received[0]
    assert body == {"n": 1}
    assert message.delivery_info["cw_receipt"].startswith("raw|celery|")
    assert message.delivery_info["cw_attempts"] == 1
    assert _visible(aws, aws.queue_url) == 0 and _held(aws, aws.queue_url) == 0  # the ack deleted it


def test_long_polls_wait_as_configured(world: AWSWorld, connect: Callable[..., Connection]) -> None:
    conn = connect(world, wait_time_seconds=20)
    assert conn.transport.sqs_store.wait == 20.0
    assert connect(world).transport.sqs_store.wait == 5.0
    for wrong in (0, 21):
        with pytest.raises(ConfigurationError, match="wait_time_seconds"):
            connect(world, wait_time_seconds=wrong)


def test_unknown_queues_are_refused_and_control_needs_redis(
    world: AWSWorld, connect: Callable[..., Connection]
) -> None:
    channel = connect(world).channel()
    with pytest.raises(ConfigurationError, match="never created on the fly"):
        Queue("nowhere", Exchange("nowhere"), routing_key="nowhere")(channel).declare()
    with pytest.raises(ConfigurationError, match="control_url"):
        Queue("w1@host.celery.pidbox", Exchange("celery.pidbox", type="fanout"))(channel).declare()
    assert world.broker().settings["worker_enable_remote_control"] is False


def test_countdowns_become_sqs_delays_or_schedules(
    aws: Aws, world: AWSWorld, connect: Callable[..., Connection]
) -> None:
    conn = connect(world)
    producer = Producer(conn.channel())
    soon = ids.utcnow() + timedelta(seconds=2)
    producer.publish({"k": "soon"}, routing_key="celery", headers={"eta": soon.isoformat()}, serializer="json")
    later = ids.utcnow() + timedelta(hours=3)
    producer.publish({"k": "later"}, routing_key="celery", headers={"eta": later.isoformat()}, serializer="json")
    (schedule,) = aws.schedules()  # three hours: the Scheduler, with a QUEUE# record
    assert schedule["ScheduleExpression"] == f"at({later:%Y-%m-%dT%H:%M:%S})"
    received: list[Any] = []
    with Consumer(conn.channel(), [Queue("celery")], callbacks=[collector(received)], accept=["json"]):
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=1)  # the SQS delay holds it
        drain(conn, lambda: bool(received), timeout=10)
    assert received[0][0] == {"k": "soon"} and ids.utcnow() >= soon - timedelta(seconds=1)


def test_workflow_deliveries_are_acked_through_their_records(
    aws: Aws, world: AWSWorld, connect: Callable[..., Connection]
) -> None:
    envelope = {"body": '{"from": "world"}', "content-type": "application/json", "content-encoding": "utf-8",
                "headers": {}, "properties": {"delivery_tag": "x"}}  # fmt: skip
    world.enqueue([Delivery("backfill", json.dumps(envelope).encode(), run_id="r1")])
    conn = connect(world)
    received: list[Any] = []
    with Consumer(conn.channel(), [Queue("backfill")], callbacks=[collector(received)], accept=["json"]):
        drain(conn, lambda: bool(received), timeout=10)
    body, message = received[0]
    assert body == {"from": "world"} and message.delivery_info["cw_receipt"].startswith("sqs|backfill|")
    assert not aws.dynamodb.scan(TableName="workflow")["Items"]  # the record went with the ack


def test_remote_control_and_fanout_through_redis(control_world: AWSWorld, connect: Callable[..., Connection]) -> None:
    conn = connect(control_world)
    other = connect(control_world)
    fan = Exchange("broadcast", type="fanout")
    got: list[Any] = []
    with Consumer(conn.channel(), [Queue("w1@host.celery.pidbox", fan)], callbacks=[collector(got)], no_ack=True):
        Producer(other.channel()).publish({"ping": 1}, exchange="broadcast", serializer="json")
        drain(conn, lambda: bool(got), timeout=10)
    assert got[0][0] == {"ping": 1}


def test_receivers_ask_for_the_task_consumers_room_only(
    control_world: AWSWorld, connect: Callable[..., Connection]
) -> None:
    """A worker's remote-control consumer has no prefetch limit; counting it would make the receivers fetch task
    messages no consumer has room for, and leave them waiting (unextended) past their visibility timeout."""
    conn = connect(control_world)
    tasks = Consumer(conn.channel(), [Queue("celery", Exchange("celery", type="direct"), routing_key="celery")])
    tasks.qos(prefetch_count=1)
    pidbox = Queue("w1@host.celery.pidbox", Exchange("celery.pidbox", type="fanout"))
    with tasks, Consumer(conn.channel(), [pidbox], no_ack=True):
        assert conn.transport.poll_limit() == 1


def test_a_long_countdown_without_a_scheduler_is_refused_before_anything_is_written(
    aws: Aws, connect: Callable[..., Connection]
) -> None:
    conn = connect(aws.world(scheduler=None))
    with pytest.raises(ConfigurationError, match="Scheduler"):
        conn.transport.sqs_store.put("celery", json.dumps({"properties": {}}).encode(), not_before=time.time() + 3600)
    assert not [i for i in aws.dynamodb.scan(TableName="workflow")["Items"] if i["pk"]["S"].startswith("QUEUE#")]


def test_a_closed_store_starts_no_receiver(world: AWSWorld, aws: Aws, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker shutting down must not begin a long poll: SQS (moto too) answers it after the process is gone, and
    the message it takes stays hidden for its visibility timeout, away from the next worker. Once the store is
    closed, or once Celery's stop flag is up, nothing receives."""
    from celery.worker import state

    from celery_workflow._aws.broker_store import SQSBrokerStore

    cancelled = SQSBrokerStore(world, wait=2)
    cancelled.set_demand(1)
    cancelled.receive(["celery"])
    receiver = cancelled._receivers["celery"]
    cancelled.stop_consuming(["celery"])  # Celery cancels its task consumer first, without waiting ...
    cancelled.close()  # ... then closes the connection: that waits for the cancelled receiver's poll too
    assert not receiver.is_alive()

    store = SQSBrokerStore(world, wait=1)
    store.receive(["celery"])
    assert store._receivers  # a receiver long-polls the queue it consumes
    store.close()
    assert store.receive(["celery"]) == [] and not store._receivers
    Producer(Connection("aws://", transport=Transport, transport_options={"world": world}).channel()).publish(
        {"n": 1}, exchange="", routing_key="celery", serializer="json"
    )
    assert _visible(aws, aws.queue_url) == 1  # still there for the next worker

    conn = Connection("aws://", transport=Transport, transport_options={"world": world})
    conn.connect()
    try:
        with Consumer(conn.channel(), [Queue("celery", Exchange("celery", type="direct"), routing_key="celery")]):
            monkeypatch.setattr(state, "should_stop", 0)
            with pytest.raises(TimeoutError):
                conn.drain_events(timeout=10)
            assert not conn.transport.sqs_store._receivers  # no receiver was started for the stopping worker
            assert _visible(aws, aws.queue_url) == 1
    finally:
        monkeypatch.setattr(state, "should_stop", None)
        conn.release()


# -- dead letters: each queue's SQS dead-letter queue ------------------------------------------------------------------


def _with_dead_letter_queue(aws: Aws, url: str, name: str, max_receives: int) -> str:
    dlq = aws.sqs.create_queue(QueueName=name)["QueueUrl"]
    arn = aws.sqs.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    policy = json.dumps({"deadLetterTargetArn": arn, "maxReceiveCount": max_receives})
    aws.sqs.set_queue_attributes(QueueUrl=url, Attributes={"RedrivePolicy": policy})
    return str(dlq)


def test_reject_and_too_many_receives_move_messages_to_the_dead_letter_queue(
    aws: Aws, world: AWSWorld, connect: Callable[..., Connection]
) -> None:
    """``reject(requeue=False)`` moves a message to its queue's dead-letter queue at once; a message received as
    often as the redrive policy allows is moved by the transport one receive before SQS would (so it can be
    announced and its run failed), with where it came from and why as message attributes. The CLI's store lists,
    redrives (once) and purges them."""
    from celery_workflow.dead_letters import dead_letter_store

    dlq = _with_dead_letter_queue(aws, aws.queue_url, "workflow-tasks-dlq", 3)
    conn = connect(world)
    queue = Queue("celery", Exchange("celery", type="direct"), routing_key="celery")
    received: list[Any] = []

    def on_message(body: Any, message: Any) -> None:
        received.append(body)
        if body["n"] == 1:
            message.reject()
        else:
            message.requeue()

    with Consumer(conn.channel(), [queue], callbacks=[on_message], accept=["json"]):
        producer = Producer(conn.channel())
        for n in (1, 2):
            producer.publish({"n": n}, exchange="celery", routing_key="celery", serializer="json", declare=[queue])
        drain(conn, lambda: _visible(aws, dlq) == 2, timeout=30)
    assert sorted(b["n"] for b in received) == [1, 2, 2]  # the second: received twice, moved on the third receive
    store = dead_letter_store(world)
    letters = {d.reason: d for d in store.list_dead_letters()}
    assert set(letters) == {"rejected", "max-deliveries"}
    assert letters["rejected"].queue == "celery" and letters["max-deliveries"].attempts == 3
    assert letters["max-deliveries"].deliveries == 2
    assert _visible(aws, aws.queue_url) == 0 and _held(aws, aws.queue_url) == 0

    assert store.redrive_dead_letters([letters["rejected"].id]) == 1
    assert store.redrive_dead_letters([letters["rejected"].id]) == 0
    assert _visible(aws, aws.queue_url) == 1
    assert store.purge_dead_letters() == 1
    assert store.list_dead_letters() == []
