"""Dead letters: messages no consumer could process, kept with their history instead of retried forever or lost.

A message moves from its queue to the dead letters of the same database (SQLite, Postgres; on SQS, its queue's
dead-letter queue) when

* a claim would deliver it more often than its queue allows (``max-deliveries``): the transport option
  ``max_deliveries`` (:data:`DEFAULT_MAX_DELIVERIES`, SQS's default ``maxReceiveCount``), ``max_deliveries_per_queue``
  (queue name -> limit), or the ``x-delivery-limit`` argument of a queue declaration (RabbitMQ's quorum queues);
  every claim counts, so a message whose worker dies each time (its lease runs out unacked) moves too;
* a consumer rejects it without requeue (``rejected``): Kombu's ``message.reject(requeue=False)``, which is what
  Celery does with an unregistered task name, a content type the worker does not accept, or a failed ``acks_late``
  task; as on a RabbitMQ queue with a dead-letter exchange, it is moved, not retried;
* it cannot be decoded (``undecodable``): its stored row is not a Kombu message, or its body does not decode as its
  content type and encoding say (a consumer that gave up on it, as Celery does with "Can't decode", moves it instead
  of acking it away); the last error names the content type and the decoder's error.

A dead letter keeps the message body and queue, how often it was delivered, why it moved, when its first and last
failed delivery were and the last error recorded. A run one of whose deliveries is dead-lettered is failed with
:class:`~celery_workflow.errors.DeadLettered` as its cause (``runs show`` prints it): without its delivery it cannot
go on. Except when the last failure was the World's own (:class:`~celery_workflow.errors.WorldError`: unavailable,
throttled, a driver error): an outage is never a workflow's outcome, so that run is left as it was, and a redrive
once the World is back carries it on. ``celery-workflow dead-letters list | show ID | redrive [--queue Q] [ID…] | purge`` looks at them and puts them
back (a redrive inserts the message again with its attempts reset and deletes the dead letter, so it happens at
most once per dead letter).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from celery_workflow import codec
from celery_workflow._backend.queue_contract import DeadLetterStore  # the protocol lives with the queue contract
from celery_workflow.errors import (
    ConfigurationError,
    DeadLettered,
    DeadLetterNotFound,
    NotFound,
    RunTerminal,
    WorldError,
)
from celery_workflow.event_data import RunFailedData
from celery_workflow.events import NewEvent

__all__ = [
    "DEFAULT_MAX_DELIVERIES",
    "REASONS",
    "DeadLetter",
    "DeadLetterStore",
    "dead_letter_store",
    "fail_run",
    "message_task",
    "outage",
    "settle",
    "sweep",
]

#: Deliveries a message gets before it is dead-lettered, unless its queue says otherwise (SQS's maxReceiveCount).
DEFAULT_MAX_DELIVERIES = 10
MAX_DELIVERIES = "max-deliveries"
REJECTED = "rejected"
UNDECODABLE = "undecodable"
REASONS = (MAX_DELIVERIES, REJECTED, UNDECODABLE)
#: What a claim records as the failure of a delivery whose lease ran out without an ack.
LEASE_EXPIRED = "the delivery's lease ran out without an ack (its worker died or stalled)"
#: The longest error text kept per message (bytes of UTF-8; cut with a marker).
MAX_ERROR = 8192


def cut_error(text: str | None) -> str | None:
    """An error as a store keeps it with a delivery: at most :data:`MAX_ERROR` bytes (see :func:`codec.cut`)."""
    return None if text is None else codec.cut(text, MAX_ERROR)


def message_task(payload: bytes) -> tuple[str | None, str | None]:
    """``(task name, task id)`` of a stored Kombu message carrying a Celery task (protocol 2 headers), else Nones."""
    try:
        message = json.loads(payload)
        headers = message.get("headers") or {}
        name, task_id = headers.get("task"), headers.get("id")
    except (ValueError, AttributeError, UnicodeDecodeError):
        return None, None
    return (name if isinstance(name, str) else None), (task_id if isinstance(task_id, str) else None)


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A dead-lettered message. ``id``: the dead letter's (an integer in the SQL Worlds, an SQS message id on
    AWS); ``message_id``: the message's while it was queued; ``attempts``: its claims (see :attr:`deliveries`);
    times are UTC (SQS keeps no failure times)."""

    id: int | str
    message_id: int | str
    queue: str
    run_id: str | None
    attempts: int
    reason: str
    last_error: str | None
    first_failed_at: datetime | None
    last_failed_at: datetime | None
    enqueued_at: datetime
    dead_at: datetime
    payload: bytes

    @property
    def deliveries(self) -> int:
        """How often the message was handed to a consumer (``attempts`` counts claims, and the claim that moved
        it past its limit, or found it undecodable, delivered nothing)."""
        return self.attempts if self.reason == REJECTED else max(self.attempts - 1, 0)

    @property
    def task_name(self) -> str | None:
        return message_task(self.payload)[0]

    @property
    def task_id(self) -> str | None:
        return message_task(self.payload)[1]

    def describe(self) -> str:
        """One line: what moved, from where, why."""
        what = f"task {self.task_name} [{self.task_id}]" if self.task_name else f"message {self.message_id or '?'}"
        why = {
            MAX_DELIVERIES: f"delivered {self.deliveries} times without success",
            REJECTED: "rejected by its consumer without requeue",
            UNDECODABLE: "it cannot be decoded",
        }.get(self.reason, self.reason)
        text = f"{what} on queue {self.queue!r} was dead-lettered ({why})"
        return text + (f"; last error: {self.last_error}" if self.last_error else "")

    def to_json(self, *, body: bool = False) -> dict[str, Any]:
        """A JSON-able description (``--json`` output); ``body``: include the stored message as text."""
        out: dict[str, Any] = {
            "id": self.id,
            "message_id": self.message_id,
            "queue": self.queue,
            "task": self.task_name,
            "task_id": self.task_id,
            "run_id": self.run_id,
            "attempts": self.attempts,
            "deliveries": self.deliveries,
            "reason": self.reason,
            "last_error": self.last_error,
            "first_failed_at": None if self.first_failed_at is None else self.first_failed_at.isoformat(),
            "last_failed_at": None if self.last_failed_at is None else self.last_failed_at.isoformat(),
            "enqueued_at": self.enqueued_at.isoformat(),
            "dead_at": self.dead_at.isoformat(),
        }
        if body:
            out["message"] = self.payload.decode("utf-8", "replace")
        return out


def letter_id(value: int | str) -> int:
    """A SQL World's dead-letter id from what a caller gave (``"12"`` from a command line); DeadLetterNotFound for
    one that cannot be an id."""
    try:
        return int(value)
    except (TypeError, ValueError):
        raise DeadLetterNotFound(f"no dead letter {value!r}") from None


def dead_letter_store(world: Any) -> DeadLetterStore:
    """The dead letters of a World: its queue store's (SQLite, Postgres) or its queues' SQS dead-letter queues
    (AWS, ``world.dead_letters``); ConfigurationError for a World that keeps none."""
    for store in (getattr(world, "dead_letters", None), getattr(world, "store", None)):
        if isinstance(store, DeadLetterStore):
            return store
    raise ConfigurationError(f"{type(world).__name__} keeps no dead letters")


def cause(letter: DeadLetter) -> dict[str, Any]:
    """The recorded error of a run failed because of ``letter``."""
    kind = DeadLettered
    return {
        "type": f"{kind.__module__}.{kind.__qualname__}",
        "message": codec.cut(letter.describe(), codec.MAX_ERROR_MESSAGE),
        "dead_letter": letter.id,
        "reason": letter.reason,
        "queue": letter.queue,
    }


def _names(kind: type[BaseException]) -> set[str]:
    return {kind.__name__}.union(*(_names(sub) for sub in kind.__subclasses__()))


def outage(letter: DeadLetter) -> bool:
    """Whether the last failure of ``letter`` was the World's (its recorded error names a
    :class:`~celery_workflow.errors.WorldError`, as a worker records it: ``"<TypeName>: <message>"``)."""
    kind = (letter.last_error or "").split(":", 1)[0].strip()
    return bool(kind) and kind in _names(WorldError)


def fail_run(world: Any, letter: DeadLetter) -> bool:
    """Fail the run of a dead-lettered delivery with :class:`DeadLettered` as its cause; False when the letter has
    no run, the run has ended or is gone, or the letter's last failure was the World's (:func:`outage`: the run is
    left as it was, for a redrive)."""
    if not letter.run_id or outage(letter):
        return False
    try:
        world.append(letter.run_id, [NewEvent.of(RunFailedData(error=cause(letter)))])
    except (RunTerminal, NotFound):
        return False
    from celery_workflow._backend.children import close_children  # (the backend package imports this module)

    close_children(world, letter.run_id)  # its child runs: the parent_close policy, as any run end applies it
    return True


def settle(world: Any, store: DeadLetterStore | None, letters: Sequence[DeadLetter]) -> list[str]:
    """Fail the runs of ``letters`` (:func:`fail_run`) and record them as settled; the ids of the runs failed now.

    Called right after a move, and by :func:`sweep`: the move and the run's failure are two transactions, and a
    process that dies between them leaves the dead letter unsettled for the next sweep. ``store`` None: a store that
    keeps no settled flag (SQS)."""
    failed = [letter.run_id for letter in letters if letter.run_id and fail_run(world, letter)]
    if store is not None:
        store.settle_dead_letters([letter.id for letter in letters])
    return [run_id for run_id in failed if run_id]


def sweep(world: Any, store: DeadLetterStore, *, limit: int = 100) -> list[str]:
    """Settle the dead letters whose runs were not failed yet (up to ``limit``); the ids of the runs failed now."""
    return settle(world, store, store.unsettled_dead_letters(limit=limit))
