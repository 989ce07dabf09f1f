"""A queue store composed of parts: one object per concern, and a facade that hands each call of the queue contract to
its part (:class:`ComposedQueue`). ``SQLiteQueue`` and ``PostgresQueue`` are built this way: their deliveries, dead
letters and broker state are separate objects on one shared database handle, each testable and readable alone,
instead of a chain of base classes each adding methods to the one below.

The part protocols say what each part must offer (:class:`DeliveryPart`, :class:`RoutingPart`; the dead letters are a
:class:`~celery_workflow._backend.queue_contract.DeadLetterStore`). A store adds what is its own on top: the methods
that run in a World's open transaction (their connection types differ per database), change notification, and on
Postgres the standing claims.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from celery_workflow._backend.queue_contract import (
    BrokerRouting,
    DeadLetterStore,
    ExpiringMessages,
    Leases,
    WorldQueue,
)

if TYPE_CHECKING:  # annotations only: the modules defining these records import this package's modules
    from celery_workflow._backend.broker import Binding, QueuedMessage
    from celery_workflow.dead_letters import DeadLetter
    from celery_workflow.world import ClaimedDelivery, Delivery

__all__ = ["ComposedQueue", "DeliveryPart", "RoutingPart"]


class DeliveryPart(WorldQueue, ExpiringMessages, Protocol):
    """The deliveries of a composed store: the World's queue and the transport's messages, with due times."""

    def due_times(self, queues: Sequence[str]) -> dict[str, float]: ...
    def next_due(self, queues: Sequence[str]) -> float | None: ...
    def delayed(self, queues: Sequence[str], *, limit: int = ...) -> list[QueuedMessage]: ...


class RoutingPart(BrokerRouting, Leases, Protocol):
    """The broker state of a composed store (with the named leases, kept beside the consumers' heartbeats)."""

    def queue_info(self, name: str) -> dict[str, Any] | None: ...
    def bindings(self, exchange: str | None = ...) -> list[Binding]: ...


class ComposedQueue:
    """The queue contract's methods (:class:`~celery_workflow._backend.queue_contract.QueueBrokerStore` and
    :class:`~celery_workflow._backend.queue_contract.ExpiringStore`), each handed to the part that keeps it. The
    store's constructor sets the parts."""

    #: Every composed store honours a message's own TTL.
    expires_messages = True

    deliveries: DeliveryPart
    letters: DeadLetterStore
    broker_state: RoutingPart

    # -- deliveries ----------------------------------------------------------------------------------------------------

    def enqueue(self, deliveries: Sequence[Delivery]) -> list[bool]:
        return self.deliveries.enqueue(deliveries)

    def claim(self, queues: Sequence[str], *, limit: int = 1, lease: float = 60.0) -> list[ClaimedDelivery]:
        return self.deliveries.claim(queues, limit=limit, lease=lease)

    def ack(self, receipt: str) -> None:
        self.deliveries.ack(receipt)

    def release(self, receipt: str) -> None:
        self.deliveries.release(receipt)

    def retry_later(self, receipt: str, delay: float, *, error: str | None = None) -> None:
        self.deliveries.retry_later(receipt, delay, error=error)

    def extend(self, receipts: Sequence[str], lease: float) -> None:
        self.deliveries.extend(receipts, lease)

    def put(
        self,
        queue: str,
        payload: bytes,
        *,
        not_before: float | None = None,
        run_id: str | None = None,
        idempotency_key: str | None = None,
        ttl: float | None = None,
    ) -> bool:
        return self.deliveries.put(
            queue, payload, not_before=not_before, run_id=run_id, idempotency_key=idempotency_key, ttl=ttl
        )

    def put_fanout(
        self, exchange: str, payload: bytes, *, not_before: float | None = None, ttl: float | None = None
    ) -> int:
        return self.deliveries.put_fanout(exchange, payload, not_before=not_before, ttl=ttl)

    def receive(
        self, queues: Sequence[str], *, no_ack: Collection[str] = (), limit: int = 1, lease: float = 60.0
    ) -> list[ClaimedDelivery]:
        return self.deliveries.receive(queues, no_ack=no_ack, limit=limit, lease=lease)

    def poll(
        self, queues: Sequence[str], *, no_ack: Collection[str] = (), limit: int = 1, lease: float = 60.0
    ) -> tuple[list[ClaimedDelivery], dict[str, float]]:
        return self.deliveries.poll(queues, no_ack=no_ack, limit=limit, lease=lease)

    def due_times(self, queues: Sequence[str]) -> dict[str, float]:
        return self.deliveries.due_times(queues)

    def next_due(self, queues: Sequence[str]) -> float | None:
        return self.deliveries.next_due(queues)

    def peek(self, queues: Sequence[str] | None = None) -> list[QueuedMessage]:
        return self.deliveries.peek(queues)

    def delayed(self, queues: Sequence[str], *, limit: int = 1000) -> list[QueuedMessage]:
        return self.deliveries.delayed(queues, limit=limit)

    def size(self, queue: str) -> int:
        return self.deliveries.size(queue)

    def purge(self, queue: str) -> int:
        return self.deliveries.purge(queue)

    # -- dead letters --------------------------------------------------------------------------------------------------

    def dead_letter(self, receipt: str, *, reason: str, error: str | None = None) -> DeadLetter | None:
        return self.letters.dead_letter(receipt, reason=reason, error=error)

    def list_dead_letters(
        self, *, queue: str | None = None, run_id: str | None = None, after: int | str = 0, limit: int = 100
    ) -> list[DeadLetter]:
        return self.letters.list_dead_letters(queue=queue, run_id=run_id, after=after, limit=limit)

    def get_dead_letter(self, letter_id: int | str) -> DeadLetter:
        return self.letters.get_dead_letter(letter_id)

    def unsettled_dead_letters(self, *, limit: int = 100) -> list[DeadLetter]:
        return self.letters.unsettled_dead_letters(limit=limit)

    def settle_dead_letters(self, ids: Sequence[int | str]) -> None:
        self.letters.settle_dead_letters(ids)

    def redrive_dead_letters(self, ids: Sequence[int | str] | None = None, *, queue: str | None = None) -> int:
        return self.letters.redrive_dead_letters(ids, queue=queue)

    def purge_dead_letters(self, ids: Sequence[int | str] | None = None, *, queue: str | None = None) -> int:
        return self.letters.purge_dead_letters(ids, queue=queue)

    # -- broker state --------------------------------------------------------------------------------------------------

    def declare_queue(
        self,
        name: str,
        *,
        durable: bool = True,
        exclusive: bool = False,
        auto_delete: bool = False,
        expires: float | None = None,
        message_ttl: float | None = None,
    ) -> None:
        self.broker_state.declare_queue(
            name,
            durable=durable,
            exclusive=exclusive,
            auto_delete=auto_delete,
            expires=expires,
            message_ttl=message_ttl,
        )

    def has_queue(self, name: str) -> bool:
        return self.broker_state.has_queue(name)

    def queue_info(self, name: str) -> dict[str, Any] | None:
        return self.broker_state.queue_info(name)

    def delete_queue(self, name: str) -> int:
        return self.broker_state.delete_queue(name)

    def declare_exchange(
        self,
        name: str,
        type: str,
        *,
        durable: bool = True,
        auto_delete: bool = False,
        arguments: Mapping[str, Any] | None = None,
    ) -> None:
        self.broker_state.declare_exchange(name, type, durable=durable, auto_delete=auto_delete, arguments=arguments)

    def exchange_type(self, name: str) -> str | None:
        return self.broker_state.exchange_type(name)

    def queues(self) -> list[str]:
        return self.broker_state.queues()

    def consumers(self) -> dict[str, int]:
        return self.broker_state.consumers()

    def exchanges(self) -> list[str]:
        return self.broker_state.exchanges()

    def delete_exchange(self, name: str) -> None:
        self.broker_state.delete_exchange(name)

    def bind(self, exchange: str, routing_key: str, pattern: str | None, queue: str) -> None:
        self.broker_state.bind(exchange, routing_key, pattern, queue)

    def unbind(self, exchange: str, routing_key: str, queue: str) -> None:
        self.broker_state.unbind(exchange, routing_key, queue)

    def bindings(self, exchange: str | None = None) -> list[Binding]:
        return self.broker_state.bindings(exchange)

    def touch(self, consumer: str, queues: Sequence[str]) -> list[str]:
        return self.broker_state.touch(consumer, queues)

    def drop_consumer(self, consumer: str, queues: Sequence[str]) -> list[str]:
        return self.broker_state.drop_consumer(consumer, queues)

    def gc(self, *, consumer_timeout: float = 60.0) -> dict[str, int]:
        return self.broker_state.gc(consumer_timeout=consumer_timeout)

    def hold_lease(self, name: str, holder: str, seconds: float) -> bool:
        return self.broker_state.hold_lease(name, holder, seconds)

    def drop_lease(self, name: str, holder: str) -> None:
        self.broker_state.drop_lease(name, holder)
