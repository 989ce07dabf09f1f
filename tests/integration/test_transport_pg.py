"""The Postgres Kombu transport through kombu.Connection (no worker): routing, acks, leases, TTL, expiry, wake-ups."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from celery import Celery
from kombu import Connection, Consumer, Producer, Queue

from celery_workflow._postgres.queue import PostgresQueue  # the type of PostgresWorld.store
from celery_workflow.errors import WorldError
from celery_workflow.testing._conformance import eventually
from celery_workflow.transport.postgres import Transport, close_store, conninfo, mask_password
from celery_workflow.world import Delivery
from celery_workflow.world_pg import PostgresWorld
from tests.integration.pg_fixtures import (  # noqa: F401
    pg_admin_fixture,
    pg_schema_fixture,
    pg_url_fixture,
    terminate_backends,
)
from tests.integration.transport_suite import TransportSuite, collector, drain, spy_calls

TRANSPORT = "celery_workflow.transport.postgres:Transport"


@pytest.fixture
def url(pg_url: str) -> str:
    return pg_url


@pytest.fixture
def connect(url: str) -> Iterator[Callable[..., Connection]]:
    opened: list[Connection] = []

    def make(**options: Any) -> Connection:
        conn = Connection(url, transport=TRANSPORT, transport_options=options)
        conn.connect()
        opened.append(conn)
        return conn

    yield make
    for conn in opened:
        conn.release()
    close_store(url)


@pytest.fixture
def store(url: str) -> Iterator[PostgresQueue]:
    """The same tables through a World of the test's own (its clock can be changed without touching Kombu's)."""
    world = PostgresWorld.open(url, concurrency=1)
    yield world.store
    world.close()


def test_url_forms_and_errors(url: str) -> None:
    assert conninfo(url) == url
    assert conninfo("host=db dbname=app") == "host=db dbname=app"
    for bad in ("", "amqp://guest@localhost//", "not a conninfo"):
        with pytest.raises(ValueError):
            conninfo(bad)
    secret = "postgresql://u:s3cret@db:5432/app?options=-csearch_path%3Dwf&sslmode=require"
    assert mask_password(secret) == "postgresql://u:**@db:5432/app?options=-csearch_path%3Dwf&sslmode=require"
    assert "s3cret" not in mask_password("host=db password=s3cret")
    assert Connection(secret, transport=TRANSPORT).as_uri() == mask_password(secret)
    assert Connection(secret, transport=TRANSPORT).as_uri(include_password=True) == secret
    assert psycopg.OperationalError in Transport.connection_errors
    assert WorldError in Transport.connection_errors
    assert WorldError in Transport.channel_errors
    assert Transport.driver_type not in {"sql", "redis", "amqp"}


def test_kombu_and_celery_keep_the_whole_conninfo(url: str) -> None:
    """``options=-csearch_path=…`` and ``application_name`` survive Kombu's URL handling (can_parse_url)."""
    app = Celery("cw_url_check", set_as_current=False)
    app.conf.update(broker_transport=TRANSPORT, broker_url=url)
    with app.connection_for_write() as conn:
        assert conn.hostname == url
        assert conn.transport.client.hostname == url
        assert conn.as_uri() == url
    app.conf.update(
        broker_user="postgres", broker_password="kept-out-of-the-url", broker_transport_options={"pool_timeout": 0.7}
    )
    with app.connection_for_write() as conn:
        info = conn.info()
        assert info.pop("password") == "kept-out-of-the-url"  # Celery pops it before `inspect stats` shows info
        assert "kept-out" not in str(info) and "kept-out" not in conn.as_uri()
        conn.connect()
        used = conn.transport.pg_queue.db.conninfo
        assert "password=kept-out-of-the-url" in used and "user=postgres" in used
        assert "search_path" in used
        assert conn.transport.pg_queue.db.pool.timeout == 0.7  # a refused database fails fast: Celery reconnects
    close_store(used)
    app.close()


# -- wake-ups and reconnection -------------------------------------------------------------------------------------

SLOW_POLLING = {"polling_interval": 30, "heartbeat_interval": 60, "gc_interval": 60}


def waiting_spy(conn: Connection) -> threading.Event:
    """An event set whenever the transport starts waiting for a change (nothing due, nothing to receive)."""
    entered = threading.Event()
    transport = conn.transport
    original = transport.wait_for_change

    def spy(token: Any, timeout: float) -> bool:
        entered.set()
        return bool(original(token, timeout))

    transport.wait_for_change = spy
    return entered


def when(condition: threading.Event, fn: Callable[[], None]) -> threading.Thread:
    """Run ``fn`` in a thread as soon as ``condition`` is set."""

    def run() -> None:
        if condition.wait(10):
            fn()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_notify_wakes_a_waiting_consumer_long_before_the_polling_interval(
    connect: Callable[..., Connection], store: PostgresQueue
) -> None:
    """With a 30 s polling interval, only LISTEN/NOTIFY can deliver within seconds (World inserts included)."""
    conn = connect(**SLOW_POLLING)
    waiting = waiting_spy(conn)
    got: list[Any] = []
    envelope = {"body": '{"from": "world"}', "content-type": "application/json", "content-encoding": "utf-8"}
    publisher = connect().channel()
    with Consumer(conn.channel(), [Queue("wake")], callbacks=[collector(got)], accept=["json"]):
        for publish in (
            lambda: Producer(publisher).publish({"from": "kombu"}, routing_key="wake"),
            lambda: store.enqueue([Delivery("wake", json.dumps(envelope).encode())]),
        ):
            waiting.clear()
            thread = when(waiting, publish)
            started = time.monotonic()
            conn.drain_events(timeout=20)
            assert time.monotonic() - started < 3
            thread.join(5)
    assert [b for b, _ in got] == [{"from": "kombu"}, {"from": "world"}]


def test_a_waiting_consumer_asks_the_store_only_when_something_may_have_changed(
    connect: Callable[..., Connection], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Notifications for other queues cost no query; a delayed message is claimed when due, without a notification
    and long before the polling interval."""
    conn = connect(**SLOW_POLLING)
    polls: list[list[str]] = []
    original = conn.transport.pg_queue.poll

    def counting(queues: Any, **kwargs: Any) -> Any:
        polls.append(list(queues))
        return original(queues, **kwargs)

    monkeypatch.setattr(conn.transport.pg_queue, "poll", counting)
    got: list[Any] = []
    producer = Producer(connect().channel())
    with Consumer(conn.channel(), [Queue("watched")], callbacks=[collector(got)], accept=["json"]):
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=0.3)
        idle = len(polls)
        for n in range(5):
            producer.publish({"n": n}, routing_key="elsewhere")
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=1.0)
        assert len(polls) == idle
        eta = (datetime.now(UTC) + timedelta(seconds=1.5)).isoformat()
        producer.publish({"n": "later"}, routing_key="watched", headers={"eta": eta})
        started = time.monotonic()
        drain(conn, lambda: bool(got), timeout=10)
        assert 1.0 < time.monotonic() - started < 5
    assert [b for b, _ in got] == [{"n": "later"}]
    assert len(polls) - idle <= 4  # the publish (nothing due), the due time, maybe a spurious wake-up


def test_a_due_row_locked_by_another_transaction_is_polled_with_backoff_not_spun_on(
    connect: Callable[..., Connection], url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A due row that another transaction holds (a duplicate joining it, until its commit) is skipped by claims; the
    consumer backs off between polls instead of asking every millisecond, and takes the row soon after the lock goes
    (no notification says so), long before the polling interval."""
    conn = connect(**SLOW_POLLING)
    polls: list[float] = []
    original = conn.transport.pg_queue.poll

    def counting(queues: Any, **kwargs: Any) -> Any:
        polls.append(time.monotonic())
        return original(queues, **kwargs)

    monkeypatch.setattr(conn.transport.pg_queue, "poll", counting)
    got: list[Any] = []
    Producer(connect().channel()).publish({"n": 1}, routing_key="held")
    with (
        psycopg.connect(url) as locker,
        Consumer(conn.channel(), [Queue("held")], callbacks=[collector(got)], accept=["json"]),
    ):
        locker.execute("SELECT id FROM celery_workflow_queue WHERE queue = 'held' FOR UPDATE")
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=1.0)
        assert not got
        assert len(polls) <= 20  # polled 1 ms apart, this was about 700
        locker.commit()
        released = time.monotonic()
        drain(conn, lambda: bool(got), timeout=10)
        assert time.monotonic() - released < 2  # the polling interval is 30 s
    assert [b for b, _ in got] == [{"n": 1}]


def test_an_ack_that_frees_prefetch_room_wakes_the_consumer(connect: Callable[..., Connection]) -> None:
    """E.g. Celery's result handler thread acks while the consuming thread waits: no polling interval is lost."""
    conn = connect(**SLOW_POLLING)
    waiting = waiting_spy(conn)
    got: list[Any] = []
    channel = conn.channel()
    channel.basic_qos(0, 1, False)
    with Consumer(channel, [Queue("one-at-a-time")], callbacks=[collector(got, ack=False)], accept=["json"]):
        producer = Producer(connect().channel())
        producer.publish({"n": 1}, routing_key="one-at-a-time")
        producer.publish({"n": 2}, routing_key="one-at-a-time")
        drain(conn, lambda: len(got) == 1)
        waiting.clear()
        acker = when(waiting, got[0][1].ack)
        started = time.monotonic()
        conn.drain_events(timeout=20)
        assert time.monotonic() - started < 3
        acker.join(5)
        got[1][1].ack()
    assert [b["n"] for b, _ in got] == [1, 2]


def test_room_freed_while_the_consumer_looks_is_taken_without_waiting(
    connect: Callable[..., Connection], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Room that appears after the consumer found its window full but before it waits (an ack in the pool's result
    thread whose wake-up it cannot see) is noticed: it looks again rather than sleeping with room to spare."""
    conn = connect(**SLOW_POLLING)
    transport = conn.transport
    waits: list[float] = []
    original_wait = transport.wait_for_change

    def wait(token: Any, timeout: float) -> bool:
        waits.append(timeout)
        return bool(original_wait(token, timeout))

    monkeypatch.setattr(transport, "wait_for_change", wait)
    got: list[Any] = []
    channel = conn.channel()
    channel.basic_qos(0, 1, False)
    with Consumer(channel, [Queue("window")], callbacks=[collector(got, ack=False)], accept=["json"]):
        producer = Producer(connect().channel())
        producer.publish({"n": 1}, routing_key="window")
        producer.publish({"n": 2}, routing_key="window")
        drain(conn, lambda: len(got) == 1)
        original_queues = transport.consumable_queues
        freed: list[bool] = []

        def queues_then_room() -> list[str]:
            found = original_queues()
            if not freed and "window" not in found:
                freed.append(True)
                channel.qos.ack(got[0][1].delivery_tag)  # room, with no wake-up signalled
            return found

        monkeypatch.setattr(transport, "consumable_queues", queues_then_room)
        waits.clear()
        conn.drain_events(timeout=20)
        assert freed and waits == []  # message 2 came without a single wait
        got[1][1].ack()
    assert [b["n"] for b, _ in got] == [1, 2]


def spy_claims(monkeypatch: pytest.MonkeyPatch, store: PostgresQueue) -> list[str]:
    """Each claim statement the store runs from now on: "poll" (through the queues) or "notified" (by a row's key)."""
    return spy_calls(monkeypatch, store, {"poll": "poll", "claim_notified": "notified"})


def test_an_ack_wakes_the_consumer_without_a_claim_unless_its_queue_was_notified(
    connect: Callable[..., Connection], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ack frees prefetch room and wakes the consumer; it claims only if its queue was notified meanwhile (a
    claim for nothing held up the claim of the next message, whose notification came during it). (Without standing
    claims: with them, the ack registers one and the next message is handed over, see test_standing_claims.py.)"""
    conn = connect(hand_off=False, **SLOW_POLLING)
    claims = spy_claims(monkeypatch, conn.transport.pg_queue)
    got: list[Any] = []
    channel = conn.channel()
    channel.basic_qos(0, 1, False)
    with Consumer(channel, [Queue("acked")], callbacks=[collector(got, ack=False)], accept=["json"]):
        producer = Producer(connect().channel())
        producer.publish({"n": 1}, routing_key="acked")
        drain(conn, lambda: len(got) == 1)
        claims.clear()
        got[0][1].ack()  # room again, and a wake-up
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=0.3)
        assert claims == []  # looked again, claimed nothing
        producer.publish({"n": 2}, routing_key="acked")
        drain(conn, lambda: len(got) == 2)
        assert len(claims) == 1  # the notification: one claim
        got[1][1].ack()
    assert [b["n"] for b, _ in got] == [1, 2]


def test_an_idle_consumer_claims_the_announced_row_by_its_key_and_a_backlog_oldest_first(
    connect: Callable[..., Connection], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message due at once is announced with its row id: a consumer whose queue had nothing claimable claims that
    row by its key. Two announcements since its last claim, or a row taken by someone else, and it looks through
    the queue instead (oldest first), losing nothing. (Without standing claims: with them, the message is handed
    to the idle consumer instead, see test_standing_claims.py.)"""
    conn = connect(hand_off=False, **SLOW_POLLING)
    store = conn.transport.pg_queue
    claims = spy_claims(monkeypatch, store)
    got: list[Any] = []
    channel = conn.channel()
    channel.basic_qos(0, 1, False)
    producer = Producer(connect().channel())
    with Consumer(channel, [Queue("keyed")], callbacks=[collector(got, ack=False)], accept=["json"]):
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=0.2)  # an empty queue: the consumer has looked and waits
        claims.clear()
        producer.publish({"n": 1}, routing_key="keyed")
        drain(conn, lambda: len(got) == 1)
        assert claims == ["notified"]
        # two messages while it has no room: the next claim goes through the queue, oldest first
        heard = store.mark("keyed")
        producer.publish({"n": 2}, routing_key="keyed")
        producer.publish({"n": 3}, routing_key="keyed")
        # once its listener has heard both (it reads them in its own thread, a moment after their commits)
        eventually(lambda: store.mark("keyed") >= (heard[0], heard[1] + 2) or None)
        claims.clear()
        got[0][1].ack()
        drain(conn, lambda: len(got) == 2)
        got[1][1].ack()
        drain(conn, lambda: len(got) == 3)
        assert claims[0] == "poll" and [b["n"] for b, _ in got] == [1, 2, 3]
        got[2][1].ack()
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=0.2)
        # the announced row is taken by another consumer first: the claim by key finds nothing, the poll neither
        claims.clear()
        producer.publish({"n": 4}, routing_key="keyed")
        assert [c.queue for c in store.receive(["keyed"], lease=30)] == ["keyed"]
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=0.3)
        assert claims[:2] == ["notified", "poll"] and len(got) == 3


def test_consumers_survive_terminated_backends(
    connect: Callable[..., Connection], pg_admin: psycopg.Connection[Any], pg_schema: str
) -> None:
    """Every connection of the schema is killed (as by a server restart): transactions retry, LISTEN reconnects."""
    consumer_conn = connect(polling_interval=0.5)
    got: list[Any] = []
    producer = Producer(connect().channel())
    with Consumer(consumer_conn.channel(), [Queue("survivor")], callbacks=[collector(got)], accept=["json"]):
        for n in (1, 2, 3):
            producer.publish({"n": n}, routing_key="survivor")
            drain(consumer_conn, lambda n=n: len(got) == n, timeout=15)
            assert terminate_backends(pg_admin, pg_schema) >= 1
    assert [b["n"] for b, _ in got] == [1, 2, 3]


class TestPostgresTransport(TransportSuite):
    """The shared transport suite on this transport."""
