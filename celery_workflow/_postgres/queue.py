"""The Postgres queue: deliveries of the Postgres World and the storage of the Postgres Kombu transport.

One table (``celery_workflow_queue``, migration ``0002_queue.sql``) holds a row per delivery: queue name, payload
(UTF-8 JSON of a Kombu virtual-transport message, whichever side inserted it, as ``bytea``), run id, ``not_before``,
attempts, ``lease_until``, idempotency key, ``expires_at`` (message TTL) and ``created_at``.

Clock: every comparison and stored time uses the **database server's clock** (``now()``; each transaction here is
one statement, except those joining a caller's), so workers on several hosts agree on when a lease runs out and a
row is due, whatever their own clocks say. The only Python times are absolute due times handed in
(``Delivery.not_before``, a Celery ``eta``): a producer's clock skew shifts its own delays, never someone else's
lease. :meth:`PostgresQueue.next_due` returns ``time.time()`` plus the database's "seconds until". Tests may set
:attr:`PostgresQueue.clock` to a Python clock, which then replaces ``now()`` in every statement.

Guarantees (the seed's worker model):

* A claim is one statement: for each queue, ``SELECT … ORDER BY not_before, id LIMIT n FOR UPDATE SKIP LOCKED``
  (walking the ``(queue, not_before, id)`` index), the oldest ``n`` of those, then ``UPDATE`` them: ``lease_until =
  now + lease``, ``attempts + 1``, idempotency key cleared (rows of ``no_ack`` queues are deleted instead). Concurrent
  claimers in any number of processes skip each other's rows and never get the same claim; READ COMMITTED re-checks a
  locked row's conditions, so a row claimed and committed by someone else meanwhile is skipped.
* A receipt (``"<id>.<attempts>"``) names exactly one claim: ids are never reused (bigserial) and every claim
  increments ``attempts``. ack / release / retry_later / extend with a stale receipt change nothing.
* An idempotency key deduplicates against a *pending* row of the same run (rows without a run: of the same queue),
  enforced by partial unique indexes; claiming releases the key. A duplicate locks the pending row it joined until
  its transaction ends, so that row is not claimed before what was written with the duplicate is visible
  (``queue_sql.ON_CONFLICT``).
* Durability: an insert (``put``, ``enqueue``, a World append's deliveries) is on disk when the call returns. Claims,
  acks, lease changes and heartbeats commit without waiting for the disk (``synchronous_commit = off``; the next
  durable commit, at most ``wal_writer_delay`` later, takes them along): a database crash can lose the last moments
  of them, and a message whose claim or ack was lost is delivered again, as at-least-once delivery allows. This
  saves a disk flush per claim and per ack.
* Every insert sends ``pg_notify on the schema's celery_workflow_queue channel`` in the inserting transaction (so listeners hear
  it at commit, never before); a release notifies too (the row is claimable again at once).
* Messages on a queue declared with ``x-message-ttl`` expire that long after they are *due*; one put with a TTL of
  its own (``put(…, ttl=…)``: Kombu's ``expiration``) expires that long after it was *put* (the database's clock), or
  earlier if its queue's TTL says so. Expired rows are never claimed nor counted and :meth:`PostgresQueue.gc` deletes
  them unless someone holds them.
* Broker state for the transport (queue declarations, exchanges, bindings, live consumers) lives in the same schema,
  shared by every process; :meth:`PostgresQueue.gc` collects unused queues, dead consumers' auto-delete queues and
  expired messages (one collector at a time per schema, under a transaction-level advisory lock).

Errors: the methods that run their own transactions go through :meth:`PgDatabase.run` (retried on serialization
failures, deadlocks and lost connections; what still fails is :class:`~celery_workflow.errors.WorldError`).
:meth:`insert`, :meth:`delete_for_run` and :meth:`delete_claim` run in the caller's transaction and let psycopg errors
through unchanged, so the caller's ``PgDatabase.run`` can retry them. :class:`PostgresQueue` structurally implements
the whole queue contract (:class:`~celery_workflow._backend.queue_contract.QueueBrokerStore` and
:class:`~celery_workflow._backend.queue_contract.ExpiringStore`).

Parts: :class:`PostgresQueue` is composed of :class:`~.deliveries.Deliveries` (the queue table's rows),
:class:`~.letters.DeadLetters`, :class:`~.broker_state.BrokerState` (queues, exchanges, bindings, consumers),
:class:`~.standing.StandingClaims` and :class:`~.changes.Changes` (notifications), all on one
:class:`~.queue_base.Statements` (the database and the statements' clock). The queue contract's methods are handed
to their parts by :class:`~celery_workflow._backend.composed.ComposedQueue`; this class adds what is Postgres's own.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from celery_workflow._backend.broker import parse_receipt
from celery_workflow._backend.composed import ComposedQueue
from celery_workflow._postgres.broker_state import BrokerState
from celery_workflow._postgres.changes import Changes
from celery_workflow._postgres.database import PgDatabase
from celery_workflow._postgres.deliveries import Deliveries
from celery_workflow._postgres.letters import DeadLetters
from celery_workflow._postgres.queue_base import Conn, Statements
from celery_workflow._postgres.script import Script
from celery_workflow._postgres.standing import Registration, StandingClaims
from celery_workflow.world import ClaimedDelivery, Delivery

__all__ = ["PostgresQueue", "parse_receipt"]


class PostgresQueue(ComposedQueue):
    """Deliveries and broker state in a :class:`~celery_workflow._postgres.database.PgDatabase` (thread- and
    fork-safe), composed of its parts (see the module docstring)."""

    deliveries: Deliveries
    letters: DeadLetters
    broker_state: BrokerState

    def __init__(self, db: PgDatabase) -> None:
        self.sql = Statements(db)
        self.deliveries = Deliveries(self.sql)
        self.letters = DeadLetters(self.sql)
        self.broker_state = BrokerState(self.sql)
        self.standing = StandingClaims(self.sql)
        self.changes = Changes(db)

    @property
    def db(self) -> PgDatabase:
        return self.sql.db

    @property
    def clock(self) -> Callable[[], float] | None:
        """None (the default): the database server's clock. Tests may set a Python clock (epoch seconds), which every
        part's statements then use."""
        return self.sql.clock

    @clock.setter
    def clock(self, value: Callable[[], float] | None) -> None:
        self.sql.clock = value

    # -- in a World's open transaction (Deliveries) --------------------------------------------------------------------

    def insert(self, conn: Conn, deliveries: Sequence[Delivery]) -> list[bool]:
        return self.deliveries.insert(conn, deliveries)

    def add_inserts(
        self,
        script: Script,
        deliveries: Sequence[Delivery],
        *,
        when: tuple[str, Mapping[str, Any]] | None = None,
        hand_off: bool = False,
    ) -> list[int]:
        return self.deliveries.add_inserts(script, deliveries, when=when, hand_off=hand_off)

    def delete_for_run(self, conn: Conn, run_id: str) -> int:
        return self.deliveries.delete_for_run(conn, run_id)

    def delete_claim(self, conn: Conn, receipt: str) -> None:
        self.deliveries.delete_claim(conn, receipt)

    def add_delete_claim(self, script: Script, receipt: str) -> int:
        return self.deliveries.add_delete_claim(script, receipt)

    # -- with standing claims riding along (Deliveries) ----------------------------------------------------------------

    def ack(self, receipt: str, *, register: Registration | None = None, lease: float = 60.0) -> None:
        self.deliveries.ack(receipt, register=register, lease=lease)

    def poll(
        self,
        queues: Sequence[str],
        *,
        no_ack: Collection[str] = (),
        limit: int = 1,
        lease: float = 60.0,
        withdraw: str | None = None,
        register: Registration | None = None,
    ) -> tuple[list[ClaimedDelivery], dict[str, float]]:
        return self.deliveries.poll(
            queues, no_ack=no_ack, limit=limit, lease=lease, withdraw=withdraw, register=register
        )

    # -- standing claims (StandingClaims) ------------------------------------------------------------------------------

    def claim_notified(
        self, queue: str, row_id: int, *, lease: float = 60.0, withdraw: str | None = None
    ) -> list[ClaimedDelivery]:
        return self.standing.claim_notified(queue, row_id, lease=lease, withdraw=withdraw)

    def fetch_handed(self, token: str, serial: int, row_id: int) -> ClaimedDelivery | None:
        return self.standing.fetch_handed(token, serial, row_id)

    def withdraw(self, token: str, *, release: bool = True, forget: bool = False) -> None:
        self.standing.withdraw(token, release=release, forget=forget)

    # -- change notification (Changes) ---------------------------------------------------------------------------------

    def change_token(self, queues: Sequence[str] | None = None) -> Any:
        return self.changes.change_token(queues)

    def wait_for_change(self, token: Any, timeout: float) -> bool:
        return self.changes.wait_for_change(token, timeout)

    def mark(self, key: str) -> Any:
        return self.changes.mark(key)

    def carried(self, key: str) -> str | None:
        return self.changes.carried(key)

    def poke(self, key: str) -> None:
        self.changes.poke(key)
