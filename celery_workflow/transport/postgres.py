"""Postgres transport for Celery: the queue table of the Postgres World, consumed by unmodified Celery workers.

A thin layer over :mod:`celery_workflow.transport.base` and :class:`celery_workflow._postgres.queue.PostgresQueue`: every
process on any host (workers, their pool children, ``celery inspect``, Flower, the application) connects to the same
database and schema, so messages, exchanges, bindings and queue declarations are shared.

Features
========
* Type: Virtual, asynchronous (Celery's event loop and its own prefork pool; the listener thread wakes the hub).
* Supports Direct: Yes
* Supports Topic: Yes
* Supports Fanout: Yes (bindings stored in the database: ``celery inspect``, remote control and Flower work)
* Supports Priority: No
* Supports TTL: Yes (``x-message-ttl``, ``x-expires``, auto_delete, and a message's own ``expiration``)
* Delayed delivery: Yes (``properties["not_before"]`` or Celery's ``eta``/``countdown``: rows are not received
  before they are due)
* Leases: received messages are claimed with ``FOR UPDATE SKIP LOCKED`` and hidden for ``lease_seconds``; the lease
  is extended while the consumer holds them; ack deletes, requeue/shutdown releases, reject without requeue backs
  off (1 s, 2 s, 4 s … 5 min). Times are the database server's clock, so hosts need not agree on the time.
* Idempotency: ``apply_async(..., idempotency_key="k", run_id="r")`` deduplicates against a pending message.
* Wake-up: every insert sends ``NOTIFY celery_workflow_queue, '<queue>'`` in its transaction; a waiting consumer
  (one ``LISTEN`` connection per process) wakes for its own queues only, and re-checks at least every
  ``polling_interval``, so delayed rows that become due and lost notifications cost at most that long.
* Hand-offs: a consumer that found nothing to claim leaves a standing claim on its queues, and a message published
  while it waits (due now, without an idempotency key) is stored already leased to it and named to it by a
  notification keyed by its claim (ids only: notifications never carry a message); it reads the row by its key, with
  no claim, and no other consumer is woken (see :mod:`celery_workflow._postgres.standing`; transport option
  ``hand_off``).
* Reconnection: transactions are retried on lost connections (a restarted server, terminated backends) and the
  listener reconnects by itself; what still fails raises a connection error, so Celery reconnects.

Connection String
=================
Select the transport with ``broker_transport`` and give a libpq URL (or a ``key=value`` conninfo string):

.. code-block::

    broker_transport = "celery_workflow.transport.postgres:Transport"
    broker_url = "postgresql://app@db.example.com:5432/app?options=-csearch_path%3Dworkflows&sslmode=require"

The transport parses the URL itself (``can_parse_url``), so Kombu keeps it whole and every libpq parameter survives
(``options=-csearch_path=…`` picks the schema; ``sslmode``, ``application_name``, ``connect_timeout`` …). This is the
same URL as the Postgres World's. The tables are created (migrated) in that schema on first connection. Importing
this module also registers ``postgresql`` and ``postgres`` as Kombu transport aliases, so a plain
``kombu.Connection("postgresql://…")`` (Celery builds one to censor ``inspect conf`` output) resolves to it too.

Keep the password out of the URL: Kombu reports the URL as the connection's hostname, and Celery workers include
that in ``inspect stats`` (and so in Flower). libpq's ``PGPASSWORD`` / ``~/.pgpass``, or Celery's
``broker_password`` (and ``broker_user``), which this transport adds to the connection string, all work.
Connection poolers in transaction mode (PgBouncer) do not support ``LISTEN``: point at Postgres directly or use
session pooling.

Transport Options
=================
* ``lease_seconds`` (60): how long a received, unacked message stays hidden without being extended; it only
  bounds how quickly a crashed worker's message is delivered again.
* ``polling_interval`` (1.0): longest wait between checks when no notification arrives.
* ``heartbeat_interval`` (5.0): how often consumers refresh their queues (at most a quarter of ``x-expires``).
* ``gc_interval`` (10.0): how often each connection tries to collect expired queues and messages (one collector at
  a time per schema).
* ``consumer_timeout`` (60.0): a consumer silent that long is dead; its auto_delete queues are deleted.
* ``hand_off`` (True): idle consumers leave standing claims that publishers hand messages to (False: they only
  poll; publishers hand messages to other consumers still).
* ``pool_timeout`` (2.0): longest wait for a pooled connection per attempt; with the database unreachable, failed
  transactions are retried for about ``8 * pool_timeout + 7`` seconds before Celery sees a connection error and
  reconnects. Applies per process and connection string (the first connection's value).
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
from kombu.transport import TRANSPORT_ALIASES
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from celery_workflow._postgres.database import PgDatabase
from celery_workflow._postgres.listener import CHANNEL_QUEUE
from celery_workflow._postgres.queue import PostgresQueue
from celery_workflow._postgres.standing import Registration, StandingClaim
from celery_workflow.transport.base import BrokerStore, StoreChannel, StoreTransport, worker_stopping
from celery_workflow.world import ClaimedDelivery

__all__ = ["Channel", "Transport", "broker_database", "close_store", "conninfo", "mask_password", "shared_queue"]

_SCHEMES = ("postgresql", "postgres")
_lock = threading.Lock()
_stores: dict[str, PostgresQueue] = {}

# Celery builds ``kombu.Connection(broker_url)`` without the transport in places (``inspect conf`` censors the URL
# through it): once this module is imported, the scheme resolves to this transport (Kombu has none of its own).
for _scheme in _SCHEMES:
    TRANSPORT_ALIASES.setdefault(_scheme, "celery_workflow.transport.postgres:Transport")


def conninfo(url: str | None) -> str:
    """The libpq connection string of a broker URL, unchanged (``postgresql://…``, ``postgres://…`` or key=value).

    Raises ValueError for another scheme or a string libpq cannot parse.
    """
    text = (url or "").strip()
    if not text:
        raise ValueError("the Postgres transport needs a broker URL: postgresql://user@host:5432/dbname")
    if "://" in text and text.split("://", 1)[0].lower() not in _SCHEMES:
        raise ValueError(f"the Postgres transport needs a postgresql:// URL, got {mask_password(text)!r}")
    try:
        conninfo_to_dict(text)
    except psycopg.Error as exc:
        raise ValueError(f"invalid Postgres connection string {mask_password(text)!r}: {exc}") from exc
    return text


def mask_password(url: str, mask: str = "**") -> str:
    """``url`` with its password (URL or ``password=`` parameter) replaced by ``mask``."""
    if "://" not in url:
        try:
            params = conninfo_to_dict(url)
        except psycopg.Error:
            return url
        if "password" in params:
            params["password"] = mask
        return make_conninfo("", **params)
    parts = urlsplit(url)
    if parts.password is None:
        return url
    userinfo, _, hostinfo = parts.netloc.rpartition("@")
    user = userinfo.split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:{mask}@{hostinfo}"))


def broker_database(url: str, *, pool_timeout: float = 2.0) -> PgDatabase:
    """A :class:`PgDatabase` whose pool waits at most ``pool_timeout`` seconds for a connection and whose sessions
    commit lazily (claims, acks, leases, declarations: see :mod:`celery_workflow._postgres.queue`; published messages are
    still on disk when ``put`` returns).

    psycopg_pool waits 30 s by default, and :meth:`PgDatabase.run` retries lost connections 8 times: with the
    database refusing connections, a consumer would block for minutes before Celery's own reconnection (with its
    logging, backoff and prompt shutdown) could take over. With 2 s it gives up after about 25 s.
    """
    return PgDatabase(url=url, timeout=pool_timeout, lazy_commits=True)


def shared_queue(url: str, *, pool_timeout: float = 2.0) -> PostgresQueue:
    """One migrated :class:`PostgresQueue` per connection string and process (its pool is fork-safe).

    ``pool_timeout`` applies when this process first opens ``url``.
    """
    with _lock:
        queue = _stores.get(url)
        if queue is None:
            db = broker_database(url, pool_timeout=pool_timeout)
            try:
                db.migrate()
            except BaseException:
                db.close()
                raise
            queue = _stores[url] = PostgresQueue(db)
        return queue


def close_store(url: str) -> None:
    """Close and forget this process's store for ``url`` (its pool and listener), e.g. before dropping a schema."""
    with _lock:
        queue = _stores.pop(url, None)
    if queue is not None:
        queue.db.close()


class Channel(StoreChannel):
    """Postgres channel: :class:`~celery_workflow.transport.base.StoreChannel`, whose acks may register the consumer's
    standing claim in their round trip (:meth:`Transport.ack`) and whose cancels withdraw it."""

    def _ack_stored(self, receipt: str) -> None:
        transport = self.connection
        if transport is None:
            super()._ack_stored(receipt)
        else:
            transport.ack(self, receipt)

    def basic_cancel(self, consumer_tag: Any) -> Any:
        """Cancel as every store channel does, then withdraw a standing claim on the queue left (a closing channel
        does that once, after cancelling all its consumers: see :meth:`close`)."""
        try:
            return super().basic_cancel(consumer_tag)
        finally:
            transport = self.connection
            if transport is not None and not self.closed:
                transport.withdraw_unconsumed()

    def close(self) -> None:
        """Close as every store channel does (each consumer cancelled), then withdraw a standing claim on the queues
        left, once: with the database away, each attempt waits out its retries."""
        transport = self.connection  # None once closed (close_channel forgets it)
        try:
            super().close()
        finally:
            if transport is not None:
                transport.withdraw_unconsumed()


class Transport(StoreTransport):
    """Kombu transport over a Postgres schema (``driver_type`` ``celery_workflow_postgres``)."""

    Channel = Channel

    can_parse_url = True
    default_port = 5432
    driver_type = "celery_workflow_postgres"
    driver_name = "psycopg"

    connection_errors = (*StoreTransport.connection_errors, psycopg.OperationalError, psycopg.InterfaceError)
    channel_errors = (*StoreTransport.channel_errors, psycopg.OperationalError, psycopg.InterfaceError)

    pool_timeout = 2.0

    def __init__(self, client: Any, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        options = client.transport_options or {}
        if options.get("pool_timeout") is not None:
            self.pool_timeout = float(options["pool_timeout"])
        #: The listener key pokes of this transport use: acks wake this connection's waiting consumer only.
        self._wake_key = f"celery_workflow.wake:{uuid.uuid4().hex}"
        self.hand_off = bool(options.get("hand_off", True))
        self._standing_claim: StandingClaim | None = None
        self._standing_lock = threading.RLock()  # the consumer's claims and the acks of other threads
        #: The notification keys the consumer looked at last (its queues, wake-up key and standing claim's token): on
        #: the event loop, only these wake the hub (see watch_changes).
        self._interest: frozenset[str] = frozenset()

    def open_store(self) -> BrokerStore:
        url = conninfo(self.client.hostname)
        extra = {"user": self.client.userid, "password": self.client.password}
        if any(extra.values()):  # Celery's broker_user / broker_password: secrets kept out of the URL
            url = make_conninfo(url, **{k: v for k, v in extra.items() if v})
        return shared_queue(url, pool_timeout=self.pool_timeout)

    @property
    def pg_queue(self) -> PostgresQueue:
        """The store, typed as what it is."""
        store = self.store
        assert isinstance(store, PostgresQueue)
        return store

    @property
    def standing(self) -> StandingClaim:
        """This connection's standing claims (see :mod:`celery_workflow._postgres.standing`)."""
        if self._standing_claim is None:
            self._standing_claim = StandingClaim(self.pg_queue)
        return self._standing_claim

    def change_token(self, queues: Sequence[str]) -> Any:
        """Notification marks of ``queues``, of this transport's wake-up key and of its standing claims' hand-offs
        (taken before claiming)."""
        keys = [*queues, self._wake_key, self.standing.token]
        self._interest = frozenset(keys)
        return self.pg_queue.change_token(keys)

    def watch_changes(self, wake: Callable[[], None]) -> Callable[[], None]:
        """On the event loop: the process's listener thread wakes the hub when a notification of a key the consumer
        looked at arrives (a message on one of its queues, a hand-off to its standing claim), and when the listener
        reconnects (notifications may have been lost). Other queues' notifications wake nothing."""
        listener = self.pg_queue.db.listener

        def heard(channel: str | None, key: str | None) -> None:
            if channel is None or (channel == CHANNEL_QUEUE and key in self._interest):
                wake()

        listener.watch(heard)
        return lambda: listener.unwatch(heard)

    def _claim(self, queues: list[str], no_ack: set[str]) -> list[ClaimedDelivery]:
        """The message handed to this consumer's standing claim, when its notification came (read by its key);
        else claim the row a notification announced by its key when :meth:`_notified_row` finds one; else (or when
        another consumer had it) poll the queues, registering a standing claim on them when the poll finds nothing.
        A live standing claim is withdrawn in the round trip of whichever claim comes first, unless nothing was
        announced since the last look (:meth:`_standing_holds`)."""
        with self._standing_lock:
            return self._claim_standing(queues, no_ack)

    def _claim_standing(self, queues: list[str], no_ack: set[str]) -> list[ClaimedDelivery]:
        standing = self.standing
        handed = standing.take()
        if handed is not None:
            return [handed]
        if self._standing_holds(queues, no_ack):
            return self._look_while_standing(queues, no_ack)
        withdraw = standing.withdrawal()
        notified = self._notified_row(queues, no_ack)
        if notified is not None:
            claims = self.pg_queue.claim_notified(*notified, lease=self.lease_seconds, withdraw=withdraw)
            withdraw = None
            standing.withdrawn()
            if claims:
                return claims
        offer = standing.offer([q for q in queues if q not in no_ack]) if self.hand_off else None
        claims, self._due = self.pg_queue.poll(
            queues, no_ack=no_ack, limit=self.poll_limit(), lease=self.lease_seconds, withdraw=withdraw, register=offer
        )
        standing.withdrawn()
        if offer is not None and not claims:
            standing.registered(offer)
        return claims

    def _standing_holds(self, queues: list[str], no_ack: set[str]) -> bool:
        """Whether a poll may leave the live standing claim as it is: nothing was announced since the last look (a
        periodic look, or a queue's due time), the claim covers the same queues and the listener holds the same
        lock. An idle consumer then writes nothing when it looks again."""
        live = self.standing.live
        return (
            live is not None
            and not self._dirty
            and set(live.queues) == {q for q in queues if q not in no_ack}
            and live.lock_key == self.pg_queue.db.listener.lock_key
        )

    def _look_while_standing(self, queues: list[str], no_ack: set[str]) -> list[ClaimedDelivery]:
        """Poll without touching the standing claim; if the poll claims something after all (a delayed message
        now due, a lease run out), withdraw the claim, releasing what may have been handed to it meanwhile."""
        claims, self._due = self.pg_queue.poll(queues, no_ack=no_ack, limit=self.poll_limit(), lease=self.lease_seconds)
        if claims:  # delivered whatever happens next (a failed withdrawal is retried by the next claim)
            self._quietly("withdraw a standing claim", self.standing.withdraw)
        return claims

    def ack(self, channel: StoreChannel, receipt: str) -> None:
        """Delete an acked message (any thread); when the consumer waits on the channel's queues with nothing heard
        on them since it last looked and nothing due that it saw then, register its standing claim in the same
        round trip: the room this ack frees is offered to the next message at once, with no poll (one would find
        nothing)."""
        with self._standing_lock:
            offer = self._offer_on_ack(channel)
            self.pg_queue.ack(receipt, register=offer, lease=self.lease_seconds)
            if offer is not None:
                self.standing.registered(offer)

    def _offer_on_ack(self, channel: StoreChannel) -> Registration | None:
        standing = self._standing_claim
        token = self._token
        marks = None if token is None else token[1]
        if not self.hand_off or standing is None or standing.live is not None or marks is None or worker_stopping():
            return None
        if channel.closed or not channel._consumers:
            return None
        queues = [q for q in channel._active_queues if q not in channel._noack_queues]
        store, now = self.pg_queue, time.time()
        if not queues or any(q not in marks or store.mark(q) != marks[q] for q in queues):
            return None  # not looked at since it last claimed, or announced a message since: its next poll looks
        if any(self._due.get(q, math.inf) <= now for q in queues):
            return None  # its last look left a message due (a backlog): its next poll claims it
        return standing.offer(queues)

    def maintain(self) -> None:
        """As every store transport does; and withdraw a standing claim on queues this connection no longer
        consumes with room, which it could not deliver (see :meth:`withdraw_unconsumed`)."""
        super().maintain()
        self.withdraw_unconsumed()

    def withdraw_unconsumed(self) -> None:
        """Withdraw the standing claim if one of its queues is no longer consumed with room here: a consumer was
        cancelled or its channel closed. Called by the cancel itself, since nothing may drain this connection
        again (a ``with Consumer(...)`` block that ended, a connection back in a pool): a message handed to the
        claim then would stay leased to it, out of every other reader's reach, until the lease ran out."""
        live = self._standing_claim.live if self._standing_claim is not None else None
        if live is not None and not set(live.queues).issubset(self.consumable_queues()):
            self._withdraw()

    def stopping(self) -> None:
        """A stopping worker takes no new messages: its standing claim is withdrawn."""
        if self._standing_claim is not None and self._standing_claim.live is not None:
            self._withdraw()

    def close_connection(self, connection: Any) -> None:
        if self._standing_claim is not None:
            self._withdraw(forget=True)
            self._standing_claim = None
        super().close_connection(connection)

    def _withdraw(self, *, forget: bool = False) -> None:
        with self._standing_lock:
            if self._standing_claim is not None:
                self._quietly("withdraw a standing claim", self._standing_claim.withdraw, forget=forget)

    def _notified_row(self, queues: list[str], no_ack: set[str]) -> tuple[str, int] | None:
        """The queue and row id of the one message announced since the last claim, when it is the queue's only
        claimable row: the only notification of these queues since then, on a queue that had nothing claimable at
        that claim (else its older rows go first) and that is not a no-ack queue."""
        token = self._token
        marks = None if token is None else token[1]
        if marks is None:
            return None
        store = self.pg_queue
        current = {q: store.mark(q) for q in queues}
        changed = [q for q in queues if current[q] != marks.get(q)]
        if len(changed) != 1:
            return None
        name = changed[0]
        (epoch, count), before = current[name], marks.get(name)
        if before is None or name in no_ack or (epoch, count - 1) != tuple(before):
            return None  # a new queue, a no-ack one, a reconnected listener, or several notifications
        if self._due.get(name, math.inf) <= time.time():
            return None
        carried = store.carried(name)
        return (name, int(carried)) if carried is not None and carried.isdigit() else None

    def wait_for_change(self, token: Any, timeout: float) -> bool:
        """Block until one of the queues of ``token`` is notified after it, or until ``timeout``; True if one was.

        A wake-up alone (an ack freed prefetch room, :meth:`wake`) ends the wait but is no change of the store: the
        consumer looks at its queues again and claims only if one of them was notified since its last claim (the
        queues' marks in ``token`` stay as they were; the wake-up's mark moves on), or is due. Counting it as a
        change made every ack claim at once, finding nothing but holding up the claim of the next message the
        notification of which arrived meanwhile."""
        queue = self.pg_queue
        if not queue.wait_for_change(token, timeout):
            return False
        _, marks = token
        if marks is None or self._wake_key not in marks:
            return True
        woken = queue.mark(self._wake_key)
        if any(queue.mark(q) != mark for q, mark in marks.items() if q != self._wake_key):
            return True
        marks[self._wake_key] = woken
        return False

    def wake(self) -> None:
        """Wake this connection's consumer (called from any thread): on the event loop through the hub's wake-up pipe,
        else by poking its wake-up key (a blocked :meth:`drain_events` waits on it; no NOTIFY is sent)."""
        if self._hub is not None:
            super().wake()
        elif self._store is not None:
            self.pg_queue.poke(self._wake_key)

    def open_world(self) -> Any:
        """The Postgres World of this schema (it fails runs whose deliveries are dead-lettered), on a small pool."""
        from celery_workflow._postgres.world import PostgresWorld

        return PostgresWorld.open(self.pg_queue.db.conninfo, concurrency=1, migrate=False)

    def driver_version(self) -> str:
        return str(psycopg.__version__)

    def as_uri(self, uri: str, include_password: bool = False, mask: str = "**") -> str:
        return uri if include_password else mask_password(uri, mask)

    @property
    def default_connection_params(self) -> dict[str, Any]:
        return {"port": self.default_port}
