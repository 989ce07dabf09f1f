"""The Kombu-level behaviour every store-backed transport shares (kombu.Connection, no worker).

A test module subclasses :class:`TransportSuite` and provides the ``connect`` (a factory of connected
``kombu.Connection``), ``store`` (the transport's store on the same database) and ``url`` fixtures. The suite looks
at the store through its API only (``peek`` shows what is stored), so the SQLite and Postgres transports run it
unchanged, and a third store-backed transport would too.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue

from celery_workflow.world import Delivery


def wait_until(condition: Callable[[], bool], timeout: float = 5.0, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        time.sleep(interval)


def drain(conn: Connection, until: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError("no message before the deadline")
        try:
            conn.drain_events(timeout=min(left, 0.5))
        except TimeoutError:
            pass


def collector(received: list[Any], *, ack: bool = True) -> Callable[[Any, Any], None]:
    def on_message(body: Any, message: Any) -> None:
        received.append((body, message))
        if ack and not message.acknowledged and message.delivery_info.get("cw_receipt"):
            message.ack()

    return on_message


def spy_calls(monkeypatch: Any, target: Any, kinds: dict[str, str]) -> list[str]:
    """The kind (``kinds[name]``) of each call of the named methods of ``target`` from now on, in order."""
    calls: list[str] = []
    for name, kind in kinds.items():
        original = getattr(target, name)

        def counting(*args: Any, _original: Any = original, _kind: str = kind, **kwargs: Any) -> Any:
            calls.append(_kind)
            return _original(*args, **kwargs)

        monkeypatch.setattr(target, name, counting)
    return calls


def run_hub(hub: Any, until: Callable[[], bool], timeout: float = 5.0) -> None:
    """Turn kombu's hub (as Celery's ``asynloop`` does) until ``until()`` or ``timeout`` (AssertionError)."""
    loop = hub.create_loop()
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "condition not met on the event loop"
        next(loop)


class TransportSuite:
    """Routing, acks, leases, TTL and expiry through kombu, whatever store is underneath."""

    # -- on Celery's event loop (kombu's hub: issue #28) ----------------------------------------------------------

    def test_on_an_event_loop_messages_arrive_when_published_and_when_due(
        self, connect: Callable[..., Connection]
    ) -> None:
        """A consumer registered with a hub is woken by a publish from another connection (its change watch) and
        by a hub timer at a delayed message's due time, with a polling interval far longer than the test."""
        from kombu.asynchronous import Hub

        hub = Hub()
        consumer_conn, producer_conn = connect(polling_interval=60, heartbeat_interval=60), connect()
        consumer_conn.connect()
        assert consumer_conn.transport.implements.asynchronous
        consumer_conn.transport.register_with_event_loop(consumer_conn.connection, hub)
        queue = Queue("hub", Exchange("hub"), routing_key="hub")
        received: list[Any] = []
        arrived: list[float] = []
        try:
            with Consumer(consumer_conn.channel(), [queue], callbacks=[collector(received)], accept=["json"]):
                producer = Producer(producer_conn.channel())
                due = datetime.now(UTC) + timedelta(seconds=1)
                producer.publish({"k": "later"}, exchange="hub", routing_key="hub", not_before=due.isoformat())
                producer.publish({"k": "now"}, exchange="hub", routing_key="hub")
                run_hub(hub, lambda: len(received) == 1)
                arrived.append(time.time())
                run_hub(hub, lambda: len(received) == 2)
                arrived.append(time.time())
        finally:
            consumer_conn.release()
            hub.close()
        assert [b["k"] for b, _ in received] == ["now", "later"]
        assert arrived[0] < due.timestamp() <= arrived[1]

    def test_on_an_event_loop_an_ack_from_another_thread_frees_room(self, connect: Callable[..., Connection]) -> None:
        """With one message of prefetch room, the next is claimed once a pool thread acks the first (the ack wakes
        the hub), not at the next polling interval."""
        import threading

        from kombu.asynchronous import Hub

        hub = Hub()
        conn = connect(polling_interval=60, heartbeat_interval=60)
        conn.connect()
        conn.transport.register_with_event_loop(conn.connection, hub)
        queue = Queue("room", Exchange("room"), routing_key="room")
        received: list[Any] = []
        acks: list[threading.Thread] = []

        def later(body: Any, message: Any) -> None:
            received.append(body)
            acks.append(threading.Thread(target=message.ack))
            acks[-1].start()

        try:
            channel = conn.channel()
            channel.basic_qos(0, 1, False)
            producer = Producer(conn.channel())
            for n in range(3):
                producer.publish({"n": n}, exchange=Exchange("room"), routing_key="room", declare=[queue])
            with Consumer(channel, [queue], callbacks=[later], accept=["json"]):
                run_hub(hub, lambda: len(received) == 3)
        finally:
            for thread in acks:
                thread.join(5)
            conn.release()
            hub.close()
        assert sorted(b["n"] for b in received) == [0, 1, 2]

    def test_publish_consume_ack(self, connect: Callable[..., Connection], store: Any, url: str) -> None:
        producer_conn, consumer_conn = connect(), connect()
        queue = Queue("jobs", Exchange("jobs", type="direct"), routing_key="jobs")
        received: list[Any] = []
        with Consumer(consumer_conn.channel(), [queue], callbacks=[collector(received)], accept=["json"]):
            Producer(producer_conn.channel()).publish({"n": 1}, exchange="jobs", routing_key="jobs", serializer="json")
            drain(consumer_conn, lambda: bool(received))
        body, message = received[0]
        assert body == {"n": 1}
        assert message.delivery_info["cw_attempts"] == 1
        assert message.delivery_tag == message.delivery_info["cw_receipt"]
        assert store.peek() == []

    def test_a_worker_asked_to_stop_is_not_kept_waiting(
        self, connect: Callable[..., Connection], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Celery's SIGTERM handler only sets ``state.should_stop`` (to EX_OK, 0: falsy), which its loop reads between
        ``drain_events`` calls: a drain waiting on an idle queue returns so the warm shutdown starts, instead of
        waiting out its timeout."""
        from celery.worker import state

        conn = connect()
        queue = Queue("idle", Exchange("idle"), routing_key="idle")
        with Consumer(conn.channel(), [queue], callbacks=[collector([])], accept=["json"]):
            monkeypatch.setattr(state, "should_stop", 0)
            with pytest.raises(TimeoutError):
                conn.drain_events(timeout=3600)  # without the check: an hour (the suite's timeout fails it first)
            monkeypatch.setattr(state, "should_stop", None)
            with pytest.raises(TimeoutError):
                conn.drain_events(timeout=0.05)  # a running worker's drain still waits for its timeout

    def test_requeue_redelivers_and_reject_dead_letters(self, connect: Callable[..., Connection], store: Any) -> None:
        """``reject(requeue=False)`` moves the message to the dead letters, as a queue with a dead-letter exchange
        does (it used to come back every few minutes forever); a redrive puts it back once, attempts reset."""
        conn = connect()
        queue = Queue("jobs", Exchange("jobs"), routing_key="jobs")
        received: list[Any] = []
        with Consumer(conn.channel(), [queue], callbacks=[collector(received, ack=False)], accept=["json"]):
            Producer(conn.channel()).publish(
                {"n": 1}, exchange="jobs", routing_key="jobs", serializer="json", declare=[queue]
            )
            drain(conn, lambda: len(received) == 1)
            received[0][1].requeue()
            drain(conn, lambda: len(received) == 2)
            second = received[1][1]
            assert second.delivery_info["cw_attempts"] == 2
            assert second.delivery_info["redelivered"] is True
            assert second.delivery_tag != received[0][1].delivery_tag

            second.reject()
            assert store.peek() == []
            (letter,) = store.list_dead_letters()
            assert (letter.queue, letter.reason, letter.attempts) == ("jobs", "rejected", 2)
            assert letter.last_error == "rejected by its consumer"
            assert json.loads(letter.payload)["body"]  # the message as it was stored
            assert store.get_dead_letter(letter.id) == letter

            assert store.redrive_dead_letters([letter.id]) == 1
            assert store.redrive_dead_letters([letter.id]) == 0  # idempotent
            assert store.list_dead_letters() == []
            drain(conn, lambda: len(received) == 3)
            assert received[2][0] == {"n": 1}
            assert received[2][1].delivery_info["cw_attempts"] == 1  # attempts reset
            received[2][1].ack()
        assert store.peek() == []

    def test_a_message_delivered_too_often_is_dead_lettered(
        self, connect: Callable[..., Connection], store: Any
    ) -> None:
        """Every claim counts (a worker that dies holding it, a requeue): past the queue's limit the message moves
        to the dead letters with its history instead of coming back forever. The limit is the transport option, a
        per-queue option, or the queue's ``x-delivery-limit``."""
        conn = connect(max_deliveries=2, max_deliveries_per_queue={"strict": 1})
        queues = [
            Queue("jobs", Exchange("jobs"), routing_key="jobs"),
            Queue("strict", Exchange("strict"), routing_key="strict"),
            Queue("declared", Exchange("declared"), routing_key="declared", queue_arguments={"x-delivery-limit": 3}),
        ]
        received: list[Any] = []

        def requeue(body: Any, message: Any) -> None:
            received.append(body)
            message.requeue()

        with Consumer(conn.channel(), queues, callbacks=[requeue], accept=["json"]):
            producer = Producer(conn.channel())
            for q in queues:
                producer.publish({"q": q.name}, exchange=q.name, routing_key=q.name, declare=[q])
            drain(conn, lambda: len(store.list_dead_letters()) == 3, timeout=10)
        counts = {name: sum(1 for b in received if b["q"] == name) for name in ("jobs", "strict", "declared")}
        assert counts == {"jobs": 2, "strict": 1, "declared": 3}
        letters = {d.queue: d for d in store.list_dead_letters()}
        assert {q: (d.reason, d.attempts) for q, d in letters.items()} == {
            "jobs": ("max-deliveries", 3), "strict": ("max-deliveries", 2), "declared": ("max-deliveries", 4),
        }  # fmt: skip
        assert store.peek() == []
        assert store.purge_dead_letters(queue="jobs") == 1
        assert {d.queue for d in store.list_dead_letters()} == {"strict", "declared"}
        assert store.purge_dead_letters() == 2

    def test_a_lost_delivery_is_recorded_as_a_failure(self, connect: Callable[..., Connection], store: Any) -> None:
        """A delivery whose lease runs out unacked (its worker died) is a failure in the message's history."""
        conn = connect(max_deliveries=1)
        store.put("lost", b'{"body": "{}", "headers": {}, "properties": {}}')
        assert len(store.receive(["lost"], lease=0.05)) == 1
        wait_until(lambda: all(m.leased_until is not None and m.leased_until < time.time() for m in store.peek()))
        got: list[Any] = []
        with Consumer(conn.channel(), [Queue("lost")], callbacks=[collector(got)], accept=["json"]):
            drain(conn, lambda: bool(store.list_dead_letters()))
        (letter,) = store.list_dead_letters()
        assert (letter.reason, letter.attempts, got) == ("max-deliveries", 2, [])
        assert letter.first_failed_at is not None and letter.first_failed_at == letter.last_failed_at
        assert "lease ran out" in (letter.last_error or "")

    def test_dead_letters_are_announced_as_rejected_task_events(
        self, connect: Callable[..., Connection], store: Any
    ) -> None:
        """Flower (an event receiver bound to ``celeryev``) sees a dead-lettered task as a ``task-rejected`` event."""
        conn = connect(max_deliveries=1)
        events = Queue("flower-events", Exchange("celeryev", type="topic"), routing_key="#", auto_delete=True)
        seen: list[Any] = []
        with Consumer(conn.channel(), [events], callbacks=[collector(seen)], accept=["json"], no_ack=True):
            task = {"body": "[]", "headers": {"task": "tasks.unknown", "id": "t-1"}, "properties": {}}
            store.put("work", json.dumps(task).encode())
            store.receive(["work"], lease=60)  # a first delivery that never ends
            store.release(f"{store.peek()[0].id}.1")
            with Consumer(conn.channel(), [Queue("work")], callbacks=[collector([])], accept=["json"]):
                drain(conn, lambda: bool(seen), timeout=10)
        body = seen[0][0]
        assert (body["type"], body["uuid"], body["name"], body["requeue"]) == (
            "task-rejected", "t-1", "tasks.unknown", False,
        )  # fmt: skip
        assert body["dead_letter"] == store.list_dead_letters()[0].id

    def test_eta_and_not_before_delay_delivery(self, connect: Callable[..., Connection], store: Any) -> None:
        conn = connect()
        queue = Queue("later", Exchange("later"), routing_key="later")
        received: list[Any] = []
        due = datetime.now(UTC) + timedelta(seconds=1)
        with Consumer(conn.channel(), [queue], callbacks=[collector(received)], accept=["json"]):
            producer = Producer(conn.channel())
            producer.publish({"k": "eta"}, exchange="later", routing_key="later", headers={"eta": due.isoformat()})
            producer.publish({"k": "nb"}, exchange="later", routing_key="later", not_before=due.isoformat())
            with pytest.raises(TimeoutError):
                conn.drain_events(timeout=0.5)
            assert [m.attempts for m in store.peek()] == [0, 0]
            drain(conn, lambda: len(received) == 2, timeout=5)
        assert datetime.now(UTC) >= due
        assert {b["k"] for b, _ in received} == {"eta", "nb"}

    def test_one_poll_claims_and_tells_when_each_queue_has_its_next_message(self, store: Any) -> None:
        now = time.time()
        store.put("poll-now", b"{}")
        store.put("poll-later", b"{}", not_before=now + 60)
        queues = ["poll-now", "poll-later", "poll-empty"]
        claims, due = store.poll(queues, lease=30)
        assert [c.queue for c in claims] == ["poll-now"]
        assert "poll-empty" not in due  # an empty queue has no due time
        assert due["poll-later"] == pytest.approx(now + 60, abs=5)
        assert due.get("poll-now", now + 30) == pytest.approx(now + 30, abs=5)  # the claim's lease (if seen) ends
        claims, again = store.poll(queues, lease=30)
        assert claims == [] and set(again) == {"poll-now", "poll-later"}
        assert again["poll-now"] == pytest.approx(now + 30, abs=5)  # claimable again when the lease runs out
        assert again["poll-later"] == pytest.approx(due["poll-later"], abs=1)

    def test_idempotency_key_property_dedups(self, connect: Callable[..., Connection], store: Any) -> None:
        producer = Producer(connect().channel())
        for _ in range(3):
            producer.publish({"n": 1}, routing_key="dedup", idempotency_key="k-1", run_id="wrun_1")
        assert [(m.queue, m.run_id) for m in store.peek()] == [("dedup", "wrun_1")]

    @pytest.mark.parametrize(
        ("kind", "keys", "routing_key", "expected"),
        [
            ("fanout", ("", ""), "anything", {"qa", "qb"}),
            ("topic", ("orders.#", "*.created"), "orders.created", {"qa", "qb"}),
            ("topic", ("orders.#", "*.created"), "orders.shipped", {"qa"}),
            ("direct", ("x", "y"), "y", {"qb"}),
        ],
    )
    def test_routing_across_connections(
        self, connect: Callable[..., Connection], kind: str, keys: tuple[str, str], routing_key: str, expected: set[str]
    ) -> None:
        """Bindings declared by two consumers are seen by a third connection that declared nothing."""
        exchange = Exchange("bus", type=kind)
        consumers = []
        got: dict[str, list[Any]] = {"qa": [], "qb": []}
        for name, key in zip(("qa", "qb"), keys, strict=True):
            conn = connect()
            consumer = Consumer(conn.channel(), [Queue(name, exchange, routing_key=key)], accept=["json"])
            consumer.register_callback(collector(got[name]))
            consumer.consume()
            consumers.append((conn, consumer))
        publisher = connect()
        Producer(publisher.channel()).publish({"m": 1}, exchange="bus", routing_key=routing_key, serializer="json")
        for (conn, _), name in zip(consumers, ("qa", "qb"), strict=True):
            if name in expected:
                drain(conn, lambda name=name: bool(got[name]))
            else:
                with pytest.raises(TimeoutError):
                    conn.drain_events(timeout=0.3)
        assert {name for name, messages in got.items() if messages} == expected

    def test_reply_to_a_direct_exchange_declared_only_by_the_client(self, connect: Callable[..., Connection]) -> None:
        """Like a pidbox reply: the replying process never declared the exchange nor the queue."""
        client, server = connect(), connect()
        reply_queue = Queue("abc.reply", Exchange("reply.x", type="direct"), routing_key="abc.reply", auto_delete=True)
        got: list[Any] = []
        with Consumer(client.channel(), [reply_queue], callbacks=[collector(got)], no_ack=True, accept=["json"]):
            channel = server.channel()
            assert channel.typeof("reply.x").type == "direct"  # from the store
            Producer(channel).publish({"pong": 1}, exchange="reply.x", routing_key="abc.reply", serializer="json")
            drain(client, lambda: bool(got))
        assert got[0][0] == {"pong": 1}

    def test_no_ack_consumers_delete_on_receive(self, connect: Callable[..., Connection], store: Any) -> None:
        conn = connect()
        queue = Queue("events", Exchange("events", type="fanout"))
        got: list[Any] = []
        with Consumer(conn.channel(), [queue], callbacks=[collector(got)], no_ack=True, accept=["json"]):
            Producer(connect().channel()).publish({"e": 1}, exchange="events", serializer="json")
            drain(conn, lambda: bool(got))
            assert store.peek() == []
        simple = conn.SimpleQueue("simple", no_ack=True)
        simple.put({"s": 1})
        assert simple.get(timeout=2).payload == {"s": 1}
        assert store.size("simple") == 0
        simple.close()

    def test_basic_get_ack_and_restore_on_close(self, connect: Callable[..., Connection], store: Any) -> None:
        first = connect()
        channel = first.channel()
        Producer(channel).publish({"n": 1}, routing_key="held", declare=[Queue("held")])
        message = channel.basic_get("held")
        assert message is not None
        assert channel.basic_get("held") is None  # leased
        first.release()  # restores unacked messages: releases the lease, never copies
        assert [m.leased_until for m in store.peek()] == [None]
        other = connect().channel()
        again = other.basic_get("held")
        assert again.delivery_info["cw_attempts"] == 2
        again.ack()
        assert store.size("held") == 0

    def test_leases_are_extended_while_held(self, connect: Callable[..., Connection], store: Any) -> None:
        # leases of 1 s, extended every 0.25 s: 0.4 s ones lost the race to a keeper thread starved under a loaded CI
        holder = connect(lease_seconds=1.0)
        got: list[Any] = []
        queue = Queue("slow", Exchange("slow"), routing_key="slow")
        with Consumer(holder.channel(), [queue], callbacks=[collector(got, ack=False)], accept=["json"]):
            Producer(holder.channel()).publish({"n": 1}, exchange="slow", routing_key="slow", serializer="json")
            drain(holder, lambda: bool(got))
            thief = connect().channel()
            deadline = time.monotonic() + 3.5  # almost four leases
            while time.monotonic() < deadline:
                with pytest.raises(TimeoutError):
                    holder.drain_events(timeout=0.1)
                assert thief.basic_get("slow") is None
            got[0][1].ack()
        assert store.peek() == []

    def test_message_ttl_drops_old_messages(self, connect: Callable[..., Connection], store: Any) -> None:
        conn = connect()
        queue = Queue("ttl", Exchange("ttl"), routing_key="ttl", message_ttl=0.3)
        queue(conn.channel()).declare()
        Producer(conn.channel()).publish({"n": 1}, exchange="ttl", routing_key="ttl")
        assert store.size("ttl") == 1
        wait_until(lambda: store.size("ttl") == 0)
        assert conn.default_channel.basic_get("ttl") is None
        assert store.gc()["messages"] == 1

    def test_expired_queues_are_collected_unless_consumed(self, connect: Callable[..., Connection], store: Any) -> None:
        fan = Exchange("bcast", type="fanout")
        idle_conn, live_conn = connect(), connect(gc_interval=0.1)
        Queue("idle", fan, expires=0.5)(idle_conn.channel()).declare()
        got: list[Any] = []
        live = Consumer(live_conn.channel(), [Queue("live", fan, expires=0.5)], callbacks=[collector(got)], no_ack=True)
        live.consume()
        deadline = time.monotonic() + 2.0  # four expiry periods; the consumer refreshes its queue meanwhile
        while time.monotonic() < deadline:
            with pytest.raises(TimeoutError):
                live_conn.drain_events(timeout=0.1)
        assert not store.has_queue("idle")
        assert store.has_queue("live")
        assert [b.queue for b in store.bindings("bcast")] == ["live"]
        Producer(connect().channel()).publish({"b": 1}, exchange="bcast", serializer="json")
        drain(live_conn, lambda: bool(got))
        assert store.peek() == []

    def test_a_consumed_queue_collected_anyway_is_declared_again(
        self, connect: Callable[..., Connection], store: Any
    ) -> None:
        """E.g. the consuming process was stopped longer than x-expires: its next heartbeat restores queue and binding."""
        conn = connect(heartbeat_interval=0.05)
        got: list[Any] = []
        queue = Queue("box", Exchange("mailbox", type="fanout"), expires=10)
        with Consumer(conn.channel(), [queue], callbacks=[collector(got)], no_ack=True):
            store.delete_queue("box")
            assert store.bindings("mailbox") == []
            drain(conn, lambda: store.has_queue("box"))
            assert [b.queue for b in store.bindings("mailbox")] == ["box"]
            assert store.queue_info("box") is not None and store.queue_info("box")["expires"] == 10  # type: ignore[index]
            Producer(connect().channel()).publish({"m": 1}, exchange="mailbox", serializer="json")
            drain(conn, lambda: bool(got))

    def test_auto_delete_queue_goes_with_its_last_consumer(
        self, connect: Callable[..., Connection], store: Any
    ) -> None:
        conn = connect()
        queue = Queue("mine", Exchange("fan", type="fanout"), auto_delete=True)
        consumer = Consumer(conn.channel(), [queue], no_ack=True)
        consumer.consume()
        assert store.has_queue("mine")
        consumer.cancel()
        assert not store.has_queue("mine")
        assert store.bindings("fan") == []

    def test_dead_consumers_auto_delete_queues_are_collected(self, store: Any) -> None:
        store.declare_queue("orphan", auto_delete=True)
        store.bind("fan", "", None, "orphan")
        store.touch("dead-process", ["orphan"])
        store.clock = lambda: time.time() + 120
        assert store.gc(consumer_timeout=60) == {"queues": 1, "consumers": 1, "messages": 0}
        assert not store.has_queue("orphan")
        assert store.bindings() == []

    def test_queue_management(self, connect: Callable[..., Connection], store: Any) -> None:
        channel = connect().channel()
        queue = Queue("mgmt", Exchange("mgmt"), routing_key="mgmt")
        queue(channel).declare()
        assert channel.queue_declare("mgmt", passive=True).message_count == 0
        producer = Producer(channel)
        for n in range(3):
            producer.publish({"n": n}, exchange="mgmt", routing_key="mgmt")
        assert channel.queue_declare("mgmt", passive=True).message_count == 3
        assert channel.queue_purge("mgmt") == 3
        producer.publish({"n": 4}, exchange="mgmt", routing_key="mgmt")
        assert ("mgmt", "mgmt", "mgmt") in set(channel.list_bindings())
        assert "mgmt" in channel.get_exchanges()
        channel.queue_delete("mgmt")
        assert not store.has_queue("mgmt")
        assert store.bindings("mgmt") == []
        with pytest.raises(Exception, match="NOT_FOUND"):
            channel.queue_declare("mgmt", passive=True)
        with pytest.raises(Exception, match="NOT_FOUND"):
            channel.exchange_declare("nope", passive=True)
        channel.exchange_declare("mgmt", passive=True)

    def test_rows_inserted_by_the_world_are_consumed(self, connect: Callable[..., Connection], store: Any) -> None:
        """The World writes the same JSON envelope straight into the table (no exchange, maybe no delivery_info)."""
        envelope = {
            "body": '{"hello": "world"}',
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": {},
            "properties": {"delivery_tag": "x", "run_id": "wrun_1"},
        }
        store.enqueue([Delivery("celery", json.dumps(envelope).encode(), run_id="wrun_1", idempotency_key="d1")])
        store.put("celery", b"not json")
        conn = connect()
        got: list[Any] = []
        with Consumer(conn.channel(), [Queue("celery")], callbacks=[collector(got)], accept=["json"]):
            drain(conn, lambda: bool(got))
            drain(conn, lambda: bool(store.list_dead_letters()))
        body, message = got[0]
        assert body == {"hello": "world"}
        assert message.delivery_info["routing_key"] == "celery"
        # the undecodable row is moved to the dead letters: not lost, not spinning
        assert store.peek() == []
        (letter,) = store.list_dead_letters()
        assert (letter.reason, letter.payload, letter.attempts) == ("undecodable", b"not json", 1)
        assert (letter.last_error or "").startswith("undecodable: ")
