"""Messages a producer got wrong, on the SQLite and Postgres transports (kombu.Connection, no worker).

* A message whose body is not what its content type says (``application/json`` that is not JSON, a compressed body
  that does not decompress, a transfer encoding that does not decode, an envelope that is no Kombu message) goes to
  the dead letters, whatever its consumer does with it. Celery logs "Can't decode message body" and *acks* such a
  message (``Consumer.on_decode_error``): here a consumer that does just that (``celery_like``). A real worker does
  the same in ``tests/acceptance/test_undecodable.py``.
* A message published with a per-message TTL (``expiration``, seconds: kombu's ``Producer.publish(expiration=…)``,
  Celery's ``apply_async(expires=…)``) is never delivered once it has expired, as on RabbitMQ: it is dropped, not
  dead-lettered.
"""

from __future__ import annotations

import base64
import io
import json
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.exceptions import ChannelError

from celery_workflow.cli import main
from celery_workflow.dead_letters import UNDECODABLE
from tests.integration.aws_fixtures import aws_fixture, moto_fixture  # noqa: F401
from tests.integration.transport_suite import collector, drain, wait_until

TRANSPORTS = {
    "sqlite": "celery_workflow.transport.sqlite:Transport",
    "postgres": "celery_workflow.transport.postgres:Transport",
}


@pytest.fixture(params=sorted(TRANSPORTS))
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def url(kind: str, tmp_path: Path) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite:///{tmp_path / 'hostile.sqlite3'}"
        return
    from tests.integration import pg_fixtures

    with pg_fixtures.fresh_schema("cw_hostile") as schema:
        yield pg_fixtures.schema_url(schema)


@pytest.fixture
def connect(kind: str, url: str) -> Iterator[Callable[..., Connection]]:
    opened: list[Connection] = []

    def make(**options: Any) -> Connection:
        conn = Connection(url, transport=TRANSPORTS[kind], transport_options=options)
        conn.connect()
        opened.append(conn)
        return conn

    yield make
    for conn in opened:
        conn.release()
    if kind == "postgres":
        from celery_workflow.transport.postgres import close_store

        close_store(url)


@pytest.fixture
def store(kind: str, url: str) -> Iterator[Any]:
    """The transport's store through a World of the test's own, on the same database."""
    from celery_workflow.world import open_world

    world: Any = open_world(url)
    yield world.store
    world.close()


def celery_like(decode_errors: list[Exception]) -> Callable[[Any, Exception], None]:
    """What Celery's consumer does with a message it cannot decode (``Consumer.on_decode_error``): log it and ack
    it "so it doesn't enter a loop"."""

    def on_decode_error(message: Any, exc: Exception) -> None:
        decode_errors.append(exc)
        message.ack()

    return on_decode_error


def raw_message(channel: Any, body: bytes, **kwargs: Any) -> Any:
    """A message as a producer that got it wrong publishes it: ``body`` as it is, whatever the content type says."""
    kwargs.setdefault("content_type", "application/json")
    kwargs.setdefault("content_encoding", "utf-8")
    headers = kwargs.pop("headers", {"task": "tasks.add", "id": "t-1"})
    return channel.prepare_message(body, headers=headers, **kwargs)


JOBS = Queue("jobs", Exchange("jobs"), routing_key="jobs")

#: Bodies that do not decode as their message says: (what, body, prepare_message's keywords).
UNDECODABLE_BODIES = {
    "not json": (b"this is not JSON", {}),
    "truncated json": (b'[[1, 2], {"a": ', {}),
    "not utf-8": (b'["\xff\xfe"]', {}),
    "not zlib": (
        b"not compressed at all",
        {"headers": {"task": "tasks.add", "id": "t-1", "compression": "application/x-gzip"}},
    ),
}


@pytest.mark.parametrize("case", sorted(UNDECODABLE_BODIES))
def test_a_body_that_is_not_what_its_content_type_says_is_dead_lettered(
    connect: Callable[..., Connection], store: Any, url: str, case: str
) -> None:
    body, options = UNDECODABLE_BODIES[case]
    producer_conn, consumer_conn = connect(), connect()
    JOBS(producer_conn.default_channel).declare()
    channel = producer_conn.default_channel
    channel.basic_publish(raw_message(channel, body, **options), exchange="jobs", routing_key="jobs")
    good = zlib.compress(json.dumps({"n": 1}).encode())
    good_message = raw_message(channel, good, headers={"compression": "application/x-gzip"})
    channel.basic_publish(good_message, exchange="jobs", routing_key="jobs")

    received: list[Any] = []
    errors: list[Exception] = []
    consumer = Consumer(
        consumer_conn.channel(), [JOBS], callbacks=[collector(received)], on_decode_error=celery_like(errors),
        accept=["json"],
    )  # fmt: skip
    with consumer:
        drain(consumer_conn, lambda: bool(errors) and bool(received))
    assert [body for body, _ in received] == [{"n": 1}]  # the good one behind it is delivered as usual
    assert store.peek() == []

    (letter,) = store.list_dead_letters()
    assert (letter.queue, letter.reason, letter.task_name, letter.task_id) == ("jobs", UNDECODABLE, "tasks.add", "t-1")
    assert letter.last_error and "application/json" in letter.last_error
    assert store.redrive_dead_letters([letter.id]) == 1  # the message as it was published
    (again,) = store.peek()
    assert json.loads(again.payload)["body"] == base64.b64encode(body).decode()

    assert store.purge_dead_letters() == 0  # redriven: nothing left there


def test_an_undecodable_message_is_listed_by_the_cli(connect: Callable[..., Connection], store: Any, url: str) -> None:
    conn = connect()
    JOBS(conn.default_channel).declare()
    conn.default_channel.basic_publish(raw_message(conn.default_channel, b"{nope"), exchange="jobs", routing_key="jobs")
    errors: list[Exception] = []
    with Consumer(conn.channel(), [JOBS], callbacks=[collector([])], on_decode_error=celery_like(errors)):
        drain(conn, lambda: bool(errors))
    out = io.StringIO()
    assert main(["--world", url, "dead-letters", "list", "--json"], out=out) == 0
    (listed,) = json.loads(out.getvalue())
    assert (listed["queue"], listed["reason"], listed["task"]) == ("jobs", UNDECODABLE, "tasks.add")
    out = io.StringIO()
    assert main(["--world", url, "dead-letters", "list"], out=out) == 0
    assert UNDECODABLE in out.getvalue() and "tasks.add" in out.getvalue()


def test_a_transfer_encoding_that_does_not_decode_is_dead_lettered(
    connect: Callable[..., Connection], store: Any
) -> None:
    """The stored body is base64 (Kombu's virtual transports): one that is not base64 made the consumer's drain
    raise (binascii.Error out of ``drain_events``: a Celery worker's consumer restarts, takes it again, and so on)."""
    conn = connect()
    JOBS(conn.default_channel).declare()
    envelope = {
        "body": "abc",  # not base64: incorrect padding
        "content-type": "application/json",
        "content-encoding": "utf-8",
        "headers": {"task": "tasks.add", "id": "t-2"},
        "properties": {"body_encoding": "base64", "delivery_info": {"exchange": "jobs", "routing_key": "jobs"}},
    }
    store.put("jobs", json.dumps(envelope).encode())
    errors: list[Exception] = []
    with Consumer(conn.channel(), [JOBS], callbacks=[collector([])], on_decode_error=celery_like(errors)):
        drain(conn, lambda: bool(errors))
    assert store.peek() == []
    (letter,) = store.list_dead_letters()
    assert (letter.reason, letter.task_id) == (UNDECODABLE, "t-2")


@pytest.mark.parametrize(
    "envelope",
    [
        {"body": "", "headers": ["not", "a", "mapping"], "properties": {}},
        {"body": 12, "properties": {}},
        {"body": "", "content-type": 7, "properties": {}},
        {"body": "abc", "properties": {"body_encoding": "rot13"}},
    ],
    ids=["headers", "body", "content-type", "body-encoding"],
)
def test_an_envelope_that_is_no_kombu_message_is_dead_lettered_when_taken(
    connect: Callable[..., Connection], store: Any, envelope: dict[str, Any]
) -> None:
    """What Kombu cannot even make a message of never reaches a consumer (its drain would raise): written straight
    into the queue, as someone with write access to it could."""
    conn = connect()
    JOBS(conn.default_channel).declare()
    store.put("jobs", json.dumps(envelope).encode())
    received: list[Any] = []
    errors: list[Exception] = []
    with Consumer(conn.channel(), [JOBS], callbacks=[collector(received)], on_decode_error=celery_like(errors)):
        wait_until(lambda: bool(store.list_dead_letters()) or _drained(conn))
    assert received == [] and store.peek() == []
    (letter,) = store.list_dead_letters()
    assert letter.reason == UNDECODABLE


def _drained(conn: Connection) -> bool:
    try:
        conn.drain_events(timeout=0.1)
    except TimeoutError:
        pass
    return False


def test_on_sqs_an_undecodable_message_goes_to_its_dead_letter_queue(aws: Any) -> None:
    """The SQS transport shares the channel: a body that is not JSON, acked as Celery acks it, is moved to the
    queue's SQS dead-letter queue, and listed there, instead of being deleted."""
    from celery_workflow.dead_letters import dead_letter_store
    from celery_workflow.transport.sqs import Transport as SQSTransport

    dlq = aws.sqs.create_queue(QueueName="hostile-dlq")["QueueUrl"]
    arn = aws.sqs.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    policy = json.dumps({"deadLetterTargetArn": arn, "maxReceiveCount": 5})
    aws.sqs.set_queue_attributes(QueueUrl=aws.queue_url, Attributes={"RedrivePolicy": policy})
    world = aws.world()
    conn = Connection("aws://", transport=SQSTransport, transport_options={"world": world})
    conn.connect()
    try:
        queue = Queue("celery", Exchange("celery", type="direct"), routing_key="celery")
        channel = conn.channel()
        queue(channel).declare()
        channel.basic_publish(raw_message(channel, b"not json at all"), exchange="celery", routing_key="celery")
        errors: list[Exception] = []
        with Consumer(conn.channel(), [queue], callbacks=[collector([])], on_decode_error=celery_like(errors)):
            drain(conn, lambda: bool(errors), timeout=20)
        (letter,) = dead_letter_store(world).list_dead_letters()
        assert (letter.queue, letter.reason) == ("celery", UNDECODABLE)
    finally:
        conn.release()


def test_a_message_decoded_and_acked_normally_is_deleted(connect: Callable[..., Connection], store: Any) -> None:
    """The dead-lettering is for a failed decode only: a message decoded fine and acked is deleted as ever."""
    conn = connect()
    received: list[Any] = []
    with Consumer(conn.channel(), [JOBS], callbacks=[collector(received)], accept=["json"]):
        Producer(conn.channel()).publish({"n": 2}, exchange="jobs", routing_key="jobs", declare=[JOBS])
        drain(conn, lambda: bool(received))
    assert store.peek() == [] and store.list_dead_letters() == []


# -- per-message TTL (expiration) ---------------------------------------------------------------------------------------


def wait_past(deadline: float) -> None:
    """Wait until the clock has passed ``deadline`` (an expiry), checking the clock."""
    while time.time() <= deadline:
        time.sleep(0.02)


def test_an_expired_message_is_never_delivered(connect: Callable[..., Connection], store: Any) -> None:
    conn = connect()
    queue = Queue("ttl", Exchange("ttl"), routing_key="ttl")
    producer = Producer(conn.channel())
    producer.publish({"n": "short"}, exchange="ttl", routing_key="ttl", declare=[queue], expiration=0.5)
    published = time.time()  # after the put: it expires before published + 0.5
    producer.publish({"n": "long"}, exchange="ttl", routing_key="ttl", expiration=60)
    producer.publish({"n": "none"}, exchange="ttl", routing_key="ttl")
    wait_past(published + 0.5)

    received: list[Any] = []
    with Consumer(conn.channel(), [queue], callbacks=[collector(received)], accept=["json"]):
        drain(conn, lambda: len(received) == 2)
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=0.3)
    assert [body["n"] for body, _ in received] == ["long", "none"]
    assert store.peek() == [] and store.list_dead_letters() == []  # dropped, as AMQP drops it: no dead letter


def test_an_expired_message_is_not_got_nor_counted(connect: Callable[..., Connection], store: Any) -> None:
    conn = connect()
    queue = Queue("ttl-get", Exchange("ttl-get"), routing_key="ttl-get")
    Producer(conn.channel()).publish(
        {"n": 1}, exchange="ttl-get", routing_key="ttl-get", declare=[queue], expiration=0.3
    )
    published = time.time()
    assert store.size("ttl-get") == 1
    assert queue(conn.default_channel).queue_declare(passive=True).message_count == 1
    wait_past(published + 0.3)
    assert store.size("ttl-get") == 0
    assert conn.default_channel.basic_get("ttl-get") is None
    assert store.gc()["messages"] == 1  # collected
    assert store.peek() == []


def test_a_message_not_yet_expired_is_delivered(connect: Callable[..., Connection], store: Any) -> None:
    conn = connect()
    queue = Queue("ttl-ok", Exchange("ttl-ok"), routing_key="ttl-ok")
    received: list[Any] = []
    with Consumer(conn.channel(), [queue], callbacks=[collector(received)], accept=["json"]):
        Producer(conn.channel()).publish({"n": 1}, exchange="ttl-ok", routing_key="ttl-ok", expiration=30)
        drain(conn, lambda: bool(received))
    assert received[0][0] == {"n": 1}
    assert received[0][1].properties["expiration"] == "30000"  # the property travels as AMQP's (milliseconds)


def test_expiry_counts_from_publishing_even_for_a_delayed_message(
    connect: Callable[..., Connection], store: Any
) -> None:
    """As Celery's ``expires`` (an absolute deadline) and RabbitMQ's per-message TTL count: a message due after it
    expired is never delivered."""
    conn = connect()
    queue = Queue("ttl-eta", Exchange("ttl-eta"), routing_key="ttl-eta")
    due = time.time() + 0.6
    Producer(conn.channel()).publish(
        {"n": 1}, exchange="ttl-eta", routing_key="ttl-eta", declare=[queue], expiration=0.3, not_before=due
    )
    wait_past(due)
    assert conn.default_channel.basic_get("ttl-eta") is None
    assert store.gc()["messages"] == 1
    assert store.peek() == []


def test_a_queue_ttl_and_a_message_ttl_the_shorter_wins(connect: Callable[..., Connection], store: Any) -> None:
    conn = connect()
    queue = Queue("ttl-both", Exchange("ttl-both"), routing_key="ttl-both", message_ttl=30)
    Producer(conn.channel()).publish(
        {"n": 1}, exchange="ttl-both", routing_key="ttl-both", declare=[queue], expiration=0.3
    )
    published = time.time()
    Producer(conn.channel()).publish({"n": 2}, exchange="ttl-both", routing_key="ttl-both", expiration=60)
    wait_past(published + 0.3)
    got = conn.default_channel.basic_get("ttl-both", no_ack=True)
    assert got is not None and json.loads(got.body) == {"n": 2}
    assert conn.default_channel.basic_get("ttl-both") is None


def test_fanout_copies_expire_too(connect: Callable[..., Connection], store: Any) -> None:
    conn = connect()
    fan = Exchange("ttl-fan", type="fanout")
    for name in ("fan-a", "fan-b"):
        Queue(name, fan)(conn.default_channel).declare()
    Producer(conn.channel()).publish({"n": 1}, exchange=fan, expiration=0.3)
    published = time.time()
    assert store.size("fan-a") == store.size("fan-b") == 1
    wait_past(published + 0.3)
    assert store.size("fan-a") == store.size("fan-b") == 0
    assert conn.default_channel.basic_get("fan-a") is None


def test_celery_expires_sets_the_expiration_the_transport_honours(kind: str, url: str, store: Any) -> None:
    """Celery sends ``apply_async(expires=s)`` as the message's ``expiration`` too: an expired task is not taken."""
    from celery import Celery

    app = Celery("expiring", broker=url)
    app.conf.broker_transport = TRANSPORTS[kind]
    app.send_task("tasks.add", args=(1, 2), queue="celery", expires=0.3)
    published = time.time()
    app.send_task("tasks.add", args=(3, 4), queue="celery", expires=60)
    assert store.size("celery") == 2
    wait_past(published + 0.3)
    assert store.size("celery") == 1
    with app.connection_for_read() as conn:
        got = conn.default_channel.basic_get("celery", no_ack=True)
        assert got is not None and json.loads(got.body)[0] == [3, 4]
        assert conn.default_channel.basic_get("celery") is None
    app.close()


@pytest.mark.parametrize("bad", ["-1", "soon", "1.5"])
def test_a_malformed_expiration_is_refused_when_published(connect: Callable[..., Connection], bad: str) -> None:
    """AMQP's expiration is a string of non-negative whole milliseconds: RabbitMQ refuses anything else at publish
    (PRECONDITION_FAILED); so do these transports, instead of storing a message nobody can say when expires."""
    conn = connect()
    queue = Queue("ttl-bad", Exchange("ttl-bad"), routing_key="ttl-bad")
    queue(conn.default_channel).declare()
    message = conn.default_channel.prepare_message(b"{}", content_type="application/json", properties={})
    message["properties"]["expiration"] = bad
    with pytest.raises(ChannelError, match="expiration"):
        conn.default_channel.basic_publish(message, exchange="ttl-bad", routing_key="ttl-bad")


# -- a SQLite broker URL in a directory that is not there --------------------------------------------------------------


def test_a_sqlite_broker_url_in_a_missing_directory_fails_to_connect(tmp_path: Path) -> None:
    """As Kombu's own transport suite expects of a broker that is not there: ``connect()`` raises one of the
    transport's ``connection_errors`` naming the directory, and ``ensure_connection`` retries it and raises Kombu's
    OperationalError, as for any broker; no directory is created."""
    from kombu.exceptions import OperationalError

    url = f"sqlite:///{tmp_path / 'typo' / 'broker.db'}"
    conn = Connection(url, transport=TRANSPORTS["sqlite"])
    try:
        with pytest.raises(conn.connection_errors, match="does not exist") as failed:
            conn.connect()
        assert str(tmp_path / "typo") in str(failed.value)
        attempts: list[int] = []
        with pytest.raises(OperationalError):
            conn.ensure_connection(max_retries=2, interval_start=0, interval_step=0, callback=lambda: None,
                                   errback=lambda exc, interval: attempts.append(1))  # fmt: skip
        assert attempts  # retried as a connection error
    finally:
        conn.release()
    assert list(tmp_path.iterdir()) == []


def test_a_sqlite_broker_url_in_an_existing_directory_creates_its_file(tmp_path: Path) -> None:
    """A worker may start before anything created the file (the app's World is the default one): it is created."""
    url = f"sqlite:///{tmp_path / 'broker.db'}"
    conn = Connection(url, transport=TRANSPORTS["sqlite"])
    try:
        conn.connect()
        assert (tmp_path / "broker.db").exists()
    finally:
        conn.release()
