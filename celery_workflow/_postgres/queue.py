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
:class:`celery_workflow.transport.base.BrokerStore`.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from datetime import timedelta
from typing import Any

from celery_workflow import dead_letters as dead_letters_
from celery_workflow._backend.broker import (
    QueuedMessage,
    claimed,
    dead_letters,
    parse_receipt,
    queued_messages,
)
from celery_workflow._postgres import queue_sql as stmt
from celery_workflow._postgres.broker_state import BrokerState
from celery_workflow._postgres.listener import CHANNEL_QUEUE
from celery_workflow._postgres.queue_base import Conn, at, utc
from celery_workflow._postgres.script import Script
from celery_workflow._postgres.standing import Registration
from celery_workflow.dead_letters import DeadLetter, cut_error
from celery_workflow.errors import DeadLetterNotFound
from celery_workflow.ids import to_utc
from celery_workflow.world import ClaimedDelivery, Delivery

__all__ = ["PostgresQueue", "parse_receipt"]


def _interval(seconds: float | None) -> timedelta | None:
    return None if seconds is None else timedelta(seconds=max(seconds, 0.0))


class PostgresQueue(BrokerState):
    """Deliveries and broker state in a :class:`~celery_workflow._postgres.database.PgDatabase` (thread- and fork-safe)."""

    #: It honours a message's own TTL (:class:`~celery_workflow.transport.store.ExpiringStore`).
    expires_messages = True

    # -- used by the Postgres World inside its own transaction ---------------------------------------------------

    def insert(self, conn: Conn, deliveries: Sequence[Delivery]) -> list[bool]:
        """Insert deliveries in the caller's open transaction; ``False`` for one deduplicated by its key.

        Sends the queue's NOTIFY in that transaction (delivered at its commit). psycopg errors are not wrapped, so
        the caller's :meth:`PgDatabase.run` can retry or map them.
        """
        script = Script(conn)
        slots = self.add_inserts(script, deliveries)
        results = script.send()
        return [len(results[i].rows) == 1 for i in slots]

    def add_inserts(
        self,
        script: Script,
        deliveries: Sequence[Delivery],
        *,
        when: tuple[str, Mapping[str, Any]] | None = None,
        hand_off: bool = False,
    ) -> list[int]:
        """Queue the inserts of ``deliveries`` (with their NOTIFY) on a caller's :class:`Script`; the indexes of
        their results (one row each when stored, none when deduplicated). ``when``: an SQL condition (with its own
        ``%(name)s`` parameters) a delivery is stored under, evaluated by the statement. ``hand_off``: one delivery
        alone, due now, may be handed to an idle consumer's standing claim (:mod:`.standing`), its idempotency key
        dropped: only for a delivery that cannot have a pending duplicate (the first of a new run)."""
        alone = len(deliveries) == 1  # then announced with its row id (see queue_sql.NOTIFY_ROW)
        condition = "true" if when is None else when[0]
        extra = {} if when is None else dict(when[1])
        return [
            script.add(
                stmt.insert(
                    stmt.dedup_scope(d.run_id, d.idempotency_key), alone=alone, when=condition, handoff=hand_off
                ),
                self._params(
                    queue=d.queue,
                    payload=bytes(d.payload),
                    run_id=d.run_id,
                    key=d.idempotency_key,
                    due=None if d.not_before is None else to_utc(d.not_before),
                    ttl=None,
                    handoff=hand_off,
                    **extra,
                ),
            )
            for d in deliveries
        ]

    def delete_for_run(self, conn: Conn, run_id: str) -> int:
        """Delete every delivery of a run (pending or claimed) in the caller's transaction; return the count."""
        return int(conn.execute(f"DELETE FROM {stmt.Q} WHERE run_id = %s", (run_id,)).rowcount)

    # -- the World's queue facet ---------------------------------------------------------------------------------

    def enqueue(self, deliveries: Sequence[Delivery]) -> list[bool]:
        """Store deliveries in one transaction; ``False`` for one deduplicated by its idempotency key."""
        if not deliveries:
            return []

        def go(conn: Conn) -> list[bool]:
            script = Script(conn)
            whole = len(deliveries) > 1 or self.db.lazy_commits
            if whole:  # a stored message is on disk, whatever the session says
                script.begin(synchronous_commit=True if self.db.lazy_commits else None)
            slots = self.add_inserts(script, deliveries)
            if whole:
                script.add("COMMIT")
            results = script.send()  # one round trip for the whole transaction
            return [len(results[i].rows) == 1 for i in slots]

        return self.db.run(go, what="queue: enqueue", transaction=False)

    def claim(self, queues: Sequence[str], *, limit: int = 1, lease: float = 60.0) -> list[ClaimedDelivery]:
        """Claim up to ``limit`` due rows of ``queues``, oldest due first, hidden for ``lease`` seconds."""
        return self.receive(queues, limit=limit, lease=lease)

    def ack(self, receipt: str, *, register: Registration | None = None, lease: float = 60.0) -> None:
        """Delete the claimed row; no-op when the receipt is stale. ``register``: and make that standing claim (with
        ``lease``), in the same round trip (see :mod:`.standing`)."""
        row_id, attempts = parse_receipt(receipt)
        delete = f"DELETE FROM {stmt.Q} WHERE id = %(id)s AND attempts = %(attempts)s AND lease_until IS NOT NULL"
        if register is None:
            self._rowcount("ack", delete, commit_mode="lazy", id=row_id, attempts=attempts)
            return
        self._rows(
            "ack", stmt.REGISTER_ALONE, commit_mode="lazy", before=(delete,), id=row_id, attempts=attempts,
            lease=timedelta(seconds=lease), **register.params(),
        )  # fmt: skip

    def delete_claim(self, conn: Conn, receipt: str) -> None:
        """Delete the claimed row in the caller's open transaction; no-op when the receipt is stale.

        psycopg errors are not wrapped (see :meth:`insert`); a malformed receipt is a WorldError.
        """
        script = Script(conn)
        self.add_delete_claim(script, receipt)
        script.send()

    @staticmethod
    def add_delete_claim(script: Script, receipt: str) -> int:
        """Queue the deletion of a claimed row on a caller's :class:`Script` (stale receipts delete nothing)."""
        row_id, attempts = parse_receipt(receipt)
        return script.add(
            f"DELETE FROM {stmt.Q} WHERE id = %s AND attempts = %s AND lease_until IS NOT NULL", (row_id, attempts)
        )

    def release(self, receipt: str) -> None:
        """Clear the lease (and notify): claimable again at once, keeping its due time. No-op when stale."""
        row_id, attempts = parse_receipt(receipt)
        self._rows(
            "release",
            f"WITH r AS (UPDATE {stmt.Q} SET lease_until = NULL"
            " WHERE id = %(id)s AND attempts = %(attempts)s AND lease_until IS NOT NULL RETURNING queue)"
            f" SELECT {stmt.NOTIFY} FROM r",
            commit_mode="lazy",
            id=row_id,
            attempts=attempts,
        )

    def retry_later(self, receipt: str, delay: float, *, error: str | None = None) -> None:
        """Clear the lease and make the row due ``delay`` seconds from now, recording a failed delivery (and
        ``error``, when given, as its last error). No-op when the receipt is stale."""
        row_id, attempts = parse_receipt(receipt)
        self._rowcount(
            "retry later",
            f"UPDATE {stmt.Q} SET lease_until = NULL, not_before = {stmt.NOW} + %(delay)s,"
            f" first_failed_at = COALESCE(first_failed_at, {stmt.NOW}), last_failed_at = {stmt.NOW},"
            " last_error = COALESCE(%(error)s, last_error)"
            " WHERE id = %(id)s AND attempts = %(attempts)s AND lease_until IS NOT NULL",
            commit_mode="lazy",
            id=row_id,
            attempts=attempts,
            delay=timedelta(seconds=max(delay, 0.0)),
            error=cut_error(error),
        )

    # -- dead letters (celery_workflow.dead_letters.DeadLetterStore) -------------------------------------------

    def dead_letter(self, receipt: str, *, reason: str, error: str | None = None) -> DeadLetter | None:
        """Move the claimed row to the dead letters with its history (``error`` becomes its last error when given);
        None when the receipt is stale. On disk when this returns."""
        row_id, attempts = parse_receipt(receipt)
        rows = self._rows(
            "dead-letter", stmt.DEAD_LETTER, commit_mode="disk", id=row_id, attempts=attempts, reason=reason,
            error=cut_error(error),
        )  # fmt: skip
        letters = dead_letters(rows, utc)
        return letters[0] if letters else None

    def list_dead_letters(
        self, *, queue: str | None = None, run_id: str | None = None, after: int | str = 0, limit: int = 100
    ) -> list[DeadLetter]:
        """Dead letters with ids above ``after``, oldest first (of ``queue`` / ``run_id`` when given)."""
        rows = self._rows(
            "list dead letters",
            f"SELECT {stmt.DEAD_COLUMNS} FROM {stmt.DEAD} WHERE {stmt.DEAD_SELECTION}"
            " AND (%(run_id)s::text IS NULL OR run_id = %(run_id)s) AND id > %(after)s ORDER BY id LIMIT %(limit)s",
            ids=None, queue=queue, run_id=run_id, after=dead_letters_.letter_id(after), limit=max(limit, 0),
        )  # fmt: skip
        return dead_letters(rows, utc)

    def get_dead_letter(self, letter_id: int | str) -> DeadLetter:
        rows = self._rows(
            "get dead letter",
            f"SELECT {stmt.DEAD_COLUMNS} FROM {stmt.DEAD} WHERE id = %(id)s",
            id=dead_letters_.letter_id(letter_id),
        )
        if not rows:
            raise DeadLetterNotFound(f"no dead letter {letter_id}")
        return dead_letters(rows, utc)[0]

    def unsettled_dead_letters(self, *, limit: int = 100) -> list[DeadLetter]:
        """Dead letters whose run has not been failed because of them yet, oldest first."""
        rows = self._rows(
            "unsettled dead letters",
            f"SELECT {stmt.DEAD_COLUMNS} FROM {stmt.DEAD} WHERE run_settled_at IS NULL ORDER BY id LIMIT %(limit)s",
            limit=max(limit, 0),
        )
        return dead_letters(rows, utc)

    def settle_dead_letters(self, ids: Sequence[int | str]) -> None:
        """Record that the runs of these dead letters have been dealt with."""
        if ids:
            self._rowcount(
                "settle dead letters",
                f"UPDATE {stmt.DEAD} SET run_settled_at = {stmt.NOW}"
                " WHERE id = ANY(%(ids)s::bigint[]) AND run_settled_at IS NULL",
                ids=[dead_letters_.letter_id(i) for i in ids],
            )

    def redrive_dead_letters(self, ids: Sequence[int | str] | None = None, *, queue: str | None = None) -> int:
        """Put the selected dead letters back on their queues, due now with attempts reset, and delete them."""
        if ids is not None and not ids:
            return 0
        chosen = None if ids is None else [dead_letters_.letter_id(i) for i in ids]
        return len(self._rows("redrive dead letters", stmt.REDRIVE, commit_mode="disk", ids=chosen, queue=queue))

    def purge_dead_letters(self, ids: Sequence[int | str] | None = None, *, queue: str | None = None) -> int:
        if ids is not None and not ids:
            return 0
        chosen = None if ids is None else [dead_letters_.letter_id(i) for i in ids]
        return self._rowcount(
            "purge dead letters", f"DELETE FROM {stmt.DEAD} WHERE {stmt.DEAD_SELECTION}", ids=chosen, queue=queue
        )

    def extend(self, receipts: Sequence[str], lease: float) -> None:
        """Set the lease of each still-held claim to ``lease`` seconds from now; stale receipts are skipped."""
        if not receipts:
            return
        parsed = sorted(parse_receipt(r) for r in receipts)  # one lock order for every extender
        self._rowcount(
            "extend leases",
            f"UPDATE {stmt.Q} AS q SET lease_until = {stmt.NOW} + %(lease)s"
            " FROM unnest(%(ids)s::bigint[], %(attempts)s::integer[]) AS r(id, attempts)"
            " WHERE q.id = r.id AND q.attempts = r.attempts AND q.lease_until IS NOT NULL",
            commit_mode="lazy",
            ids=[p[0] for p in parsed],
            attempts=[p[1] for p in parsed],
            lease=timedelta(seconds=lease),
        )

    # -- BrokerStore: messages -----------------------------------------------------------------------------------

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
        """Insert one message (due at ``not_before``, epoch seconds, or now) and notify; ``False`` when deduplicated.
        ``ttl``: it expires that many seconds from now (see :class:`~celery_workflow.transport.store.ExpiringStore`).

        A message due now without an idempotency key is handed to an idle consumer's standing claim when there is
        one (:mod:`.standing`)."""
        payload = bytes(payload)
        rows = self._rows(
            "put",
            stmt.insert(stmt.dedup_scope(run_id, idempotency_key), alone=True, handoff=True),
            commit_mode="disk",
            queue=queue,
            payload=payload,
            run_id=run_id,
            key=idempotency_key,
            due=at(not_before),
            ttl=_interval(ttl),
            handoff=idempotency_key is None,
        )
        return len(rows) == 1

    def put_fanout(
        self, exchange: str, payload: bytes, *, not_before: float | None = None, ttl: float | None = None
    ) -> int:
        """Insert a copy of the message on every queue bound to ``exchange`` (and notify each); return the count.
        ``ttl``: as for :meth:`put`."""
        return len(
            self._rows(
                "fanout",
                stmt.FANOUT,
                commit_mode="disk",
                exchange=exchange,
                payload=bytes(payload),
                due=at(not_before),
                ttl=_interval(ttl),
            )
        )

    def receive(
        self, queues: Sequence[str], *, no_ack: Collection[str] = (), limit: int = 1, lease: float = 60.0
    ) -> list[ClaimedDelivery]:
        """Claim up to ``limit`` due rows of ``queues``, oldest due first, in one statement.

        Rows of queues in ``no_ack`` are deleted by that statement (delete-on-receive for consumers that never ack);
        the others are leased for ``lease`` seconds.
        """
        if not queues or limit <= 0:
            return []
        rows = self._rows(
            "claim",
            stmt.RECEIVE,
            commit_mode="lazy",
            queues=list(dict.fromkeys(queues)),
            no_ack=list(no_ack),
            limit=limit,
            lease=timedelta(seconds=lease),
        )
        return [claimed(r[0], r[1], r[2], r[3], r[4]) for r in rows]

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
        """:meth:`receive`, then :meth:`due_times` of ``queues`` (what the claim left), in one statement.

        Standing claims (:mod:`.standing`), in the same round trip: ``withdraw`` (a token) first ends that claim,
        releasing a message handed to it; ``register``, when the poll claims nothing, makes that claim."""
        if not queues or limit <= 0:
            return [], {}
        names = list(dict.fromkeys(queues))
        claim: dict[str, Any] = {
            "queues": names,
            "no_ack": list(no_ack),
            "limit": limit,
            "lease": timedelta(seconds=lease),
        }
        sql = stmt.POLL
        if register is not None:
            sql = stmt.POLL_REGISTER
            claim.update(register.params())
        if withdraw is not None:
            if register is not None and register.token != withdraw:
                raise ValueError("a poll withdraws and registers the standing claim of one consumer")
            claim["token"] = withdraw
        before = () if withdraw is None else stmt.WITHDRAWAL
        rows = self._rows("claim", sql, commit_mode="lazy", before=before, **claim)
        now = self._local_now()
        taken = sorted((r for r in rows if r[0] is not None), key=lambda r: (r[5], r[0]))  # oldest due first
        claims = [claimed(r[0], r[1], r[2], r[3], r[4]) for r in taken]
        return claims, {str(r[1]): now + float(r[6]) for r in rows if r[0] is None}

    def claim_notified(
        self, queue: str, row_id: int, *, lease: float = 60.0, withdraw: str | None = None
    ) -> list[ClaimedDelivery]:
        """Lease the row a notification of ``queue`` announced (see ``NOTIFY_ROW``), if it is still claimable and no
        other claim has it: one index lookup by key, where :meth:`poll` looks through every queue. The caller knows
        it is the queue's only claimable row (else it must :meth:`poll`, which claims the oldest first).
        ``withdraw``: as in :meth:`poll`."""
        rows = self._rows(
            "claim", stmt.CLAIM_NOTIFIED, commit_mode="lazy", id=row_id, queue=queue, lease=timedelta(seconds=lease),
            before=() if withdraw is None else stmt.WITHDRAWAL, token=withdraw,
        )  # fmt: skip
        return [claimed(r[0], r[1], r[2], r[3], r[4]) for r in rows]

    def fetch_handed(self, token: str, serial: int, row_id: int) -> ClaimedDelivery | None:
        """The message handed to the standing claim ``token`` of ``serial`` (row ``row_id``, as its notification
        named it), while it is still that claim's and leased as the hand-off left it; None otherwise. One read by
        key, no write (see ``queue_sql.FETCH_HANDED``)."""
        rows = self._rows("fetch a handed-off message", stmt.FETCH_HANDED, token=token, serial=serial, id=row_id)
        return claimed(rows[0][0], rows[0][1], rows[0][2], rows[0][3], rows[0][4]) if rows else None

    def withdraw(self, token: str, *, release: bool = True, forget: bool = False) -> None:
        """End the standing claim ``token`` (see :mod:`.standing`): no longer offered; ``release``: a message handed
        to it goes back to its queue as never claimed; ``forget``: its row is deleted too."""
        statements = [
            *(stmt.WITHDRAWAL if release else stmt.WITHDRAWAL[:1]),
            *([stmt.FORGET_STANDING] if forget else []),
        ]
        self._rows("withdraw a standing claim", statements[-1], commit_mode="lazy", before=statements[:-1], token=token)

    def due_times(self, queues: Sequence[str]) -> dict[str, float]:
        """For each of ``queues`` holding a row: epoch seconds (this process's clock) at which its next row becomes
        claimable (due, or its lease runs out). Queues without rows are left out."""
        if not queues:
            return {}
        rows = self._rows("due times", stmt.DUE_TIMES, queues=list(dict.fromkeys(queues)))
        now = self._local_now()
        return {str(name): now + float(seconds) for name, seconds in rows}

    def next_due(self, queues: Sequence[str]) -> float | None:
        """Epoch seconds (this process's clock) at which the next row of ``queues`` becomes claimable, or None."""
        return min(self.due_times(queues).values(), default=None)

    def peek(self, queues: Sequence[str] | None = None) -> list[QueuedMessage]:
        """Every stored message of ``queues`` (all queues when None), claimed or not, in claim order (due time, id):
        what an operator, the CLI or a test looks at instead of the table. Times are the database server's."""
        if queues is not None and not queues:
            return []
        rows = self._rows(
            "peek",
            "SELECT id, queue, run_id, attempts, not_before, lease_until, idempotency_key, expires_at,"
            f" payload FROM {stmt.Q}"
            " WHERE %(queues)s::text[] IS NULL OR queue = ANY(%(queues)s::text[]) ORDER BY not_before, id",
            queues=None if queues is None else list(dict.fromkeys(queues)),
        )
        return queued_messages(rows, lambda moment: float(moment.timestamp()))

    def size(self, queue: str) -> int:
        """Messages waiting on ``queue``: not leased and not expired (delayed ones included)."""
        rows = self._rows(
            "size",
            f"SELECT count(*) FROM {stmt.Q} WHERE queue = %(queue)s AND (lease_until IS NULL OR lease_until <= {stmt.NOW})"
            f" AND (expires_at IS NULL OR expires_at > {stmt.NOW})",
            queue=queue,
        )
        return int(rows[0][0])

    def purge(self, queue: str) -> int:
        """Delete the messages :meth:`size` counts (claimed ones stay with their holders); return the count."""
        return self._rowcount(
            "purge",
            f"DELETE FROM {stmt.Q} WHERE queue = %(queue)s AND (lease_until IS NULL OR lease_until <= {stmt.NOW})",
            queue=queue,
        )

    # -- BrokerStore: change notification ------------------------------------------------------------------------

    def change_token(self, queues: Sequence[str] | None = None) -> Any:
        """A mark of the queue notifications seen so far (of ``queues``, or of any queue); take it before checking.

        Reconnections of the listener also count as a change (notifications may have been lost meanwhile).
        """
        listener = self.db.listener
        if queues is None:
            return (listener.mark(CHANNEL_QUEUE), None)
        return (listener.mark(CHANNEL_QUEUE), {q: listener.mark(CHANNEL_QUEUE, q) for q in dict.fromkeys(queues)})

    def wait_for_change(self, token: Any, timeout: float) -> bool:
        """Block until a queue notification after ``token`` (for one of its queues), or ``timeout`` seconds pass.

        A notification on another queue wakes this thread only to compare in-memory counters; no query runs.
        """
        listener = self.db.listener
        anything, marks = token
        if marks is None:
            return listener.wait(CHANNEL_QUEUE, anything, timeout)
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            current = listener.mark(CHANNEL_QUEUE)  # before comparing: a later notification ends the wait below
            if any(listener.mark(CHANNEL_QUEUE, q) != mark for q, mark in marks.items()):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            listener.wait(CHANNEL_QUEUE, current, left)

    def mark(self, key: str) -> Any:
        """The notification mark of one key of the queue channel (a queue's name, or a key :meth:`poke` wakes)."""
        return self.db.listener.mark(CHANNEL_QUEUE, key)

    def carried(self, key: str) -> str | None:
        """What the last notification of ``key`` carried after the queue's name (a row id, see ``NOTIFY_ROW``)."""
        return self.db.listener.carried(CHANNEL_QUEUE, key)

    def poke(self, key: str) -> None:
        """Wake this process's waiters on ``key`` as a notification would (no database round trip, no NOTIFY)."""
        self.db.listener.poke(CHANNEL_QUEUE, key)
