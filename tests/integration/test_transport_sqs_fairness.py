"""One SQS consumer on several queues (``celery -A app worker -Q celery,backfill``), through kombu.Connection on a
moto server, with prefetch room 1 (a worker ``-c 1`` with Workflows' prefetch multiplier 1).

Every consumed queue is polled, and an idle queue's long poll never holds the room while another queue has visible
messages (issue #26 item 6, issue #33 item 5): each queue long-polls on its own, and the consumer takes what they
received in turn. Also: purging a queue twice within SQS's minute (issue #33 item 6).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from botocore.awsrequest import AWSResponse
from celery import Celery
from kombu import Connection, Consumer, Producer, Queue

from celery_workflow.transport.sqs import Transport
from celery_workflow.world_sqs import AWSWorld
from tests.integration.aws_fixtures import Aws, aws_fixture, moto_fixture  # noqa: F401
from tests.integration.transport_suite import drain, wait_until

IDLE = ("backfill", "bulk")


@pytest.fixture
def world(aws: Aws) -> AWSWorld:
    return aws.world(queues={name: aws.queue(name) for name in IDLE})


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


class Polls:
    """Spies on the World's ``ReceiveMessage`` calls: which queues have a poll in flight, and how often a poll of
    one queue brought messages while another queue's poll was in flight."""

    def __init__(self, world: AWSWorld, monkeypatch: pytest.MonkeyPatch) -> None:
        self._lock = threading.Lock()
        self.in_flight: dict[str, int] = {}
        self.polled: set[str] = set()
        self.beside: dict[tuple[str, str], int] = {}  # (queue that brought messages, queue polling meanwhile)
        original = world.queue.receive

        def receive(queue: str, **kwargs: Any) -> list[dict[str, Any]]:
            with self._lock:
                self.in_flight[queue] = self.in_flight.get(queue, 0) + 1
                self.polled.add(queue)
                during = {q for q, n in self.in_flight.items() if n and q != queue}
            try:
                messages = original(queue, **kwargs)
            finally:
                with self._lock:
                    self.in_flight[queue] -= 1
                    during |= {q for q, n in self.in_flight.items() if n and q != queue}
            if messages:
                with self._lock:
                    for other in during:
                        self.beside[(queue, other)] = self.beside.get((queue, other), 0) + 1
            return messages

        monkeypatch.setattr(world.queue, "receive", receive)


def _publish(conn: Connection, queue: str, count: int, start: int = 0) -> None:
    producer = Producer(conn.channel())
    for n in range(start, start + count):
        producer.publish({"queue": queue, "n": n}, exchange="", routing_key=queue, serializer="json")


def _consume(conn: Connection, queues: list[str], received: list[str]) -> Consumer:
    def on_message(body: Any, message: Any) -> None:
        received.append(body["queue"])
        message.ack()

    consumer = Consumer(conn.channel(), [Queue(q) for q in queues], callbacks=[on_message], accept=["json"])
    consumer.qos(prefetch_count=1)
    return consumer


@pytest.mark.parametrize("idle", [1, 2], ids=["two-queues", "three-queues"])
@pytest.mark.parametrize("wait", [1, None], ids=["wait-1s", "wait-default"])
def test_an_idle_queues_long_poll_does_not_hold_up_a_busy_queue(
    world: AWSWorld,
    connect: Callable[..., Connection],
    monkeypatch: pytest.MonkeyPatch,
    idle: int,
    wait: int | None,
) -> None:
    """Dozens of messages visible on ``celery``, the other queues idle, prefetch room 1 (the load that stopped a
    worker in #33.5): the busy queue's messages keep coming while the idle queues sit in their long polls, and
    messages that then arrive on the idle queues are consumed too."""
    polls = Polls(world, monkeypatch)
    others = list(IDLE[:idle])
    conn = connect(world, **({} if wait is None else {"wait_time_seconds": wait}))
    _publish(conn, "celery", 50)
    received: list[str] = []
    with _consume(conn, ["celery", *others], received):
        drain(conn, lambda: received.count("celery") >= 10, timeout=120)
        for queue in others:  # arriving on the idle queues while the busy one still has a backlog
            _publish(conn, queue, 3)
        drain(conn, lambda: len(received) == 50 + 3 * idle, timeout=120)
    assert received.count("celery") == 50
    assert all(received.count(q) == 3 for q in others)
    assert polls.polled == {"celery", *others}
    for queue in others:  # the busy queue brought messages while this idle queue's long poll was in flight
        assert polls.beside.get(("celery", queue), 0) > 0, polls.beside


@pytest.mark.parametrize("queues", [2, 3], ids=["two-queues", "three-queues"])
def test_busy_queues_are_served_in_turn(world: AWSWorld, connect: Callable[..., Connection], queues: int) -> None:
    """Every consumed queue with messages is served, none only after another ran dry (#26.6: the first queue's
    receiver retook the room after each poll, so ``backfill`` waited for ``celery`` to be empty, or forever)."""
    names = ["celery", *IDLE[: queues - 1]]
    conn = connect(world, wait_time_seconds=1)
    for name in names:
        _publish(conn, name, 15)
    received: list[str] = []
    with _consume(conn, names, received):
        drain(conn, lambda: len(received) == 15 * queues, timeout=120)
    half = received[: len(received) // 2]
    assert all(half.count(name) >= 3 for name in names), received  # each queue served in the first half


def test_messages_left_in_the_buffer_are_due_at_once_and_kept_hidden(
    world: AWSWorld, connect: Callable[..., Connection], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Queues polled side by side can bring more than one poll of the consumer takes: what stays in the buffer is
    due at once (it came in before the poll's change token, so no later change would wake the consumer for it), and
    its lease is extended with the messages the consumer holds."""
    from celery_workflow._aws.broker_store import SQSBrokerStore

    conn = connect(world)
    for queue in ("celery", "backfill"):
        _publish(conn, queue, 1)
    extended: list[str] = []
    change_visibility = world.queue.change_visibility

    def spy(queue: str, handle: str, seconds: float) -> None:
        extended.append(handle)
        change_visibility(queue, handle, seconds)

    store = SQSBrokerStore(world, wait=1)
    try:
        store.set_demand(2)
        store.receive(["celery", "backfill"])  # starts the receivers
        wait_until(lambda: sum(len(b) for b in store._buffer.values()) == 2, timeout=30)
        store.set_demand(1)
        (taken,), due = store.poll(["celery", "backfill"], limit=1)
        (left,) = [q for q in ("celery", "backfill") if q != taken.queue]
        assert due == {left: 0.0}
        monkeypatch.setattr(world.queue, "change_visibility", spy)
        store.extend([taken.receipt], 60)
        (waiting,) = store._buffer[left]
        assert sorted(extended) == sorted(r.split("|", 2)[2] for r in (taken.receipt, waiting.receipt))
    finally:
        store.close()


# -- purge: one per queue a minute on SQS --------------------------------------------------------------------------


class PurgeRule:
    """SQS's rule that moto does not emulate: one ``PurgeQueue`` per queue every 60 seconds. A second purge within the
    minute is answered as SQS answers it (HTTP 400, ``PurgeQueueInProgress``, through botocore's own parser)."""

    def __init__(self, client: Any) -> None:
        self.last: dict[str, float] = {}
        self.refused = 0
        client.meta.events.register("before-send.sqs.PurgeQueue", self._before_send)

    def _before_send(self, request: Any, **_: Any) -> AWSResponse | None:
        url = json.loads(request.body)["QueueUrl"]
        now = time.monotonic()
        if now - self.last.get(url, -120.0) >= 60:
            self.last[url] = now
            return None  # on to moto, which purges
        self.refused += 1
        body = json.dumps({
            "__type": "com.amazonaws.sqs#PurgeQueueInProgress",
            "message": f"Only one PurgeQueue operation on {url.rsplit('/', 1)[-1]} is allowed every 60 seconds.",
        }).encode()  # fmt: skip
        headers = {
            "x-amzn-query-error": "AWS.SimpleQueueService.PurgeQueueInProgress;Sender",
            "Content-Type": "application/x-amz-json-1.0",
            "Content-Length": str(len(body)),
        }
        return AWSResponse(request.url, 400, headers, _Raw(body))


class _Raw:
    def __init__(self, body: bytes) -> None:
        self.body = body

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self.body


def _size(aws: Aws, url: str) -> int:
    found = aws.sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages"])
    return int(found["Attributes"]["ApproximateNumberOfMessages"])


def test_two_purges_within_a_minute_both_succeed(
    aws: Aws, world: AWSWorld, connect: Callable[..., Connection], caplog: pytest.LogCaptureFixture
) -> None:
    """The first purge removes what the queue held and says how many; a second within SQS's minute finds that purge
    in progress: it is a purge too (nothing removed by this call, the pending one logged), never a World error."""
    rule = PurgeRule(aws.sqs)
    conn = connect(world)
    _publish(conn, "celery", 4)
    channel = conn.channel()
    assert channel.queue_purge("celery") == 4
    assert _size(aws, aws.queue_url) == 0
    _publish(conn, "celery", 2, start=4)
    with caplog.at_level(logging.WARNING, logger="celery_workflow.aws"):
        assert channel.queue_purge("celery") == 0
    assert rule.refused == 1
    assert "in progress" in caplog.text and "workflow-tasks" in caplog.text


def test_celerys_purge_until_empty_ends(aws: Aws, world: AWSWorld, connect: Callable[..., Connection]) -> None:
    """Celery's test manager purges until the count reads 0 (``wait_until_idle``): on a queue that was not empty its
    second purge comes within the minute, and the loop must end."""
    rule = PurgeRule(aws.sqs)
    _publish(connect(world), "celery", 3)
    app = Celery("purging", broker="aws://", broker_transport=Transport)
    app.conf.broker_transport_options = {"world": world}
    counts = []
    with app.connection() as connection:
        while True:
            counts.append(app.control.purge(connection=connection))
            if counts[-1] == 0 or len(counts) > 5:
                break
    assert counts == [3, 0] and rule.refused == 1
