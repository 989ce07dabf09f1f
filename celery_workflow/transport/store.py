"""What a store-backed Kombu transport stores and how its messages are encoded (see :mod:`.base`).

:class:`BrokerStore` is the storage protocol (``SQLiteQueue``, ``PostgresQueue``, ``RedisStore``, the SQS store),
defined with the rest of the queue contract in :mod:`celery_workflow._backend.queue_contract` and re-exported here
(with :class:`ExpiringStore` and :class:`BindingRow`); the helpers encode a Kombu message for it, decide when a
message is due and turn claims back into Kombu messages. :func:`backoff` (how long a failed delivery waits) lives in
:mod:`celery_workflow._backend.broker`, beside the stores that use it too, and is importable from here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from kombu.utils import json as _json

from celery_workflow import dead_letters
from celery_workflow._backend.broker import BACKOFF_BASE, BACKOFF_CAP, backoff
from celery_workflow._backend.queue_contract import BindingRow, BrokerStore, ExpiringStore
from celery_workflow.dead_letters import DeadLetter
from celery_workflow.world import Claim, ClaimedDelivery

__all__ = [
    "BACKOFF_BASE",
    "BACKOFF_CAP",
    "BindingRow",
    "BrokerStore",
    "ExpiringStore",
    "backoff",
    "decode_claims",
    "dumps",
    "envelope_problem",
    "message_due",
    "message_expiration",
]

logger = logging.getLogger(__name__)

# Kombu's JSON (datetimes and UUIDs round-trip), used as Any: Kombu is only partly typed.
_dumps: Any = _json.dumps
_loads: Any = _json.loads


def dumps(message: Mapping[str, Any]) -> bytes:
    """UTF-8 JSON of a Kombu message (Kombu's JSON: datetimes and UUIDs round-trip)."""
    return str(_dumps(message)).encode("utf-8")


def _epoch(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            logger.warning("ignoring unparsable due time %r", value)
            return None
    if isinstance(value, datetime):
        return (value if value.tzinfo else value.replace(tzinfo=UTC)).timestamp()
    return None


def message_due(message: Mapping[str, Any]) -> float | None:
    """Epoch seconds a message is due: ``properties["not_before"]``, else ``headers["eta"]``, else None (now)."""
    props, headers = message.get("properties"), message.get("headers")
    due = _epoch(props.get("not_before")) if isinstance(props, dict) else None
    if due is None and isinstance(headers, dict):
        due = _epoch(headers.get("eta"))
    return due


#: The transfer encodings of a stored body Kombu's virtual channel undoes (``body_encoding``; none: the body as is).
BODY_ENCODINGS = ("base64", "utf-8")

_TEXT_FIELDS = ("content-type", "content-encoding")


def envelope_problem(payload: Mapping[str, Any]) -> None:
    """ValueError when a stored message is no Kombu message Kombu could make a message object of: its headers or
    properties not objects, its body, content type or content encoding not strings, or its body in a transfer encoding
    Kombu does not know (Kombu's channel raises out of the consumer's drain on each of these, before any consumer sees
    the message, so it would come back and break the drain again until its delivery limit). What the *body* says is
    the consumer's to decode: a body that does not decode is dead-lettered when its consumer gives up on it (see
    :class:`~celery_workflow.transport.channel.StoreMessage`)."""
    for name in ("headers", "properties"):
        if payload.get(name) is not None and not isinstance(payload[name], dict):
            raise ValueError(f"its {name} are not an object")
    for name in ("body", *_TEXT_FIELDS):
        if payload.get(name) is not None and not isinstance(payload[name], str):
            raise ValueError(f"its {name} is not a string")
    encoding = (payload.get("properties") or {}).get("body_encoding")
    if encoding is not None and not isinstance(encoding, str):
        raise ValueError("its body_encoding is not a string")
    if encoding and encoding.lower() not in BODY_ENCODINGS:
        raise ValueError(f"its body is in an unknown transfer encoding {encoding[:40]!r}")


def message_expiration(message: Mapping[str, Any]) -> float | None:
    """The message's time to live in seconds, from its ``expiration`` property (AMQP's: non-negative whole
    milliseconds as a string, as ``kombu.Producer.publish(expiration=seconds)`` and Celery's ``expires`` write it;
    an int is taken too), or None. ValueError for anything else, as RabbitMQ refuses it at publish."""
    value = (message.get("properties") or {}).get("expiration")
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value / 1000
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 18:
        return int(value) / 1000
    raise ValueError(f"invalid expiration {str(value)[:40]!r}: non-negative whole milliseconds, like '30000'")


def decode_claims(
    store: BrokerStore,
    claims: Sequence[ClaimedDelivery],
    no_ack: Collection[str],
    *,
    cap: float = BACKOFF_CAP,
    limit_of: Callable[[str], int | None] | None = None,
    dead: Callable[[DeadLetter], None] | None = None,
) -> list[tuple[dict[str, Any], str]]:
    """``(payload, queue)`` of each claimed Kombu message, its ``delivery_info`` carrying the claim's receipt and
    attempts.

    A claim beyond its queue's delivery limit (``limit_of(queue)``; None: no limit) and an undecodable one are
    moved to the dead letters and handed to ``dead`` instead (rows of ``no_ack`` queues are already deleted: an
    undecodable one is only logged). ``cap`` is kept for stores without dead letters, which back such a claim off up to
    ``cap`` seconds instead."""
    out = []
    for claim in claims:
        acked = claim.queue in no_ack
        limit = None if acked or limit_of is None else limit_of(claim.queue)
        if limit is not None and claim.attempts > limit:
            _bury(store, claim, dead_letters.MAX_DELIVERIES, None, dead=dead, cap=cap)
            continue
        try:
            payload = _loads(claim.payload)
            if not isinstance(payload, dict):
                raise ValueError("not a Kombu message object")
            envelope_problem(payload)
        except ValueError as exc:
            logger.error("undecodable message %s on %r: %s", claim.receipt, claim.queue, exc)
            if not acked:
                _bury(store, claim, dead_letters.UNDECODABLE, f"undecodable: {exc}", dead=dead, cap=cap)
            continue
        props = payload.get("properties")
        if props is None:
            props = payload["properties"] = {}
        info = props.get("delivery_info")
        if not isinstance(info, dict):
            info = props["delivery_info"] = {}
        info.setdefault("exchange", "")
        info.setdefault("routing_key", claim.queue)
        info.update(redelivered=claim.attempts > 1, **Claim(claim.receipt, claim.attempts).delivery_info())
        props["delivery_tag"] = claim.receipt
        payload["redelivered"] = claim.attempts > 1
        out.append((payload, claim.queue))
    return out


def _bury(
    store: BrokerStore,
    claim: ClaimedDelivery,
    reason: str,
    error: str | None,
    *,
    dead: Callable[[DeadLetter], None] | None,
    cap: float,
) -> None:
    mover = getattr(store, "dead_letter", None)
    if mover is None:  # a store without dead letters: back off, never lose it
        store.retry_later(claim.receipt, backoff(claim.attempts, cap=cap))
        return
    letter = mover(claim.receipt, reason=reason, error=error)
    if letter is not None and dead is not None:
        dead(letter)
