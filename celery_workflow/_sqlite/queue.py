"""The SQLite queue: deliveries of the SQLite World and the storage of the SQLite Kombu transport.

One table (``celery_workflow_queue``, migration ``0002_queue.sql``) holds a row per delivery: queue name, payload
(UTF-8 JSON of a Kombu virtual-transport message, whichever side inserted it), run id, ``not_before``, attempts,
``lease_until``, idempotency key, ``expires_at`` (message TTL) and ``created_at``; times are integer microseconds
since the epoch taken from :attr:`SQLiteQueue.clock` (Python's ``time.time``), never from SQLite.

Guarantees (the seed's worker model):

* A claim takes due rows (``not_before <= now``, no live lease, not expired), oldest due first, sets
  ``lease_until = now + lease``, increments ``attempts`` and clears the idempotency key, all in one
  ``BEGIN IMMEDIATE`` transaction, so concurrent claimers in any number of processes never get the same claim.
* A receipt (``"<id>.<attempts>"``, :mod:`celery_workflow._backend.broker`) names exactly one claim: ids are never
  reused (AUTOINCREMENT) and every claim increments ``attempts``. ack / release / retry_later / extend with a stale receipt (the row was re-claimed after
  its lease ran out, released, or deleted) change nothing.
* An idempotency key deduplicates against a *pending* row of the same run (rows without a run: of the same queue),
  enforced by a partial unique index and ``INSERT … ON CONFLICT DO NOTHING``; claiming releases the key, so a delivery
  queued while the previous one executes is never dropped.
* A message put on a queue declared with ``x-message-ttl`` expires that long after it is *due* (so a delayed message
  is not dropped before it could be delivered); one put with a TTL of its own (``put(…, ttl=…)``: Kombu's
  ``expiration``) expires that long after it was *put*, as Celery's ``expires`` and RabbitMQ's per-message TTL count,
  or earlier if its queue's TTL says so. Expired rows are never claimed nor counted, and :meth:`SQLiteQueue.gc`
  deletes them unless someone holds them.
* Broker state for the transport (queue declarations with ``x-expires`` / ``x-message-ttl`` / auto_delete,
  exchanges, bindings, live consumers) lives in the same file, shared by every process; :meth:`SQLiteQueue.gc`
  collects unused queues, dead consumers' auto-delete queues and expired messages.

Every sqlite3 error is raised as :class:`~celery_workflow.errors.WorldError` with the driver error as ``__cause__``.
:class:`SQLiteQueue` structurally implements the whole queue contract
(:class:`~celery_workflow._backend.queue_contract.QueueBrokerStore` and
:class:`~celery_workflow._backend.queue_contract.ExpiringStore`).

Parts: :class:`SQLiteQueue` is composed of :class:`~.deliveries.Deliveries` (the queue table's rows),
:class:`~.letters.DeadLetters` and :class:`~.broker_state.BrokerState` (queues, exchanges, bindings, consumers), all
on one :class:`~.queue_base.Transactions` (the database and the queue's clock). The queue contract's methods are
handed to their parts by :class:`~celery_workflow._backend.composed.ComposedQueue`; this class adds what is
SQLite's own (the World's in-transaction writes, and watching the database file for changes).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence

from celery_workflow._backend.broker import queue_tables
from celery_workflow._backend.composed import ComposedQueue
from celery_workflow._sqlite.broker_state import BrokerState
from celery_workflow._sqlite.database import Database
from celery_workflow._sqlite.deliveries import Deliveries
from celery_workflow._sqlite.letters import DeadLetters
from celery_workflow._sqlite.queue_base import Transactions
from celery_workflow.errors import WorldError
from celery_workflow.world import Delivery

__all__ = ["TABLES", "SQLiteQueue"]

#: The queue's tables as the code expects them (the migration test compares the migrated schema with this).
TABLES = queue_tables(
    ttl_columns=("expires_ms", "message_ttl_ms"), idempotency_indexes=("celery_workflow_queue_idempotency",)
)


class SQLiteQueue(ComposedQueue):
    """Deliveries and broker state in a :class:`~celery_workflow._sqlite.database.Database` (thread- and fork-safe),
    composed of its parts (see the module docstring)."""

    deliveries: Deliveries
    letters: DeadLetters
    broker_state: BrokerState

    def __init__(self, db: Database) -> None:
        self.tx = Transactions(db)
        self.deliveries = Deliveries(self.tx)
        self.letters = DeadLetters(self.tx)
        self.broker_state = BrokerState(self.tx)

    @property
    def db(self) -> Database:
        return self.tx.db

    @property
    def clock(self) -> Callable[[], float]:
        """Wall clock in seconds since the epoch (``time.time``); tests may replace it, for every part at once."""
        return self.tx.clock

    @clock.setter
    def clock(self, value: Callable[[], float]) -> None:
        self.tx.clock = value

    # -- in a World's open transaction (Deliveries) --------------------------------------------------------------------

    def insert(self, conn: sqlite3.Connection, deliveries: Sequence[Delivery]) -> list[bool]:
        return self.deliveries.insert(conn, deliveries)

    def delete_for_run(self, conn: sqlite3.Connection, run_id: str) -> int:
        return self.deliveries.delete_for_run(conn, run_id)

    def delete_claim(self, conn: sqlite3.Connection, receipt: str) -> None:
        self.deliveries.delete_claim(conn, receipt)

    # -- change notification -------------------------------------------------------------------------------------------

    def change_token(self) -> int:
        """A value that changes when another connection commits (``PRAGMA data_version``)."""
        try:
            return self.db.data_version()
        except sqlite3.Error as exc:
            raise WorldError(f"SQLite queue: {exc}") from exc

    def wait_for_change(self, token: int, timeout: float) -> bool:
        """Block until another connection commits after ``token`` was taken (True), or ``timeout`` seconds pass."""
        try:
            return self.db.wait_for_change(token, timeout) != token
        except sqlite3.Error as exc:
            raise WorldError(f"SQLite queue: {exc}") from exc
