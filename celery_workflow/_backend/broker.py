"""What the queue stores share (SQLite and Postgres; the Redis and SQS stores too, in part): receipts, bindings, the
rows :meth:`peek` shows, and how long a failed delivery waits.

* A receipt (``"<row id>.<attempts>"``) names exactly one claim of a queue row: row ids are never reused and every
  claim increments ``attempts``, so an ack, release or extension with a stale receipt matches no row.
* :class:`Binding` is one stored binding of a queue to an exchange (the broker state Kombu keeps in memory, kept in
  the database here so every process routes alike).
* :class:`QueuedMessage` is a stored message as a store's ``peek`` shows it: what tests, the CLI and operators look
  at instead of querying the tables.
* :func:`backoff` is how long a failed delivery waits before it is due again (the transports' rejections, the SQS
  store's messages on queues without a dead-letter queue, the app's failed handling).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from celery_workflow._backend.migrations import Table, columns
from celery_workflow.dead_letters import DeadLetter
from celery_workflow.errors import WorldError
from celery_workflow.world import ClaimedDelivery

__all__ = [
    "BACKOFF_BASE",
    "BACKOFF_CAP",
    "Binding",
    "QueuedMessage",
    "backoff",
    "claimed",
    "dead_letters",
    "format_receipt",
    "parse_receipt",
    "queue_declaration",
    "queue_tables",
    "queued_messages",
]

BACKOFF_BASE = 1.0
BACKOFF_CAP = 300.0


def backoff(attempts: int, *, base: float = BACKOFF_BASE, cap: float = BACKOFF_CAP) -> float:
    """Delay before a failed delivery is due again: ``base * 2**(attempts-1)`` seconds, capped at ``cap``."""
    return min(cap, base * 2.0 ** min(max(attempts - 1, 0), 64))


QUEUE = "celery_workflow_queue"
BROKER_QUEUES = "celery_workflow_broker_queues"
BROKER_EXCHANGES = "celery_workflow_broker_exchanges"
BROKER_BINDINGS = "celery_workflow_broker_bindings"
BROKER_CONSUMERS = "celery_workflow_broker_consumers"
DEAD_LETTERS = "celery_workflow_dead_letters"
#: The columns of a dead letter, in the order stores select them to build a :class:`DeadLetter`.
DEAD_LETTER_COLUMNS = (
    "id message_id queue run_id attempts reason last_error first_failed_at last_failed_at enqueued_at dead_at payload"
)


def queue_tables(*, ttl_columns: tuple[str, str], idempotency_indexes: Sequence[str]) -> dict[str, Table]:
    """The tables of a SQL queue store (its rows and the broker state its transport shares) as the code expects
    them (the migration test compares the migrated schema with this). A dialect names the two interval columns of a
    queue declaration (``x-expires``, ``x-message-ttl``) and its unique idempotency indexes."""
    expires, message_ttl = ttl_columns
    return {
        QUEUE: Table(
            columns(
                "id queue payload run_id not_before attempts lease_until idempotency_key expires_at created_at"
                " first_failed_at last_failed_at last_error"
            ),
            ("id",),
            {
                **dict.fromkeys(
                    ("celery_workflow_queue_due", "celery_workflow_queue_leased", "celery_workflow_queue_run"), False
                ),
                "celery_workflow_queue_expiry": False,
                **dict.fromkeys(idempotency_indexes, True),
            },
        ),
        BROKER_QUEUES: Table(
            ("name", "durable", "exclusive", "auto_delete", expires, message_ttl, "last_used", "created_at"), ("name",)
        ),
        BROKER_EXCHANGES: Table(columns("name type durable auto_delete arguments created_at"), ("name",)),
        BROKER_BINDINGS: Table(
            columns("exchange routing_key queue pattern created_at"),
            ("exchange", "routing_key", "queue"),
            {"celery_workflow_broker_bindings_queue": False},
        ),
        BROKER_CONSUMERS: Table(columns("queue consumer seen_at"), ("queue", "consumer")),
        DEAD_LETTERS: Table(
            columns(
                "id message_id queue payload run_id attempts reason last_error first_failed_at last_failed_at"
                " enqueued_at dead_at run_settled_at"
            ),
            ("id",),
            dict.fromkeys(
                (
                    "celery_workflow_dead_letters_queue",
                    "celery_workflow_dead_letters_run",
                    "celery_workflow_dead_letters_unsettled",
                ),
                False,
            ),
        ),
    }


class Binding(NamedTuple):
    """A binding of ``queue`` to ``exchange``; ``pattern`` is the regex of a topic binding, else None."""

    exchange: str
    routing_key: str
    pattern: str | None
    queue: str


@dataclass(frozen=True, slots=True)
class QueuedMessage:
    """A stored message. Times are epoch seconds on the store's clock; ``leased_until`` is None unless a claim
    holds the message (a lease that ran out still shows until the next claim, release or ack)."""

    id: int
    queue: str
    run_id: str | None
    attempts: int
    due: float
    leased_until: float | None
    idempotency_key: str | None
    expires_at: float | None
    payload: bytes


def queued_messages(rows: Iterable[Sequence[Any]], epoch: Callable[[Any], float]) -> list[QueuedMessage]:
    """The messages of ``peek`` rows ``(id, queue, run_id, attempts, not_before, lease_until, idempotency_key,
    expires_at, payload)``, their times turned into epoch seconds by ``epoch``."""
    return [
        QueuedMessage(
            int(i), str(q), r, int(a), epoch(due), None if lease is None else epoch(lease), key,
            None if exp is None else epoch(exp), bytes(payload),
        )
        for i, q, r, a, due, lease, key, exp, payload in rows
    ]  # fmt: skip


def queue_declaration(
    flags: Sequence[Any], expires: float | None, message_ttl: float | None, last_used: float
) -> dict[str, Any]:
    """A stored queue declaration as ``queue_info`` answers it: ``flags`` are the stored durable, exclusive and
    auto_delete; durations and times are in seconds."""
    durable, exclusive, auto_delete = flags
    return {
        "durable": bool(durable),
        "exclusive": bool(exclusive),
        "auto_delete": bool(auto_delete),
        "expires": expires,
        "message_ttl": message_ttl,
        "last_used": last_used,
    }


def format_receipt(row_id: int, attempts: int) -> str:
    """The receipt of one claim."""
    return f"{row_id}.{attempts}"


def parse_receipt(receipt: str) -> tuple[int, int]:
    """``(row_id, attempts)`` of a receipt; WorldError when it is not one."""
    try:
        row_id, attempts = receipt.split(".")
        return int(row_id), int(attempts)
    except (AttributeError, ValueError) as exc:
        raise WorldError(f"malformed queue receipt {receipt!r}") from exc


def dead_letters(rows: Iterable[Sequence[Any]], when: Callable[[Any], datetime | None]) -> list[DeadLetter]:
    """The dead letters of rows selected as :data:`DEAD_LETTER_COLUMNS`, their times turned into UTC datetimes by
    ``when``."""
    out = []
    for i, mid, q, run, att, reason, err, first, last, enq, dead, payload in rows:
        enqueued, died = when(enq), when(dead)
        assert enqueued is not None and died is not None
        out.append(
            DeadLetter(
                int(i), int(mid), str(q), run, int(att), str(reason), err, when(first), when(last), enqueued, died,
                bytes(payload),
            )
        )  # fmt: skip
    return out


def claimed(row_id: int, queue: str, payload: bytes, attempts: int, run_id: str | None) -> ClaimedDelivery:
    """The claim of a row just leased (``attempts`` already counts this claim)."""
    return ClaimedDelivery(format_receipt(row_id, attempts), queue, bytes(payload), attempts, run_id)
