"""Standing claims of the Postgres transport (celery_workflow._postgres.standing): a message published while a
consumer waits idle is handed to it by the insert, and nothing is lost when the consumer misses the hand-off, closes,
stops, is cancelled or is killed."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from kombu import Connection, Consumer, Producer, Queue

from celery_workflow._postgres.listener import ALIVE_LOCK
from celery_workflow._postgres.queue import PostgresQueue
from celery_workflow.errors import WorldError
from celery_workflow.testing._conformance import eventually
from celery_workflow.transport.postgres import close_store
from celery_workflow.world import Delivery, NewRun
from celery_workflow.world_pg import PostgresWorld
from tests.integration.pg_fixtures import (  # noqa: F401
    pg_admin_fixture,
    pg_schema_fixture,
    pg_url_fixture,
)
from tests.integration.transport_suite import collector, drain, spy_calls

TRANSPORT = "celery_workflow.transport.postgres:Transport"
QUIET = {"polling_interval": 30, "heartbeat_interval": 60, "gc_interval": 60}


@pytest.fixture
def connect(pg_url: str) -> Iterator[Callable[..., Connection]]:
    opened: list[Connection] = []

    def make(**options: Any) -> Connection:
        conn = Connection(pg_url, transport=TRANSPORT, transport_options={**QUIET, **options})
        conn.connect()
        opened.append(conn)
        return conn

    yield make
    for conn in opened:
        conn.release()
    close_store(pg_url)


@pytest.fixture
def world(pg_url: str) -> Iterator[PostgresWorld]:
    opened = PostgresWorld.open(pg_url, concurrency=1)
    yield opened
    opened.close()


def spy_claims(monkeypatch: pytest.MonkeyPatch, store: PostgresQueue) -> list[str]:
    """Each claim statement the consumer's store runs from now on: "poll" or "notified" (by a row's key)."""
    return spy_calls(monkeypatch, store, {"poll": "poll", "claim_notified": "notified"})


def consuming(channel: Any, queue: str, received: list[Any], *, ack: bool = True) -> Consumer:
    """A JSON consumer of ``queue`` on ``channel`` that records each message in ``received`` (see ``collector``)."""
    return Consumer(channel, [Queue(queue)], callbacks=[collector(received, ack=ack)], accept=["json"])


def idle(conn: Connection) -> None:
    """Let the consumer look at its queues, find nothing and wait (it registers its standing claim)."""
    with pytest.raises(TimeoutError):
        conn.drain_events(timeout=0.2)


def standing_rows(admin: psycopg.Connection[Any], schema: str) -> list[tuple[Any, ...]]:
    """(queues, active, assigned_id, serial) of every standing claim, oldest first."""
    return admin.execute(
        f'SELECT queues, active, assigned_id, serial FROM "{schema}".celery_workflow_standing_claims ORDER BY since'
    ).fetchall()


def handed(store: PostgresQueue, queue: str) -> list[tuple[int, bool]]:
    """(attempts, leased) of each stored message of ``queue``: (1, True) for one handed to a standing claim."""
    return [(m.attempts, m.leased_until is not None) for m in store.peek([queue])]


def test_an_idle_consumer_is_handed_a_published_message_without_claiming_it(
    connect: Callable[..., Connection],
    monkeypatch: pytest.MonkeyPatch,
    pg_admin: psycopg.Connection[Any],
    pg_schema: str,
) -> None:
    conn = connect()
    store = conn.transport.pg_queue
    claims = spy_claims(monkeypatch, store)
    got: list[Any] = []
    channel = conn.channel()
    channel.basic_qos(0, 1, False)
    with consuming(channel, "handed", got, ack=False):
        idle(conn)
        assert [r[:3] for r in standing_rows(pg_admin, pg_schema)] == [(["handed"], True, None)]
        claims.clear()
        announced = store.mark("handed")
        Producer(connect().channel()).publish({"n": 1}, routing_key="handed")
        assert handed(store, "handed") == [(1, True)]  # stored leased to the consumer, as its claim would have
        drain(conn, lambda: len(got) == 1)
        assert claims == []  # delivered from the notification: no claim ran
        assert store.mark("handed") == announced  # and the queue was not announced: no other consumer woke
        body, message = got[0]
        assert body == {"n": 1} and message.delivery_info["redelivered"] is False
        assert message.delivery_info["cw_attempts"] == 1
        # the claim took one message: the next one is stored and announced as usual until the consumer registers
        assert standing_rows(pg_admin, pg_schema)[0][2] is not None
        message.ack()
    assert store.peek(["handed"]) == []


def test_the_ack_that_frees_room_registers_the_claim_the_next_message_is_handed_to(
    connect: Callable[..., Connection],
    monkeypatch: pytest.MonkeyPatch,
    pg_admin: psycopg.Connection[Any],
    pg_schema: str,
) -> None:
    """One message at a time (prefetch 1, as workflow workers run): no poll runs between the messages at all."""
    conn = connect()
    store = conn.transport.pg_queue
    got: list[Any] = []
    channel = conn.channel()
    channel.basic_qos(0, 1, False)
    producer = Producer(connect().channel())
    with consuming(channel, "serial", got, ack=False):
        idle(conn)
        claims = spy_claims(monkeypatch, store)
        for n in range(1, 4):
            producer.publish({"n": n}, routing_key="serial")
            drain(conn, lambda n=n: len(got) == n)
            assert standing_rows(pg_admin, pg_schema)[0][2] is not None  # used up while the message is held
            got[-1][1].ack()  # frees the room and registers the claim in the same round trip
            assert standing_rows(pg_admin, pg_schema)[0][1:3] == (True, None)
        assert claims == []
    assert [b["n"] for b, _ in got] == [1, 2, 3] and store.peek(["serial"]) == []


def test_a_hand_off_whose_notification_never_arrives_is_released_and_claimed_by_the_next_poll(
    connect: Callable[..., Connection], monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = connect()
    store = conn.transport.pg_queue
    got: list[Any] = []
    with consuming(conn.channel(), "lost", got):
        idle(conn)
        monkeypatch.setattr(conn.transport.standing, "take", lambda: None)  # its notification is lost
        claims = spy_claims(monkeypatch, store)
        Producer(connect().channel()).publish({"n": 1}, routing_key="lost")
        assert handed(store, "lost") == [(1, True)]
        drain(conn, lambda: len(got) == 1)  # the consumer still woke (its token's mark moved) and polled
        assert claims == ["poll"]
        message = got[0][1]
        assert message.delivery_info["cw_attempts"] == 1 and message.delivery_info["redelivered"] is False
    assert store.peek(["lost"]) == []


def test_two_idle_consumers_are_handed_one_message_each_the_longest_waiting_first(
    connect: Callable[..., Connection], pg_admin: psycopg.Connection[Any], pg_schema: str
) -> None:
    first, second = connect(), connect()
    got: dict[str, list[Any]] = {"first": [], "second": []}
    producer = Producer(connect().channel())
    with (
        consuming(first.channel(), "shared", got["first"], ack=False),
        consuming(second.channel(), "shared", got["second"], ack=False),
    ):
        idle(first)
        idle(second)
        assert len(standing_rows(pg_admin, pg_schema)) == 2
        producer.publish({"n": 1}, routing_key="shared")
        producer.publish({"n": 2}, routing_key="shared")
        drain(first, lambda: len(got["first"]) == 1)
        drain(second, lambda: len(got["second"]) == 1)
        assert [m.attempts for m in first.transport.pg_queue.peek(["shared"])] == [1, 1]
        assert got["first"][0][0] == {"n": 1} and got["second"][0][0] == {"n": 2}
        idle(first)  # no room: nothing more
        for received in got.values():
            received[0][1].ack()


def test_any_message_free_of_deduplication_is_handed_off_whatever_its_size_or_bytes(
    connect: Callable[..., Connection],
    monkeypatch: pytest.MonkeyPatch,
    world: PostgresWorld,
    pg_admin: psycopg.Connection[Any],
    pg_schema: str,
) -> None:
    """The notification names the row (the consumer reads it by its key), so a large message or one that is not
    ASCII is handed off too; one with an idempotency key to deduplicate against a pending one is stored unleased
    and announced as before."""
    conn = connect()
    store = conn.transport.pg_queue
    got: list[Any] = []
    with consuming(conn.channel(), "plain", got, ack=False):
        idle(conn)
        claims = spy_claims(monkeypatch, store)
        big = {"blob": "x" * 20_000, "s": "é"}
        Producer(connect().channel()).publish(big, routing_key="plain")
        drain(conn, lambda: len(got) == 1)
        assert got[0][0] == big and claims == []  # read by its key, no claim ran
        ((token, serial, row_id),) = pg_admin.execute(
            f'SELECT token, serial, assigned_id FROM "{pg_schema}".celery_workflow_standing_claims'
        ).fetchall()
        fetched = store.fetch_handed(token, serial, row_id)
        assert fetched is not None and fetched.payload == store.peek(["plain"])[0].payload
        assert store.fetch_handed(token, serial + 1, row_id) is None  # only the claim of that serial's
        assert store.fetch_handed("celery_workflow.standing:another", serial, row_id) is None
        got[0][1].ack()
        assert store.fetch_handed(token, serial, row_id) is None  # gone
        idle(conn)
        world.store.put("plain", b"{}", run_id="r", idempotency_key="k")
        assert handed(world.store, "plain") == [(0, False)]


def test_a_closing_consumer_releases_a_message_handed_to_it_that_it_never_delivered(
    connect: Callable[..., Connection], pg_admin: psycopg.Connection[Any], pg_schema: str
) -> None:
    closing, other = connect(), connect()
    with consuming(closing.channel(), "orphan", []):
        idle(closing)
        Producer(connect().channel()).publish({"n": 1}, routing_key="orphan")
        assert handed(closing.transport.pg_queue, "orphan") == [(1, True)]
    closing.release()  # before it drained the hand-off
    assert handed(other.transport.pg_queue, "orphan") == [(0, False)]  # as if never claimed
    assert standing_rows(pg_admin, pg_schema) == []  # the closed consumer's row is gone
    got: list[Any] = []
    with consuming(other.channel(), "orphan", got):
        drain(other, lambda: len(got) == 1)
    assert got[0][1].delivery_info["redelivered"] is False


def test_a_stopping_worker_and_a_cancelled_consumer_withdraw_their_claims(
    connect: Callable[..., Connection], pg_admin: psycopg.Connection[Any], pg_schema: str
) -> None:
    conn = connect()
    producer = Producer(connect().channel())
    store = conn.transport.pg_queue
    with consuming(conn.channel(), "stopping", []):
        idle(conn)
        conn.transport.stopping()  # what drain_events calls once Celery's worker is asked to stop
        assert standing_rows(pg_admin, pg_schema)[0][1] is False
        producer.publish({"n": 1}, routing_key="stopping")
        assert handed(store, "stopping") == [(0, False)]
        store.purge("stopping")
    consumer = consuming(conn.channel(), "cancelled", [])
    consumer.consume()
    idle(conn)
    assert standing_rows(pg_admin, pg_schema)[0][:2] == (["cancelled"], True)
    consumer.cancel()
    idle(conn)  # the consumer's next turn notices it no longer consumes the queue
    assert standing_rows(pg_admin, pg_schema)[0][1] is False
    producer.publish({"n": 1}, routing_key="cancelled")
    assert handed(store, "cancelled") == [(0, False)]


def test_the_claim_of_a_consumer_whose_process_is_gone_is_passed_over_and_collected(
    world: PostgresWorld, pg_admin: psycopg.Connection[Any], pg_schema: str
) -> None:
    """The liveness check itself: a claim whose lock nobody holds takes nothing; one whose lock is held does."""
    key = random.getrandbits(31)
    pg_admin.execute(
        f'INSERT INTO "{pg_schema}".celery_workflow_standing_claims'
        " (token, queues, lease, serial, lock_key, active, since) VALUES ('t', '{q}', '60 s', 1, %s, true, now())",
        (key,),
    )
    world.store.put("q", b"{}")
    assert handed(world.store, "q") == [(0, False)]  # nobody holds its lock: the process is gone
    with psycopg.connect(pg_admin.info.dsn, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s::integer, %s::integer)", (ALIVE_LOCK, key))
        world.store.put("q", b"{}")
        assert handed(world.store, "q") == [(0, False), (1, True)]
        world.store.gc()
        assert len(standing_rows(pg_admin, pg_schema)) == 1  # alive: kept
    world.store.gc()
    assert standing_rows(pg_admin, pg_schema) == []


def lock_held(admin: psycopg.Connection[Any], key: int) -> bool:
    found = admin.execute(
        "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND classid = %s AND objid = %s AND granted",
        (ALIVE_LOCK, key),
    ).fetchone()
    return found is not None


KILLED_CONSUMER = textwrap.dedent(
    """
    import sys
    from kombu import Connection, Consumer, Queue
    conn = Connection(sys.argv[1], transport="celery_workflow.transport.postgres:Transport",
                      transport_options={"polling_interval": 30})
    conn.connect()
    with Consumer(conn.channel(), [Queue("killed")], callbacks=[lambda body, message: None], accept=["json"]):
        try:
            conn.drain_events(timeout=0.2)
        except TimeoutError:
            pass
        print("registered", flush=True)
        while True:
            try:
                conn.drain_events(timeout=1)
            except TimeoutError:
                pass
    """
)


def test_a_consumer_killed_while_its_claim_stands_loses_no_message(
    connect: Callable[..., Connection], pg_url: str, pg_admin: psycopg.Connection[Any], pg_schema: str
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_CONSUMER, pg_url], stdout=subprocess.PIPE, env={**os.environ}, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "registered"
        assert [r[:2] for r in standing_rows(pg_admin, pg_schema)] == [(["killed"], True)]
        row = pg_admin.execute(f'SELECT lock_key FROM "{pg_schema}".celery_workflow_standing_claims').fetchone()
        assert row is not None and lock_held(pg_admin, row[0])
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
    # the server notices the closed connections, and the lock goes with them
    eventually(lambda: None if lock_held(pg_admin, row[0]) else True, timeout=10)
    conn = connect()
    got: list[Any] = []
    Producer(connect().channel()).publish({"n": 1}, routing_key="killed")
    with consuming(conn.channel(), "killed", got):
        drain(conn, lambda: len(got) == 1)  # at once: not handed to the dead consumer's claim, not 60 s later
    assert got[0][1].delivery_info["cw_attempts"] == 1


def test_a_new_run_hands_its_first_delivery_to_an_idle_worker_and_a_repeated_start_hands_nothing(
    connect: Callable[..., Connection], world: PostgresWorld, pg_admin: psycopg.Connection[Any], pg_schema: str
) -> None:
    conn = connect()
    got: list[Any] = []
    with consuming(conn.channel(), "runs", got, ack=False):
        idle(conn)
        payload = json.dumps(  # a Kombu message as the World stores it
            {
                "body": "{}",
                "headers": {},
                "properties": {},
                "content-type": "application/json",
                "content-encoding": "utf-8",
            }
        ).encode()
        run = NewRun("wrun_handed", "wf", {"args": [], "kwargs": {}})
        _, created = world.create_run(run, [Delivery("runs", payload, run_id=run.run_id, idempotency_key="start")])
        assert created and handed(world.store, "runs") == [(1, True)]
        drain(conn, lambda: len(got) == 1)
        assert got[0][1].delivery_info["cw_attempts"] == 1
        got[0][1].ack()
        idle(conn)
        _, created = world.create_run(run, [Delivery("runs", payload, run_id=run.run_id, idempotency_key="start")])
        assert not created and world.store.peek(["runs"]) == []
        assert standing_rows(pg_admin, pg_schema)[0][1:3] == (True, None)  # still standing, nothing assigned


def test_an_idle_consumer_looking_again_leaves_its_claim_unwritten(
    connect: Callable[..., Connection], pg_admin: psycopg.Connection[Any], pg_schema: str
) -> None:
    """Its periodic looks (every polling interval) write nothing: an idle worker keeps the WAL quiet."""
    conn = connect(polling_interval=0.05)
    with consuming(conn.channel(), "quiet", []):
        idle(conn)
        version = pg_admin.execute(f'SELECT xmin::text FROM "{pg_schema}".celery_workflow_standing_claims').fetchone()
        polls = spy_claims(pytest.MonkeyPatch(), conn.transport.pg_queue)
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=0.5)
        assert len(polls) >= 3  # it did look
        again = pg_admin.execute(f'SELECT xmin::text FROM "{pg_schema}".celery_workflow_standing_claims').fetchone()
        assert again == version


def test_a_delayed_message_falling_due_is_claimed_and_the_standing_claim_withdrawn(
    connect: Callable[..., Connection], pg_admin: psycopg.Connection[Any], pg_schema: str
) -> None:
    conn = connect()
    got: list[Any] = []
    channel = conn.channel()
    channel.basic_qos(0, 1, False)
    producer = Producer(connect().channel())
    with consuming(channel, "later", got, ack=False):
        producer.publish({"n": 1}, routing_key="later", not_before=time.time() + 1.0)  # not due now: never handed over
        idle(conn)
        assert standing_rows(pg_admin, pg_schema)[0][1:3] == (True, None)
        drain(conn, lambda: len(got) == 1)  # woken by its due time, not by a notification
        assert standing_rows(pg_admin, pg_schema)[0][1] is False  # withdrawn: it holds a message now
        producer.publish({"n": 2}, routing_key="later")
        assert handed(conn.transport.pg_queue, "later") == [(1, True), (0, False)]
        got[0][1].ack()
        drain(conn, lambda: len(got) == 2)
        got[1][1].ack()


def test_an_ack_registers_no_claim_while_the_consumer_saw_a_backlog(
    connect: Callable[..., Connection], pg_admin: psycopg.Connection[Any], pg_schema: str
) -> None:
    """Its last poll left a message due: the next poll claims it; a claim registered meanwhile would only be withdrawn
    again (a round trip per message under load)."""
    conn = connect()
    got: list[Any] = []
    channel = conn.channel()
    channel.basic_qos(0, 1, False)
    producer = Producer(connect().channel())
    for n in (1, 2):
        producer.publish({"n": n}, routing_key="backlog")
    with consuming(channel, "backlog", got, ack=False):
        drain(conn, lambda: len(got) == 1)
        got[0][1].ack()
        assert standing_rows(pg_admin, pg_schema) == []
        drain(conn, lambda: len(got) == 2)
        got[1][1].ack()  # nothing left: this one registers
        assert standing_rows(pg_admin, pg_schema)[0][1:3] == (True, None)


def test_a_withdrawal_that_fails_leaves_the_claim_live_to_be_withdrawn_again(
    connect: Callable[..., Connection],
    monkeypatch: pytest.MonkeyPatch,
    pg_admin: psycopg.Connection[Any],
    pg_schema: str,
) -> None:
    """The database still offers the claim: the consumer must not forget it (a message handed to it would wait for
    its lease), so its next claim withdraws it again."""
    conn = connect()
    with consuming(conn.channel(), "retry", []):
        idle(conn)
        standing = conn.transport.standing
        live = standing.live
        assert live is not None

        def unavailable(*args: Any, **kwargs: Any) -> None:
            raise WorldError("the database is away")

        with monkeypatch.context() as patch:
            patch.setattr(conn.transport.pg_queue, "withdraw", unavailable)
            with pytest.raises(WorldError):
                standing.withdraw()
        assert standing.live == live and standing.withdrawal() == live.token
        standing.withdraw()
        assert standing.live is None and standing_rows(pg_admin, pg_schema)[0][1] is False


def test_a_cancelled_consumer_that_drains_no_more_is_handed_nothing(
    connect: Callable[..., Connection], pg_admin: psycopg.Connection[Any], pg_schema: str
) -> None:
    """A consumer is cancelled and its connection is kept (a ``with Consumer(...)`` block ended, the connection went
    back to a pool): nobody drains it again, so its claim is withdrawn by the cancel itself. Otherwise the next
    message would be handed to it and stay leased to it, out of every other reader's reach, for a whole lease."""
    conn = connect()
    producer = Producer(connect().channel())
    store = conn.transport.pg_queue
    with consuming(conn.channel(), "left", []):
        idle(conn)
        assert standing_rows(pg_admin, pg_schema)[0][:2] == (["left"], True)
    assert standing_rows(pg_admin, pg_schema)[0][1] is False  # no drain_events since the cancel
    producer.publish({"n": 1}, routing_key="left")
    assert handed(store, "left") == [(0, False)]
    reader = connect().SimpleQueue("left")
    assert reader.get(timeout=5).payload == {"n": 1}
    reader.close()


def test_a_channel_closed_under_a_standing_claim_withdraws_it(
    connect: Callable[..., Connection], pg_admin: psycopg.Connection[Any], pg_schema: str
) -> None:
    conn = connect()
    channel = conn.channel()
    consumer = consuming(channel, "closed-channel", [])
    consumer.consume()
    idle(conn)
    assert standing_rows(pg_admin, pg_schema)[0][:2] == (["closed-channel"], True)
    channel.close()
    assert standing_rows(pg_admin, pg_schema)[0][1] is False
    Producer(connect().channel()).publish({"n": 2}, routing_key="closed-channel")
    assert handed(conn.transport.pg_queue, "closed-channel") == [(0, False)]


def test_a_channel_closing_while_the_database_is_away_tries_its_withdrawal_once(
    connect: Callable[..., Connection], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each attempt waits out the database's retries: closing a channel of several consumers makes one, not one per
    consumer (and the claim stays live for the next attempt)."""
    conn = connect()
    channel = conn.channel()
    for name in ("away-a", "away-b", "away-c"):
        consuming(channel, name, []).consume()
    idle(conn)
    assert conn.transport.standing.live is not None
    attempts: list[str] = []

    def unavailable(token: str, **kwargs: Any) -> None:
        attempts.append(token)
        raise WorldError("the database is away")

    monkeypatch.setattr(conn.transport.pg_queue, "withdraw", unavailable)
    channel.close()
    assert len(attempts) == 1
    assert conn.transport.standing.live is not None
