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
* **Undecodable messages go to the dead letters.** A stored row Kombu cannot make a message of is moved when taken
  (:func:`~.store.envelope_problem`); a message whose body its consumer could not decode (not what its content type
  says, a compression or transfer encoding that does not undo) is moved when the consumer acks or rejects it:
  Celery's consumer logs "Can't decode message body" and *acks* such a message, which would delete it
  (:class:`~.channel.StoreMessage`).
* **Per-message TTL.** A message's ``expiration`` property (AMQP's, in milliseconds: ``Producer.publish(expiration=
  seconds)``, Celery's ``apply_async(expires=…)``) makes it expire that long after it was published, on the store's
  clock, whatever its due time; an expired message is never delivered, got or counted, and is dropped (deleted by
  ``gc``), not dead-lettered, as RabbitMQ drops it from a queue without a dead-letter exchange. A queue's
  ``x-message-ttl`` still applies (the earlier expiry wins). A malformed ``expiration`` is refused at publish (a
  ``ChannelError``, as RabbitMQ's PRECONDITION_FAILED). Stores that honour it: SQLite and Postgres
  (:class:`~.store.ExpiringStore`); the SQS store ignores it.
* **Routing state in the store.** Exchanges, bindings and queue declarations are persisted; ``get_table`` reads
  bindings of every exchange type from the store (pidbox replies use a direct exchange declared only by the client),
  ``typeof`` falls back to the stored exchange type, and fanout copies are written by the store for every bound queue.
* **Queue arguments.** ``prepare_queue_arguments`` keeps ``x-expires`` / ``x-message-ttl`` (RabbitMQ style); consumers
  refresh their queues every ``heartbeat_interval`` (at most a quarter of the shortest ``x-expires``) and
  :meth:`BrokerStore.gc` (every ``gc_interval``) collects unused queues, auto_delete queues of dead consumers and
  expired messages; a consumed queue that was collected anyway (its process stalled) is declared and bound again.
* **Wake-ups.** In a Celery worker the transport runs on Celery's event loop (``implements.asynchronous``: Celery's
  ``asynloop`` and its own prefork pool): :meth:`StoreTransport.register_with_event_loop` adds a wake-up pipe and
  timers to the hub, and claims run on the hub's thread when a change notification for a consumed queue arrives (the
  Postgres listener, a thread watching SQLite's ``PRAGMA data_version``, the SQS receivers), an ack frees prefetch
  room, a queue's due time comes, or ``polling_interval`` passes (:mod:`~celery_workflow.transport.eventloop`).
  Elsewhere (clients, gevent/eventlet workers) ``drain_events`` blocks: it asks the store (:meth:`BrokerStore.poll`:
  claim the oldest due message of the consumable queues of every channel, and learn each queue's next due time) only
  when one of the same things happened since the last poll, waiting in between on the change token taken just
  before the last poll, so a change during or after that poll is never missed; a transport whose store can wait per
  queue (Postgres LISTEN/NOTIFY) overrides :meth:`StoreTransport.change_token`. Never a blind sleep.

Transport options: ``lease_seconds`` (60), ``polling_interval`` (1.0), ``heartbeat_interval`` (5.0),
``gc_interval`` (10.0), ``consumer_timeout`` (60.0: a consumer silent that long is considered dead).
Message properties read by ``_put``: ``not_before``, ``run_id``, ``idempotency_key`` (any ``apply_async`` keyword
Kombu does not know ends up in the properties) and ``expiration``.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from time import monotonic
from typing import Any, TypeVar

from kombu.transport import virtual as _virtual

from celery_workflow import dead_letters
from celery_workflow.dead_letters import DEFAULT_MAX_DELIVERIES, DeadLetter
from celery_workflow.errors import WorldError
from celery_workflow.transport.channel import StoreChannel
from celery_workflow.transport.eventloop import ChangeWaiter, HubConsumer, worker_stopping
from celery_workflow.transport.store import (
    BACKOFF_CAP,
    BindingRow,
    BrokerStore,
    backoff,
    decode_claims,
    dumps,
    message_due,
)
from celery_workflow.world import ClaimedDelivery

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
    "worker_stopping",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Kombu is only partly typed: use its classes and helpers as Any.
_VirtualTransport: Any = _virtual.Transport


MIN_WAIT = 0.001
#: The longest pause between polls while a message the store says is due cannot be claimed (another transaction
#: holds its row: a duplicate joining it, until that commits). The pause doubles from ``MIN_WAIT`` up to this, so a
#: held row costs a few polls instead of one every millisecond, and is taken at most this long after it is free.
HELD_BACKOFF_MAX = 0.25
#: How often a blocked ``drain_events`` looks whether the Celery worker around it was asked to stop.
STOP_CHECK = 0.2


#: Celery's event exchange (``event_exchange``), where dead letters are announced.
EVENT_EXCHANGE = "celeryev"


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


class StoreTransport(_VirtualTransport):  # type: ignore[misc]
    """A virtual transport whose state lives in a :class:`BrokerStore`, on Celery's event loop in a worker
    (:meth:`register_with_event_loop`, :mod:`~celery_workflow.transport.eventloop`) and blocking in
    :meth:`drain_events` everywhere else (clients, gevent/eventlet workers, which run Celery's ``synloop``).

    Subclasses implement :meth:`open_store` and set ``driver_type`` / ``driver_name``.
    """

    Channel = StoreChannel

    implements = _VirtualTransport.implements.extend(
        asynchronous=True,
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
        self._held_backoff = 0.0  # the pause before polling again a queue whose due message could not be claimed
        self._token: Any = None  # the change token taken just before the last poll
        self._world: Any = None  # see world()
        self._hub: HubConsumer | None = None  # on Celery's event loop: see register_with_event_loop

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

    # -- Celery's event loop (kombu's hub) -------------------------------------------------------------------------

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        """Celery's consumer hands its hub over when it connects: claims run on the hub's thread from now on, woken
        as :mod:`~celery_workflow.transport.eventloop` describes."""
        if self._hub is not None:
            self._hub.close()
        self._hub = HubConsumer(self, loop)

    def on_readable(self, fileno: int) -> None:
        """The hub's reader callback (kombu's name for it): the wake-up pipe was written to."""
        if self._hub is not None:
            self._hub.on_readable(fileno)

    def wake(self) -> None:
        """Have the consumer look at its queues again soon (any thread): an ack or reject freed prefetch room. On the
        hub, through its wake-up pipe; a blocked :meth:`drain_events` notices by itself (a subclass may do more)."""
        if self._hub is not None:
            self._hub.wake()

    def watch_changes(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Call ``wake`` (from any thread) whenever the store may have changed for this transport's consumers; return
        what stops it. Here a thread waits on the store's change token (:class:`ChangeWaiter`: SQLite's
        ``PRAGMA data_version``); a store that can call back (the Postgres listener, the SQS receivers) overrides."""
        waiter = ChangeWaiter(self.store, wake, STOP_CHECK)
        waiter.start()
        return waiter.stop

    # -- blocking loop (synloop, clients) ---------------------------------------------------------------------------

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
                self.stopping()
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
            wait = min(wait, max(self._next_due(queues) - time.time(), self._held_backoff), self._until_maintenance())
            # changes since the last poll (even those before this call) end the wait at once
            token = self._token if self._token is not None else self.change_token(queues)
            if self.consumable_queues() != queues:
                continue  # a consumer got room meanwhile (an ack in the pool's result thread): look again
            if self.wait_for_change(token, min(max(wait, MIN_WAIT), STOP_CHECK)):
                self._dirty = True

    def stopping(self) -> None:
        """The Celery worker around this transport was asked to stop: it takes no new messages (a hook)."""

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
        if claims or self._next_due(queues) > time.time():
            self._held_backoff = 0.0
        else:  # a message is due but none could be claimed: its row is held by another transaction
            self._held_backoff = min(max(2 * self._held_backoff, MIN_WAIT), HELD_BACKOFF_MAX, self.polling_interval)
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
        hub, self._hub = self._hub, None
        if hub is not None:
            hub.close()
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
