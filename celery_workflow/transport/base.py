"""A durable Kombu virtual transport over any :class:`BrokerStore` (SQLite and Postgres).

Kombu's virtual transport emulates AMQP in process memory; this module keeps everything that must survive a process
or be seen by other processes in the store instead, so unmodified Celery workers, ``celery inspect`` / ``control``
and Flower work on it (reference: ``celery-kombu.md`` §1.3, §2, §3.3, §7):

* **Due messages only.** ``_put`` stores ``properties["not_before"]`` (ISO 8601), else ``headers["eta"]`` (Celery's
  countdown/eta), else now, as the row's due time; receives only take due rows, so no worker holds an ETA in memory
  under a lease.
* **Leases.** A received message is leased for ``lease_seconds`` (transport option, default 60 s) and a keeper
  thread extends the lease of every unacked message the process holds (``qos._delivered``) every
  ``lease_seconds / 4``, so no lease runs out under a running task, whatever the pool (with ``--pool=solo`` the task
  blocks the consuming thread, not the keeper). ack deletes the row; ``reject(requeue=True)`` and ``_restore`` (shutdown, channel close)
  release the lease (no copy is ever re-published); ``reject(requeue=False)`` keeps the row and makes it due again
  after :func:`backoff` (1 s, 2 s, 4 s … 300 s by attempts). Delivery tags are the store's per-claim receipts (unique
  per receive) and ``delivery_info`` carries the :class:`~celery_workflow.world.Claim` (receipt and attempts).
* **no_ack consumers** (pidbox, event receivers) delete rows as they receive them.
* **Routing state in the store.** Exchanges, bindings and queue declarations are persisted; ``get_table`` reads
  bindings of every exchange type from the store (pidbox replies use a direct exchange declared only by the client),
  ``typeof`` falls back to the stored exchange type, and fanout copies are written by the store for every bound queue.
* **Queue arguments.** ``prepare_queue_arguments`` keeps ``x-expires`` / ``x-message-ttl`` (RabbitMQ style); consumers
  refresh their queues every ``heartbeat_interval`` (at most a quarter of the shortest ``x-expires``) and
  :meth:`BrokerStore.gc` (every ``gc_interval``) collects unused queues, auto_delete queues of dead consumers and
  expired messages; a consumed queue that was collected anyway (its process stalled) is declared and bound again.
* **Wake-ups.** ``drain_events`` asks the store (:meth:`BrokerStore.poll`: claim the oldest due message of the
  consumable queues of every channel, and learn each queue's next due time) only when something may have changed
  since the last poll: a change notification for a consumed queue (or any change, for a store without per-queue
  notifications), new prefetch room, a queue's due time reached, or ``polling_interval`` passed. In between it
  waits on the change token taken just before the last poll, so a change during or after that poll is never missed;
  a transport whose store can wait per queue (Postgres LISTEN/NOTIFY) overrides
  :meth:`StoreTransport.change_token`. Never a blind sleep.

Transport options: ``lease_seconds`` (60), ``polling_interval`` (1.0), ``heartbeat_interval`` (5.0),
``gc_interval`` (10.0), ``consumer_timeout`` (60.0: a consumer silent that long is considered dead).
Message properties read by ``_put``: ``not_before``, ``run_id``, ``idempotency_key`` (any ``apply_async`` keyword
Kombu does not know ends up in the properties).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from queue import Empty
from time import monotonic
from typing import Any, TypeVar

from kombu.exceptions import ChannelError
from kombu.transport import base as _kombu_base
from kombu.transport import virtual as _virtual
from kombu.transport.virtual import exchange as _exchange

from celery_workflow import dead_letters
from celery_workflow.dead_letters import DEFAULT_MAX_DELIVERIES, DeadLetter
from celery_workflow.errors import WorldError
from celery_workflow.transport import pool_hook as _pool_hook
from celery_workflow.transport.store import (
    BACKOFF_CAP,
    BindingRow,
    BrokerStore,
    backoff,
    decode_claims,
    dumps,
    message_due,
)
from celery_workflow.world import Claim, ClaimedDelivery

# the storage protocol and the message helpers live in .store; importable from here too
__all__ = [
    "BindingRow",
    "BrokerStore",
    "StoreChannel",
    "StoreTransport",
    "backoff",
    "decode_claims",
    "dumps",
    "message_due",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Kombu is only partly typed: use its classes and helpers as Any.
_VirtualChannel: Any = _virtual.Channel
_VirtualTransport: Any = _virtual.Transport
_TopicExchange: Any = _exchange.TopicExchange
_to_rabbitmq_queue_arguments: Any = _kombu_base.to_rabbitmq_queue_arguments


#: The task names of celery_workflow's own deliveries (``celery_workflow.app``): Celery rejects them when their
#: handling failed (an outage: they must come back later) or when the worker does not know them (a rolling deploy:
#: another worker may), so a rejection backs them off rather than dead-lettering them at once.
WORKFLOW_TASKS = ("workflow.", "step.")
#: Celery's event exchange (``event_exchange``), where dead letters are announced.
EVENT_EXCHANGE = "celeryev"
MIN_WAIT = 0.001
#: How often a blocked ``drain_events`` looks whether the Celery worker around it was asked to stop.
STOP_CHECK = 0.2


def _limit(name: str, value: Any) -> int | None:
    if value is None or value == 0:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"transport option {name} must be a positive integer or None, got {value!r}")
    return value


def announce_dead_letter(channel: StoreChannel, letter: DeadLetter) -> None:
    """Publish a Celery ``task-rejected`` event for a dead-lettered task on the event exchange, as a worker would:
    Flower and ``celery events`` show the task as REJECTED. Nothing is sent while nobody listens (an unbound
    exchange would route it to Kombu's undeliverable queue)."""
    if not channel.store.bindings(EVENT_EXCHANGE):
        return
    now = time.time()
    event = {
        "type": "task-rejected",
        "uuid": letter.task_id,
        "name": letter.task_name,
        "requeue": False,
        "dead_letter": letter.id,
        "reason": letter.reason,
        "hostname": f"celery@{socket.gethostname()}",
        "timestamp": now,
        "utcoffset": -time.timezone // 3600,
        "pid": os.getpid(),
        "clock": 0,
    }
    body = dumps(event)
    message = channel.prepare_message(
        body, content_type="application/json", content_encoding="utf-8", headers={"hostname": event["hostname"]}
    )
    channel.basic_publish(message, exchange=EVENT_EXCHANGE, routing_key="task.rejected")


def worker_stopping() -> bool:
    """Whether a Celery worker in this process was asked to stop (SIGTERM, SIGQUIT, ``celery control shutdown``).

    Celery's signal handlers only set a flag, which its blocking loop reads between ``drain_events`` calls (each up
    to 2 s). A transport waiting on its store reads the flag too and returns early, so a warm shutdown starts at
    once. Read through ``sys.modules``: the transport does not import Celery, and outside a worker this is False."""
    state = sys.modules.get("celery.worker.state")
    if state is None:
        return False
    flags = (getattr(state, "should_stop", None), getattr(state, "should_terminate", None))
    return any(flag is not None and flag is not False for flag in flags)  # EX_OK is 0: a stop, though falsy


class StoreChannel(_VirtualChannel):  # type: ignore[misc]
    """A virtual channel whose messages, exchanges, bindings and queues live in the transport's store."""

    supports_fanout = True

    def __init__(self, connection: StoreTransport, **kwargs: Any) -> None:
        super().__init__(connection, **kwargs)
        #: Consumer id of this channel in the store (heartbeats, auto_delete bookkeeping).
        self.consumer_id = f"{socket.gethostname()}:{uuid.uuid4().hex[:16]}"
        self._noack_queues: set[str] = set()
        self._declared: dict[str, dict[str, Any]] = {}  # queue -> declaration, to declare it again after collection
        self._stored_types: dict[str, str] = {}
        #: ``x-delivery-limit`` of the queues this channel declared.
        self.delivery_limits: dict[str, int] = {}

    @property
    def store(self) -> BrokerStore:
        return self.connection.store  # type: ignore[no-any-return]

    # -- messages ------------------------------------------------------------------------------------------------

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        props = message.get("properties") or {}
        stored = self.store.put(
            queue,
            dumps(message),
            not_before=message_due(message),
            run_id=props.get("run_id"),
            idempotency_key=props.get("idempotency_key"),
        )
        if not stored:
            logger.debug("message for %r deduplicated by idempotency key %r", queue, props.get("idempotency_key"))

    def _put_fanout(self, exchange: str, message: dict[str, Any], routing_key: str, **kwargs: Any) -> None:
        self.store.put_fanout(exchange, dumps(message), not_before=message_due(message))

    def _receive(
        self, queues: Sequence[str], no_ack: Collection[str], limit: int = 1
    ) -> list[tuple[dict[str, Any], str]]:
        """Claim due messages: leased, or deleted for ``no_ack`` queues; return ``(payload, queue)`` pairs."""
        transport = self.connection
        claims = self.store.receive(queues, no_ack=no_ack, limit=limit, lease=transport.lease_seconds)
        return decode_claims(
            self.store, claims, no_ack, cap=transport.backoff_cap, limit_of=transport.delivery_limit,
            dead=transport.dead_lettered,
        )  # fmt: skip

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        got = self._receive([queue], self._noack_queues & {queue})
        if not got:
            raise Empty()
        return got[0][0]

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        got = self._receive([queue], {queue} if no_ack else ())
        if not got:
            return None
        message = self.Message(got[0][0], channel=self)
        if not no_ack:
            self.qos.append(message, message.delivery_tag)
        return message

    def _claim(self, delivery_tag: Any) -> Claim | None:
        try:
            return Claim.from_delivery_info(self.qos.get(delivery_tag).delivery_info)
        except KeyError:
            return None

    def basic_ack(self, delivery_tag: Any, multiple: bool = False) -> None:
        """Delete the message (stale receipts change nothing), then forget it."""
        held = self._claim(delivery_tag)
        try:
            if held is not None:
                self.store.ack(held.receipt)
        finally:
            super().basic_ack(delivery_tag, multiple)

    def basic_reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        """requeue: release the lease (due at once); otherwise move the message to the dead letters, as a queue
        with a dead-letter exchange does (a store without dead letters, and a workflow or step delivery, see
        :data:`WORKFLOW_TASKS`, back it off instead: 1 s, 2 s … up to ``backoff_cap``, until the queue's delivery
        limit). A delivery the task already put back itself (``retry_later``, with its error) is left as it is."""
        held = self._claim(delivery_tag)
        try:
            if held is not None:
                if requeue:
                    self.store.release(held.receipt)
                else:
                    self._reject(held, delivery_tag)
        finally:
            super().basic_reject(delivery_tag, requeue=False)

    def _reject(self, held: Claim, delivery_tag: Any) -> None:
        try:
            message = self.qos.get(delivery_tag)
            task, task_id = message.headers.get("task"), message.headers.get("id")
        except (KeyError, AttributeError):
            task = task_id = None
        mover = getattr(self.store, "dead_letter", None)
        if mover is None or str(task or "").startswith(WORKFLOW_TASKS):
            # a workflow or step delivery whose handling failed (or that this worker does not know yet, as during
            # a rolling deploy) is retried with backoff until its queue's delivery limit moves it
            self.store.retry_later(held.receipt, backoff(held.attempts, cap=self.connection.backoff_cap))
            return
        error = f"rejected by its consumer: task {task} [{task_id}]" if task else "rejected by its consumer"
        letter = mover(held.receipt, reason=dead_letters.REJECTED, error=error)
        if letter is not None:
            self.connection.dead_lettered(letter, channel=self)

    def _restore(self, message: Any) -> None:
        """Give an unacked message back by releasing its lease (never by publishing a copy)."""
        claim = Claim.from_delivery_info(message.delivery_info)
        if claim is not None:
            self.store.release(claim.receipt)
        else:  # not received from the store: fall back to re-publishing
            super()._restore(message)

    def held_receipts(self) -> list[str]:
        """Receipts of the unacked messages this channel holds (call from the consuming thread)."""
        qos = self._qos
        if qos is None:
            return []
        dirty = set(qos._dirty)
        out = []
        for tag, message in list(qos._delivered.items()):
            claim = Claim.from_delivery_info(message.delivery_info) if tag not in dirty else None
            if claim is not None:
                out.append(claim.receipt)
        return out

    # -- consumers -----------------------------------------------------------------------------------------------

    def basic_consume(self, queue: str, no_ack: bool, callback: Any, consumer_tag: Any, **kwargs: Any) -> Any:
        if no_ack:
            self._noack_queues.add(queue)
        result = super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)
        self.heartbeat([queue])
        return result

    def basic_cancel(self, consumer_tag: Any) -> Any:
        queue = self._tag_to_queue.get(consumer_tag)
        result = super().basic_cancel(consumer_tag)
        if queue is not None and queue not in self._tag_to_queue.values():
            self._noack_queues.discard(queue)
            try:
                deleted = self.store.drop_consumer(self.consumer_id, [queue])
            except WorldError as exc:
                logger.warning("cannot unregister consumer of %r: %s", queue, exc)
            else:
                for name in deleted:
                    self.state.queue_bindings_delete(name)
                    self._declared.pop(name, None)
        return result

    def consumed_queues(self) -> list[str]:
        return list(dict.fromkeys(self._tag_to_queue.values()))

    def heartbeat(self, queues: Sequence[str] | None = None) -> None:
        """Mark this channel's consumed queues as used; declare again any that was collected meanwhile."""
        names = self.consumed_queues() if queues is None else list(queues)
        for queue in self.store.touch(self.consumer_id, names):
            declaration = self._declared.get(queue)
            if declaration is None:
                continue
            logger.warning("queue %r was collected while consumed here; declaring it again", queue)
            self.store.declare_queue(queue, **declaration)
            for exchange, routing_key, arguments in list(self.state.queue_bindings(queue)):
                meta = self.typeof(exchange).prepare_bind(queue, exchange, routing_key, arguments)
                self._queue_bind(exchange, *meta)

    def shortest_expiry(self) -> float | None:
        """The shortest ``x-expires`` (seconds) of the queues this channel consumes, if any."""
        found = [self._declared.get(q, {}).get("expires") for q in self.consumed_queues()]
        values = [float(v) for v in found if v]
        return min(values) if values else None

    # -- queues --------------------------------------------------------------------------------------------------

    def prepare_queue_arguments(self, arguments: Mapping[str, Any] | None, **kwargs: Any) -> Any:
        return _to_rabbitmq_queue_arguments(arguments or {}, **kwargs)

    def _new_queue(self, queue: str, **kwargs: Any) -> None:
        arguments = kwargs.get("arguments") or {}
        expires, ttl = arguments.get("x-expires"), arguments.get("x-message-ttl")
        declaration: dict[str, Any] = {
            "durable": bool(kwargs.get("durable", True)),
            "exclusive": bool(kwargs.get("exclusive", False)),
            "auto_delete": bool(kwargs.get("auto_delete", False)),
            "expires": None if expires is None else float(expires) / 1000,
            "message_ttl": None if ttl is None else float(ttl) / 1000,
        }
        self.store.declare_queue(queue, **declaration)
        self._declared[queue] = declaration
        limit = arguments.get("x-delivery-limit")
        if limit is not None:
            self.delivery_limits[queue] = int(limit)

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return self.store.has_queue(queue)

    def _size(self, queue: str) -> int:
        return self.store.size(queue)

    def _purge(self, queue: str) -> int:
        return self.store.purge(queue)

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        self.store.delete_queue(queue)

    def queue_delete(self, queue: str, if_unused: bool = False, if_empty: bool = False, **kwargs: Any) -> None:
        """Delete the queue with its bindings and messages, whoever declared it."""
        if if_empty and self._size(queue):
            return
        self.store.delete_queue(queue)
        self.state.queue_bindings_delete(queue)
        self._declared.pop(queue, None)

    # -- exchanges and bindings ----------------------------------------------------------------------------------

    def exchange_declare(  # noqa: PLR0917 - Kombu's signature
        self,
        exchange: str | None = None,
        type: str = "direct",
        durable: bool = False,
        auto_delete: bool = False,
        arguments: Mapping[str, Any] | None = None,
        nowait: bool = False,
        passive: bool = False,
    ) -> None:
        type = type or "direct"
        exchange = exchange or f"amq.{type}"
        if passive:
            if exchange in self.state.exchanges:
                return
            stored = self._stored_type(exchange)
            if stored is None:
                vhost = self.connection.client.virtual_host or "/"
                raise ChannelError(
                    f"NOT_FOUND - no exchange {exchange!r} in vhost {vhost!r}",
                    (50, 10),
                    "Channel.exchange_declare",
                    "404",
                )
            self.state.exchanges[exchange] = {
                "type": stored,
                "durable": durable,
                "auto_delete": auto_delete,
                "arguments": arguments or {},
                "table": [],
            }
            return
        known = exchange in self.state.exchanges
        super().exchange_declare(exchange, type, durable, auto_delete, arguments, nowait, passive=False)
        if not known or self._stored_types.get(exchange) != type:
            self.store.declare_exchange(exchange, type, durable=durable, auto_delete=auto_delete, arguments=arguments)
            self._stored_types[exchange] = type

    def _stored_type(self, exchange: str) -> str | None:
        kind = self._stored_types.get(exchange)
        if kind is None:
            kind = self.store.exchange_type(exchange)
            if kind is not None:
                self._stored_types[exchange] = kind
        return kind

    def typeof(self, exchange: str, default: str = "direct") -> Any:
        declared = self.state.exchanges.get(exchange)
        kind = declared["type"] if declared else (self._stored_type(exchange) or default)
        return self.exchange_types[kind]

    def exchange_delete(self, exchange: str, if_unused: bool = False, nowait: bool = False) -> None:
        """Delete the exchange and its bindings (the queues stay, as in AMQP)."""
        self.store.delete_exchange(exchange)
        self.state.exchanges.pop(exchange, None)
        self._stored_types.pop(exchange, None)

    def get_exchanges(self) -> list[str]:
        return self.store.exchanges()

    def get_table(self, exchange: str) -> list[tuple[str, str | None, str]]:
        """``(routing_key, pattern, queue)`` of every binding of ``exchange``, from the store (any exchange type)."""
        rows = self.store.bindings(exchange)
        topic = any(b.pattern is None for b in rows) and self.typeof(exchange).type == "topic"
        key_to_pattern = _TopicExchange(self).key_to_pattern
        return [
            (b.routing_key, key_to_pattern(b.routing_key) if topic and b.pattern is None else b.pattern, b.queue)
            for b in rows
        ]

    def list_bindings(self) -> Any:
        return ((b.queue, b.exchange, b.routing_key) for b in self.store.bindings())

    def queue_bind(
        self, queue: str, exchange: str | None = None, routing_key: str = "", arguments: Any = None, **kwargs: Any
    ) -> None:
        exchange = exchange or "amq.direct"
        routing_key = routing_key or ""
        meta = self.typeof(exchange).prepare_bind(queue, exchange, routing_key, arguments)
        self.state.binding_declare(queue, exchange, routing_key, arguments)
        self._queue_bind(exchange, *meta)

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str | None, queue: str) -> None:
        self.store.bind(exchange, routing_key or "", pattern, queue)

    def queue_unbind(
        self, queue: str, exchange: str | None = None, routing_key: str = "", arguments: Any = None, **kwargs: Any
    ) -> None:
        exchange = exchange or "amq.direct"
        self.state.binding_delete(queue, exchange, routing_key or "")
        self.store.unbind(exchange, routing_key or "", queue)


class StoreTransport(_VirtualTransport):  # type: ignore[misc]
    """A synchronous (synloop) virtual transport whose state lives in a :class:`BrokerStore`.

    Subclasses implement :meth:`open_store` and set ``driver_type`` / ``driver_name``.
    """

    Channel = StoreChannel

    implements = _VirtualTransport.implements.extend(
        asynchronous=False,
        exchange_type=frozenset(["direct", "topic", "fanout"]),
        heartbeats=False,
    )
    connection_errors = (*_VirtualTransport.connection_errors, WorldError)
    channel_errors = (*_VirtualTransport.channel_errors, WorldError)

    polling_interval = 1.0
    lease_seconds = 60.0
    #: The longest delay before a rejected message is due again (see :func:`~.store.backoff`).
    backoff_cap = BACKOFF_CAP
    heartbeat_interval = 5.0
    gc_interval = 10.0
    consumer_timeout = 60.0
    #: Deliveries of a message before it is dead-lettered (None or 0: no limit); per queue:
    #: ``max_deliveries_per_queue`` or the queue's ``x-delivery-limit`` argument.
    max_deliveries: int | None = DEFAULT_MAX_DELIVERIES

    def __init__(self, client: Any, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        options = client.transport_options or {}
        for name in ("lease_seconds", "heartbeat_interval", "gc_interval", "consumer_timeout"):
            if options.get(name) is not None:
                setattr(self, name, float(options[name]))
        if "max_deliveries" in options:
            self.max_deliveries = _limit("max_deliveries", options["max_deliveries"])
        per_queue = options.get("max_deliveries_per_queue") or {}
        if not isinstance(per_queue, Mapping):
            raise ValueError("transport option max_deliveries_per_queue must map queue names to limits")
        self.max_deliveries_per_queue = {
            str(q): _limit(f"max_deliveries_per_queue[{q!r}]", n) for q, n in per_queue.items()
        }
        self._store: BrokerStore | None = None
        self._next_heartbeat = self._next_gc = 0.0
        self._keeper: threading.Thread | None = None
        self._keeper_stop = threading.Event()
        # what the last poll saw (see drain_events): its queues, when, a change since, each queue's next due time
        self._polled: set[str] = set()
        self._last_poll = -math.inf
        self._dirty = True
        self._due: dict[str, float] = {}
        self._token: Any = None  # the change token taken just before the last poll
        self._world: Any = None  # see world()

    def open_store(self) -> BrokerStore:
        """The store for ``self.client`` (its URL is ``self.client.hostname`` when ``can_parse_url``)."""
        raise NotImplementedError

    @property
    def store(self) -> BrokerStore:
        if self._store is None:
            self._store = self.open_store()
        return self._store

    def establish_connection(self) -> Any:
        self.store  # noqa: B018 - open (and migrate) now, so a bad URL is a connection error
        return super().establish_connection()

    # -- event loop ----------------------------------------------------------------------------------------------

    def drain_events(self, connection: Any, timeout: float | None = None) -> None:
        """Deliver one message; wait for store changes (bounded by due times) until ``timeout`` (socket.timeout).

        The store is asked only when something may have changed since it last answered: a change notification for
        a consumed queue (or any change, for a store without per-queue notifications), a consumer with new prefetch
        room, a queue's due time reached (a backlog is due at once), or ``polling_interval`` passed. One
        :meth:`BrokerStore.poll` claims the oldest due message across the consumable queues of every channel and
        says when each queue's next message is due: one round trip per wake-up.
        """
        start = monotonic()
        while True:
            if worker_stopping():  # no new claims (nor receivers) once the worker is shutting down
                raise TimeoutError
            self.maintain()
            queues = self.consumable_queues()
            if queues and self._should_poll(queues):
                token = self.change_token(queues)  # before the poll: a change during it is seen by the wait below
                delivered = self._poll(queues)
                self._token = token
                if delivered:
                    return
            elapsed = monotonic() - start
            if timeout is not None and elapsed >= timeout:
                raise TimeoutError  # socket.timeout is TimeoutError
            wait = self.polling_interval - (monotonic() - self._last_poll) if queues else self.polling_interval
            if timeout is not None:
                wait = min(wait, timeout - elapsed)
            wait = min(wait, self._next_due(queues) - time.time(), self._until_maintenance())
            # changes since the last poll (even those before this call) end the wait at once
            token = self._token if self._token is not None else self.change_token(queues)
            if self.consumable_queues() != queues:
                continue  # a consumer got room meanwhile (an ack in the pool's result thread): look again
            if self.wait_for_change(token, min(max(wait, MIN_WAIT), STOP_CHECK)):
                self._dirty = True

    def _next_due(self, queues: Sequence[str]) -> float:
        return min((self._due.get(q, math.inf) for q in queues), default=math.inf)

    def _should_poll(self, queues: list[str]) -> bool:
        return (
            self._dirty
            or not self._polled.issuperset(queues)  # a consumer with new room: its queue may have filled meanwhile
            or time.time() >= self._next_due(queues)
            or monotonic() - self._last_poll >= self.polling_interval
        )

    def _poll(self, queues: list[str]) -> bool:
        """Claim one message of ``queues`` and deliver it; remember when each queue has its next message due.

        Returns True if a message was delivered.
        """
        no_ack = {q for c in self.channels if not c.closed for q in c._noack_queues}.intersection(queues)
        claims = self._claim(queues, no_ack)
        self._polled, self._last_poll, self._dirty = set(queues), monotonic(), False
        delivered = decode_claims(
            self.store, claims, no_ack, cap=self.backoff_cap, limit_of=self.delivery_limit, dead=self.dead_lettered
        )
        for payload, queue in delivered:
            self._deliver(payload, queue)
        return bool(delivered)

    def _claim(self, queues: list[str], no_ack: set[str]) -> list[ClaimedDelivery]:
        """Claim up to :meth:`poll_limit` due messages of ``queues`` (one :meth:`BrokerStore.poll`) and remember when
        each queue has its next message due."""
        claims, self._due = self.store.poll(queues, no_ack=no_ack, limit=self.poll_limit(), lease=self.lease_seconds)
        return claims

    def delivery_limit(self, queue: str) -> int | None:
        """How many deliveries a message of ``queue`` gets before it is dead-lettered (None: no limit): the
        transport option ``max_deliveries_per_queue``, else the queue's ``x-delivery-limit``, else
        ``max_deliveries``."""
        if queue in self.max_deliveries_per_queue:
            return self.max_deliveries_per_queue[queue]
        for channel in self.channels:
            declared = channel.delivery_limits.get(queue)
            if declared is not None:
                return declared or None
        return self.max_deliveries

    def dead_lettered(self, letter: DeadLetter, channel: StoreChannel | None = None) -> None:
        """A message was moved to the dead letters: log it, announce it as a ``task-rejected`` event (Flower shows
        the task as REJECTED), and fail its run with the cause (:meth:`world` permitting)."""
        logger.error("%s (dead letter %s)", letter.describe(), letter.id)
        if channel is None:
            channel = next((c for c in self.channels if not c.closed), None)
        if channel is not None and letter.task_id:
            self._quietly("announce a dead letter", announce_dead_letter, channel, letter)
        if letter.run_id:
            self._settle([letter])

    def _settle(self, letters: Sequence[DeadLetter] | None = None) -> None:
        """Fail the runs of ``letters`` (None: of the dead letters nobody settled yet, e.g. because the process that
        moved them died before failing their runs) and record them as settled."""
        store = self.store if isinstance(self.store, dead_letters.DeadLetterStore) else None
        if letters is None:
            if store is None:
                return
            letters = self._quietly("look for unsettled dead letters", store.unsettled_dead_letters)
            if not letters:
                return
        world = self._quietly("open the World of a dead letter", self.world)
        if world is None:
            return
        failed = self._quietly("fail the runs of dead letters", dead_letters.settle, world, store, letters)
        for run_id in failed or ():
            logger.error("run %s failed: a delivery of it was dead-lettered", run_id)

    def world(self) -> Any:
        """The World whose queue this transport carries, to fail runs whose deliveries are dead-lettered: opened
        on first use by :meth:`open_world` and closed with the connection."""
        if self._world is None:
            self._world = self.open_world()
        return self._world

    def open_world(self) -> Any:
        """A World on this transport's store, or None (here: a store that carries no World's runs)."""
        return None

    def poll_limit(self) -> int:
        """How many messages one poll may claim: 1 here (a table answers at once, so claiming as room frees up costs
        nothing); a broker whose receives are round trips (SQS) takes up to the prefetch room at once."""
        return 1

    def consumable_queues(self) -> list[str]:
        """The queues consumed by open channels that have prefetch room."""
        queues: dict[str, None] = {}
        for channel in self.channels:
            if not channel.closed and channel._consumers and channel.qos.can_consume():
                queues.update(dict.fromkeys(channel._active_queues))
        return list(queues)

    def change_token(self, queues: Sequence[str]) -> Any:
        """Taken before looking for messages of ``queues``; :meth:`wait_for_change` ends early on a later change.

        The default asks the store for a token of any change; a store that can wait per queue (Postgres
        LISTEN/NOTIFY) overrides this in its transport.
        """
        return self.store.change_token()

    def wait_for_change(self, token: Any, timeout: float) -> bool:
        """Block until the store changed after ``token`` was taken (True), or ``timeout`` seconds pass."""
        return bool(self.store.wait_for_change(token, timeout))

    def _until_maintenance(self) -> float:
        return max(min(self._next_heartbeat, self._next_gc) - monotonic(), 0.0)

    def _heartbeat_period(self) -> float:
        period = self.heartbeat_interval
        for channel in self.channels:
            expires = None if channel.closed else channel.shortest_expiry()
            if expires:
                period = min(period, expires / 4)
        return max(period, 0.05)

    def maintain(self) -> None:
        """Refresh consumed queues and collect garbage, each when it is due (leases: see :meth:`_keep_leases`)."""
        self._start_keeper()
        now = monotonic()
        channels = [c for c in self.channels if not c.closed]
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self._heartbeat_period()
            for channel in channels:
                if channel._tag_to_queue:
                    self._quietly("refresh consumed queues", channel.heartbeat)
        if now >= self._next_gc:
            self._next_gc = now + self.gc_interval
            collected = self._quietly("collect garbage", self.store.gc, consumer_timeout=self.consumer_timeout)
            if collected and any(collected.values()):
                logger.debug("collected %s", collected)
            self._settle()

    def _start_keeper(self) -> None:
        if self._keeper is None or not self._keeper.is_alive():
            self._keeper_stop.clear()
            self._keeper = threading.Thread(target=self._keep_leases, name="celery_workflow-leases", daemon=True)
            self._keeper.start()

    def _keep_leases(self) -> None:
        """Extend the leases of every unacked message this process holds, every ``lease_seconds / 4``.

        A thread of its own, so a task that blocks the consuming thread (``--pool=solo``) never outlives its lease; a
        failed round (logged) still leaves three more before a lease could run out.
        """
        period = max(self.lease_seconds / 4, 0.05)
        while not self._keeper_stop.wait(period):
            receipts = [r for c in list(self.channels) if not c.closed for r in c.held_receipts()]
            if receipts:
                self._quietly("extend leases", self.store.extend, receipts, self.lease_seconds)

    def close_connection(self, connection: Any) -> None:
        self._keeper_stop.set()
        world, self._world = self._world, None
        if world is not None:
            self._quietly("close the World", world.close)
        super().close_connection(connection)

    @staticmethod
    def _quietly(what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        try:
            return fn(*args, **kwargs)
        except WorldError as exc:
            logger.warning("broker maintenance: cannot %s (will retry): %s", what, exc)
            return None


# a worker on these transports runs the prefork pool that survives a child dying with a pipe lock
_pool_hook.connect()
