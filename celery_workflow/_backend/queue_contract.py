"""The queue contract, in layers: what a World's queue is, what a store adds for dead letters, what a broker needs.

One set of protocols for every queue in the package (the World protocol's queue methods, the queue store a SQL World
keeps its deliveries in, the dead letters, the storage of a Kombu transport), each layer adding to the one below::

    Receipts                 ack · release · retry_later · extend         (what the holder of a claim does with it)
     │
     ├── WorldQueue          + enqueue · claim                            (the World protocol's queue: every World)
     │    │
     │    └── QueueStore     + DeadLetterStore (dead_letter, list / get, unsettled / settle, redrive / purge)
     │         │                                                          (what StoreQueue gives a World's queue to)
     │         ▼
     │    QueueBrokerStore   = QueueStore + BrokerStore                   (SQLiteQueue, PostgresQueue, RedisStore: one
     │         ▲                                                           store behind a World and its transport)
     │         │
     └── BrokerStore         + BrokerMessages: put · put_fanout · receive · poll · peek · size · purge
              │                + BrokerRouting: queues, exchanges, bindings, consumers · gc
              │                + BrokerChanges: change_token / wait_for_change
              │                                                           (what a Kombu transport needs; SQS's too)
              ├── ExpiringStore  + a per-message ttl on put / put_fanout  (SQLiteQueue, PostgresQueue)
              └── ControlStore   + due_times · queue_info · on_change · close
                                                                          (RedisStore: the SQS store's control channel)

:class:`DeadLetterStore` stands alone as well: the AWS World's dead letters (its queues' SQS dead-letter queues) are
one without being a queue store. The names stay importable where they were defined before (``world.World`` inherits
:class:`WorldQueue`; ``dead_letters.DeadLetterStore``, ``_backend.base.QueueStore``, ``transport.store.BrokerStore``,
``ExpiringStore`` and ``BindingRow`` re-export these). Every method of every store is thread-safe and its own
transaction; a receipt names one claim, and operations with a stale receipt change nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: the modules defining these records import this one
    from celery_workflow._backend.broker import QueuedMessage
    from celery_workflow.dead_letters import DeadLetter
    from celery_workflow.world import ClaimedDelivery, Delivery

__all__ = [
    "BindingRow",
    "BrokerChanges",
    "BrokerMessages",
    "BrokerRouting",
    "BrokerStore",
    "ControlStore",
    "DeadLetterStore",
    "ExpiringMessages",
    "ExpiringStore",
    "Leases",
    "QueueBrokerStore",
    "QueueStore",
    "Receipts",
    "WorldQueue",
]


class Receipts(Protocol):
    """What the holder of a claim does with it, by its receipt (every queue, every store)."""

    def ack(self, receipt: str) -> None:
        """Delete a claimed delivery."""
        ...

    def release(self, receipt: str) -> None:
        """Give a claimed delivery back at once (shutdown, requeue)."""
        ...

    def retry_later(self, receipt: str, delay: float, *, error: str | None = None) -> None:
        """Release a claimed delivery, due again in ``delay`` seconds: a failed delivery, whose ``error`` a World
        that keeps failure history records (it goes into the message's dead letter, should it come to that)."""
        ...

    def extend(self, receipts: Sequence[str], lease: float) -> None:
        """Extend the leases of claimed deliveries to ``lease`` seconds from now."""
        ...


class WorldQueue(Receipts, Protocol):
    """The queue of a World (:class:`celery_workflow.world.World` inherits these methods)."""

    def enqueue(self, deliveries: Sequence[Delivery]) -> list[bool]:
        """Store deliveries; ``False`` for one deduplicated by its idempotency key."""
        ...

    def claim(self, queues: Sequence[str], *, limit: int = 1, lease: float = 60.0) -> list[ClaimedDelivery]:
        """Claim due, unleased deliveries of these queues, oldest due first, hiding them for ``lease`` seconds."""
        ...


@runtime_checkable
class DeadLetterStore(Protocol):
    """Dead letters (see :mod:`celery_workflow.dead_letters`): of a queue store, or of SQS dead-letter queues."""

    def dead_letter(self, receipt: str, *, reason: str, error: str | None = None) -> DeadLetter | None:
        """Move the claimed message to the dead letters; None when the receipt is stale (nothing moved)."""
        ...

    def list_dead_letters(
        self, *, queue: str | None = None, run_id: str | None = None, after: int | str = 0, limit: int = 100
    ) -> list[DeadLetter]:
        """Dead letters with ids above ``after``, oldest first."""
        ...

    def get_dead_letter(self, letter_id: int | str) -> DeadLetter:
        """One dead letter; DeadLetterNotFound if there is none with that id."""
        ...

    def unsettled_dead_letters(self, *, limit: int = 100) -> list[DeadLetter]:
        """Dead letters whose run has not been failed because of them yet (see :func:`settle`), oldest first."""
        ...

    def settle_dead_letters(self, ids: Sequence[int | str]) -> None:
        """Record that the runs of these dead letters have been dealt with."""
        ...

    def redrive_dead_letters(self, ids: Sequence[int | str] | None = None, *, queue: str | None = None) -> int:
        """Put dead letters back on their queues (due now, attempts reset) and delete them; the number moved.
        ``ids`` and ``queue`` narrow the selection (neither: all). Redriving one twice moves it once."""
        ...

    def purge_dead_letters(self, ids: Sequence[int | str] | None = None, *, queue: str | None = None) -> int:
        """Delete dead letters (as :meth:`redrive_dead_letters` selects them); the number deleted."""
        ...


@runtime_checkable
class Leases(Protocol):
    """Named leases with one holder at a time (the relay's election, :mod:`celery_workflow.relay`), kept by a store
    beside its consumers' heartbeats (``SQLiteQueue``, ``PostgresQueue``) or by a World itself (``MemoryWorld``)."""

    def hold_lease(self, name: str, holder: str, seconds: float) -> bool:
        """Take or renew lease ``name`` for ``holder`` until ``seconds`` from now: True when ``holder`` holds it now,
        False when another holder's lease has not run out."""
        ...

    def drop_lease(self, name: str, holder: str) -> None:
        """Give lease ``name`` up, if ``holder`` holds it."""
        ...


class QueueStore(WorldQueue, DeadLetterStore, Protocol):
    """The queue part of a store (``SQLiteQueue``, ``PostgresQueue``, ``RedisStore``), with its dead letters: what
    :class:`~celery_workflow._backend.base.StoreQueue` gives a World's queue methods to."""


class BindingRow(Protocol):
    @property
    def exchange(self) -> str: ...
    @property
    def routing_key(self) -> str: ...
    @property
    def pattern(self) -> str | None: ...
    @property
    def queue(self) -> str: ...


class BrokerMessages(Protocol):
    """The messages of a broker store: put (one queue or an exchange's), claim for a consumer, look, count, purge."""

    def put(
        self, queue: str, payload: bytes, *, not_before: float | None = ..., run_id: str | None = ...,
        idempotency_key: str | None = ...,
    ) -> bool: ...  # fmt: skip
    def put_fanout(self, exchange: str, payload: bytes, *, not_before: float | None = ...) -> int: ...
    def receive(
        self, queues: Sequence[str], *, no_ack: Collection[str] = ..., limit: int = ..., lease: float = ...
    ) -> list[ClaimedDelivery]: ...
    def poll(
        self, queues: Sequence[str], *, no_ack: Collection[str] = ..., limit: int = ..., lease: float = ...
    ) -> tuple[list[ClaimedDelivery], dict[str, float]]: ...
    def peek(self, queues: Sequence[str] | None = ...) -> list[QueuedMessage]: ...
    def size(self, queue: str) -> int: ...
    def purge(self, queue: str) -> int: ...


class BrokerRouting(Protocol):
    """The routing state of a broker store: queues, exchanges, bindings, live consumers, and their collection."""

    def declare_queue(
        self, name: str, *, durable: bool = ..., exclusive: bool = ..., auto_delete: bool = ...,
        expires: float | None = ..., message_ttl: float | None = ...,
    ) -> None: ...  # fmt: skip
    def has_queue(self, name: str) -> bool: ...
    def delete_queue(self, name: str) -> int: ...
    def declare_exchange(
        self, name: str, type: str, *, durable: bool = ..., auto_delete: bool = ...,
        arguments: Mapping[str, Any] | None = ...,
    ) -> None: ...  # fmt: skip
    def exchange_type(self, name: str) -> str | None: ...
    def queues(self) -> list[str]: ...
    def consumers(self) -> dict[str, int]: ...
    def exchanges(self) -> list[str]: ...
    def delete_exchange(self, name: str) -> None: ...
    def bind(self, exchange: str, routing_key: str, pattern: str | None, queue: str) -> None: ...
    def unbind(self, exchange: str, routing_key: str, queue: str) -> None: ...
    def bindings(self, exchange: str | None = ...) -> Sequence[BindingRow]: ...
    def touch(self, consumer: str, queues: Sequence[str]) -> list[str]: ...
    def drop_consumer(self, consumer: str, queues: Sequence[str]) -> list[str]: ...
    def gc(self, *, consumer_timeout: float = ...) -> dict[str, int]: ...


class BrokerChanges(Protocol):
    """How a consumer waits for something to claim."""

    def change_token(self) -> Any: ...  # opaque: only ever handed back to wait_for_change
    def wait_for_change(self, token: Any, timeout: float) -> bool: ...


class BrokerStore(Receipts, BrokerMessages, BrokerRouting, BrokerChanges, Protocol):
    """Durable, multi-process storage of messages and routing state: what a store-backed Kombu transport
    (:mod:`celery_workflow.transport.base`) needs (``SQLiteQueue``, ``PostgresQueue``, ``RedisStore``, the SQS
    transport's store).

    Payloads are opaque bytes (UTF-8 JSON of Kombu messages); times are epoch seconds; a receipt names one claim
    and operations with a stale receipt change nothing. Every method is thread-safe and its own transaction. A store
    that is also a :class:`DeadLetterStore` gets messages past their delivery limit moved there.
    """


class ExpiringMessages(BrokerMessages, Protocol):
    """Messages with a TTL of their own (see :class:`ExpiringStore`)."""

    expires_messages: bool

    def put(
        self, queue: str, payload: bytes, *, not_before: float | None = ..., run_id: str | None = ...,
        idempotency_key: str | None = ..., ttl: float | None = ...,
    ) -> bool: ...  # fmt: skip
    def put_fanout(
        self, exchange: str, payload: bytes, *, not_before: float | None = ..., ttl: float | None = ...
    ) -> int: ...


class ExpiringStore(BrokerStore, ExpiringMessages, Protocol):
    """A :class:`BrokerStore` that honours a per-message TTL (``expires_messages = True``): ``ttl`` seconds after
    the put, on the store's clock, the message expires; an expired message is never claimed, counted or delivered
    (whatever its due time: the TTL counts from publishing, as Celery's ``expires`` and RabbitMQ's per-message TTL
    do) and :meth:`gc` deletes it. A queue's ``x-message-ttl`` still applies; the earlier expiry wins."""


class QueueBrokerStore(QueueStore, BrokerStore, Protocol):
    """One store behind a World's queue and its Kombu transport at once (``SQLiteQueue``, ``PostgresQueue``;
    ``RedisStore`` too, whose World side only tests use: the SQS transport keeps its control channel in it)."""


class ControlStore(BrokerStore, Protocol):
    """A :class:`BrokerStore` another store keeps its control traffic in (Celery's remote control, replies and events,
    with every exchange and binding): what the SQS transport's store asks of its control channel (``RedisStore``).

    ``on_change`` is called, from the control store's own thread, after each change its change token counts (the
    owning store sets it to wake its own waiters); :meth:`due_times` says when each queue's next message is due;
    :meth:`queue_info` answers a queue's declaration; :meth:`close` stops its thread and its connections."""

    on_change: Callable[[], None] | None

    def due_times(self, queues: Sequence[str]) -> dict[str, float]: ...
    def queue_info(self, name: str) -> dict[str, Any] | None: ...
    def close(self) -> None: ...
