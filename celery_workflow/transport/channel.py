"""The channel of the durable Kombu virtual transport (:mod:`celery_workflow.transport.base`): what Kombu asks of
one channel (put, get, ack, reject, consume, queues, exchanges and bindings), kept in the :class:`BrokerStore` rather
than in process memory. The module docstring of :mod:`celery_workflow.transport.base` says how it behaves."""

from __future__ import annotations

import logging
import socket
import sys
import uuid
from collections.abc import Collection, Mapping, Sequence
from queue import Empty
from typing import TYPE_CHECKING, Any, cast

from kombu.exceptions import ChannelError
from kombu.transport import base as _kombu_base
from kombu.transport import virtual as _virtual
from kombu.transport.virtual import exchange as _exchange

from celery_workflow import dead_letters, task_names
from celery_workflow.errors import WorldError
from celery_workflow.transport.store import (
    BrokerStore,
    ExpiringStore,
    backoff,
    decode_claims,
    dumps,
    message_due,
    message_expiration,
)
from celery_workflow.world import Claim

if TYPE_CHECKING:
    from celery_workflow.transport.base import StoreTransport

logger = logging.getLogger("celery_workflow.transport.base")

# Kombu is only partly typed: use its classes and helpers as Any.
_VirtualChannel: Any = _virtual.Channel
_VirtualMessage: Any = _virtual.Message
_TopicExchange: Any = _exchange.TopicExchange
_to_rabbitmq_queue_arguments: Any = _kombu_base.to_rabbitmq_queue_arguments


class StoreMessage(_VirtualMessage):  # type: ignore[misc]
    """A message of a :class:`StoreChannel` that remembers why its body could not be made sense of, so the channel
    moves it to the dead letters when its consumer gives up on it (see :meth:`StoreChannel.basic_ack`).

    Celery's consumer logs "Can't decode message body" and *acks* a message it cannot decode (``on_decode_error``:
    "so it doesn't enter a loop"); on these transports such a message is moved to the dead letters instead of being
    deleted, whoever consumes it. What counts: a transfer encoding that does not decode (Kombu's channel raises that
    out of the consumer's drain; here it becomes one of the message's ``errors``, which Kombu's consumer hands to
    ``on_decode_error``), a compression that does not decompress (``errors`` too), and a decode that raised (a body
    that is not what its content type says, a content type the consumer does not accept).
    """

    #: Why the body could not be decoded, once a decode failed (else None).
    decode_error: str | None = None

    def __init__(self, payload: dict[str, Any], channel: Any = None, **kwargs: Any) -> None:
        try:
            super().__init__(payload, channel=channel, **kwargs)
        except Exception:  # the stored body's transfer encoding did not decode, whatever it raised
            self.errors = [sys.exc_info()]  # Kombu's consumer hands it to on_decode_error; no body to decompress
            super().__init__({**payload, "body": None}, channel=channel, **kwargs)
            self._raw = payload

    def _decode(self) -> Any:
        try:
            return super()._decode()
        except Exception as exc:
            self.decode_error = self.decode_error or _why(exc)
            raise

    def undecodable(self) -> str | None:
        """Why this message's body could not be decoded (a failed decode, or an error making the message), or None."""
        if self.decode_error is not None:
            return self.decode_error
        if self.errors:
            return _why(self.errors[0][1])
        return None


def _why(exc: BaseException | None) -> str:
    return f"{type(exc).__name__}: {exc}" if exc is not None else "unknown error"


class StoreChannel(_VirtualChannel):  # type: ignore[misc]
    """A virtual channel whose messages, exchanges, bindings and queues live in the transport's store."""

    Message = StoreMessage
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
        store, ttl = self.store, self._expiration(message)
        options: dict[str, Any] = {"run_id": props.get("run_id"), "idempotency_key": props.get("idempotency_key")}
        if ttl is None:
            stored = store.put(queue, dumps(message), not_before=message_due(message), **options)
        else:
            stored = _expiring(store).put(queue, dumps(message), not_before=message_due(message), ttl=ttl, **options)
        if not stored:
            logger.debug("message for %r deduplicated by idempotency key %r", queue, props.get("idempotency_key"))

    def _put_fanout(self, exchange: str, message: dict[str, Any], routing_key: str, **kwargs: Any) -> None:
        store, ttl = self.store, self._expiration(message)
        if ttl is None:
            store.put_fanout(exchange, dumps(message), not_before=message_due(message))
        else:
            _expiring(store).put_fanout(exchange, dumps(message), not_before=message_due(message), ttl=ttl)

    def _expiration(self, message: dict[str, Any]) -> float | None:
        """The message's per-message TTL in seconds (its ``expiration`` property), when the store honours one: a
        store that does not (SQS) stores the message as before. A malformed one is refused as RabbitMQ refuses it
        (a channel error, PRECONDITION_FAILED)."""
        try:
            ttl = message_expiration(message)
        except ValueError as exc:
            raise ChannelError(
                f"PRECONDITION_FAILED - {exc}", (60, 40), "Basic.publish", "406"
            ) from None  # fmt: skip
        if ttl is not None and not getattr(self.store, "expires_messages", False):
            return None
        return ttl

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

    def _undecodable(self, delivery_tag: Any) -> str | None:
        """Why the held message's body could not be decoded (:class:`StoreMessage`), or None."""
        try:
            message = self.qos.get(delivery_tag)
        except KeyError:
            return None
        check = getattr(message, "undecodable", None)
        return check() if callable(check) else None

    def basic_ack(self, delivery_tag: Any, multiple: bool = False) -> None:
        """Delete the message (stale receipts change nothing), then forget it; a message whose body could not be
        decoded is moved to the dead letters instead (Celery acks those: see :class:`StoreMessage`). The consumer is
        woken: the ack freed prefetch room (:meth:`_wake`)."""
        held = self._claim(delivery_tag)
        try:
            if held is not None:
                why = self._undecodable(delivery_tag)
                if why is None:
                    self._ack_stored(held.receipt)
                else:
                    self._undecodable_letter(held, delivery_tag, why)
        finally:
            super().basic_ack(delivery_tag, multiple)
            self._wake()

    def _wake(self) -> None:
        """Wake this connection's consumer (an ack, a reject or a new prefetch count changed its room). Acks come
        from any thread (the pool's with ``--pool=threads``), so every one wakes it, not only one that frees a full
        window as seen from the acking thread: a window judged not full before the ack could be full a moment later
        in the consumer's eyes."""
        transport = self.connection  # None once the channel is closed (e.g. an ack after a lost connection)
        if transport is not None and self._consumers:
            transport.wake()

    def basic_qos(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().basic_qos(*args, **kwargs)
        finally:
            self._wake()

    def _undecodable_letter(self, held: Claim, delivery_tag: Any, why: str) -> None:
        try:
            message = self.qos.get(delivery_tag)
            kind, encoding = message.content_type, message.content_encoding
        except (KeyError, AttributeError):
            kind = encoding = None
        logger.error("message %s cannot be decoded by its consumer (%s): %s", held.receipt, kind, why)
        error = f"undecodable: its consumer could not decode its body (content type {kind}, encoding {encoding}): {why}"
        self._dead_letter(held, dead_letters.UNDECODABLE, error)

    def _ack_stored(self, receipt: str) -> None:
        """Delete an acked message from the store (a transport may do more in the same round trip)."""
        self.store.ack(receipt)

    def basic_reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        """requeue: release the lease (due at once); otherwise move the message to the dead letters, as a queue
        with a dead-letter exchange does (a store without dead letters, and a workflow or step delivery, see
        :func:`~celery_workflow.task_names.is_delivery_task`, back it off instead: 1 s, 2 s … up to ``backoff_cap``,
        until the queue's delivery limit). A delivery the task already put back itself (``retry_later``, with its
        error) is left as it is."""
        held = self._claim(delivery_tag)
        try:
            if held is not None:
                if requeue:
                    self.store.release(held.receipt)
                elif (why := self._undecodable(delivery_tag)) is not None:  # no backoff makes it decode
                    self._undecodable_letter(held, delivery_tag, why)
                else:
                    self._reject(held, delivery_tag)
        finally:
            super().basic_reject(delivery_tag, requeue=False)
            self._wake()

    def _reject(self, held: Claim, delivery_tag: Any) -> None:
        try:
            message = self.qos.get(delivery_tag)
            task, task_id = message.headers.get("task"), message.headers.get("id")
        except (KeyError, AttributeError):
            task = task_id = None
        if task_names.is_delivery_task(task):
            # a workflow or step delivery whose handling failed (an outage: it must come back later) or that this
            # worker does not know yet (a rolling deploy: another worker may) is retried with backoff until its
            # queue's delivery limit moves it, rather than dead-lettered at once
            self.store.retry_later(held.receipt, backoff(held.attempts, cap=self.connection.backoff_cap))
            return
        error = f"rejected by its consumer: task {task} [{task_id}]" if task else "rejected by its consumer"
        self._dead_letter(held, dead_letters.REJECTED, error)

    def _dead_letter(self, held: Claim, reason: str, error: str) -> None:
        """Move the held message to the dead letters and announce it (a store without dead letters backs it off)."""
        mover = getattr(self.store, "dead_letter", None)
        if mover is None:
            self.store.retry_later(held.receipt, backoff(held.attempts, cap=self.connection.backoff_cap))
            return
        letter = mover(held.receipt, reason=reason, error=error)
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


def _expiring(store: BrokerStore) -> ExpiringStore:
    """The store as one that honours a message's TTL (its ``expires_messages`` says so)."""
    return cast(ExpiringStore, store)
