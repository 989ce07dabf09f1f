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
:class:`SQLiteQueue` structurally implements :class:`celery_workflow.transport.base.BrokerStore`.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Collection, Sequence
from typing import Any

from celery_workflow import dead_letters as dead_letters_
from celery_workflow._backend.broker import (
    BROKER_BINDINGS,
    BROKER_QUEUES,
    DEAD_LETTER_COLUMNS,
    DEAD_LETTERS,
    QUEUE,
    QueuedMessage,
    claimed,
    dead_letters,
    parse_receipt,
    queue_tables,
    queued_messages,
)
from celery_workflow._sqlite.broker_state import BrokerState
from celery_workflow._sqlite.queue_base import from_micros, marks, micros
from celery_workflow.dead_letters import LEASE_EXPIRED, DeadLetter, cut_error
from celery_workflow.errors import DeadLetterNotFound, WorldError
from celery_workflow.ids import to_micros
from celery_workflow.world import ClaimedDelivery, Delivery

__all__ = ["TABLES", "SQLiteQueue"]

_Q = QUEUE
_QUEUES = BROKER_QUEUES
_BINDINGS = BROKER_BINDINGS
_DEAD = DEAD_LETTERS
_DEAD_COLUMNS = ", ".join(DEAD_LETTER_COLUMNS.split())

#: The queue's tables as the code expects them (the migration test compares the migrated schema with this).
TABLES = queue_tables(
    ttl_columns=("expires_ms", "message_ttl_ms"), idempotency_indexes=("celery_workflow_queue_idempotency",)
)

_INSERT = (
    f"INSERT INTO {_Q} (queue, payload, run_id, not_before, idempotency_key, expires_at, created_at)"
    f" VALUES (?, ?, ?, ?, ?, (SELECT ? + message_ttl_ms * 1000 FROM {_QUEUES} WHERE name = ?), ?)"
    " ON CONFLICT DO NOTHING"
)

# A message put with its own TTL (``ttl``: Kombu's ``expiration``) expires ``ttl`` after it was put or as its queue's
# ``x-message-ttl`` says, whichever comes first (SQLite's MIN() of a NULL is NULL: hence the COALESCEs).
_QUEUE_EXPIRY = f"(SELECT :due + message_ttl_ms * 1000 FROM {_QUEUES} WHERE name = :queue)"
_INSERT_EXPIRING = (
    f"INSERT INTO {_Q} (queue, payload, run_id, not_before, idempotency_key, expires_at, created_at)"
    f" VALUES (:queue, :payload, :run_id, :due, :key,"
    f" MIN(COALESCE({_QUEUE_EXPIRY}, :expires), COALESCE(:expires, {_QUEUE_EXPIRY})), :now)"
    " ON CONFLICT DO NOTHING"
)

# A row is claimable at ``now`` when it is due, its lease (if any) has run out and it has not expired.
_CLAIMABLE = "queue = ? AND not_before <= ? AND (lease_until IS NULL OR lease_until <= ?) AND (expires_at IS NULL OR expires_at > ?)"


class SQLiteQueue(BrokerState):
    """Deliveries and broker state in a :class:`~celery_workflow._sqlite.database.Database` (thread- and fork-safe)."""

    #: It honours a message's own TTL (:class:`~celery_workflow.transport.store.ExpiringStore`).
    expires_messages = True

    # -- used by SQLiteWorld inside its own write transaction ----------------------------------------------------

    def insert(self, conn: sqlite3.Connection, deliveries: Sequence[Delivery]) -> list[bool]:
        """Insert deliveries in the caller's open transaction; ``False`` for one deduplicated by its key."""
        now = self._now()
        out = []
        try:
            for d in deliveries:
                due = now if d.not_before is None else to_micros(d.not_before)
                cur = conn.execute(
                    _INSERT, (d.queue, bytes(d.payload), d.run_id, due, d.idempotency_key, due, d.queue, now)
                )
                out.append(cur.rowcount == 1)
        except sqlite3.Error as exc:
            raise WorldError(f"SQLite queue: cannot insert deliveries: {exc}") from exc
        return out

    def delete_for_run(self, conn: sqlite3.Connection, run_id: str) -> int:
        """Delete every delivery of a run (pending or claimed) in the caller's transaction; return the count."""
        try:
            return int(conn.execute(f"DELETE FROM {_Q} WHERE run_id = ?", (run_id,)).rowcount)
        except sqlite3.Error as exc:
            raise WorldError(f"SQLite queue: cannot delete deliveries of {run_id}: {exc}") from exc

    # -- the World's queue facet ---------------------------------------------------------------------------------

    def enqueue(self, deliveries: Sequence[Delivery]) -> list[bool]:
        """Store deliveries in one transaction; ``False`` for one deduplicated by its idempotency key."""
        if not deliveries:
            return []
        with self._write() as conn:
            return self.insert(conn, deliveries)

    def claim(self, queues: Sequence[str], *, limit: int = 1, lease: float = 60.0) -> list[ClaimedDelivery]:
        """Claim up to ``limit`` due rows of ``queues``, oldest due first, hidden for ``lease`` seconds."""
        return self.receive(queues, limit=limit, lease=lease)

    def ack(self, receipt: str) -> None:
        """Delete the claimed row; no-op when the receipt is stale."""
        with self._write() as conn:
            self.delete_claim(conn, receipt)

    def delete_claim(self, conn: sqlite3.Connection, receipt: str) -> None:
        """Delete the claimed row in the caller's open transaction; no-op when the receipt is stale."""
        row_id, attempts = parse_receipt(receipt)
        try:
            conn.execute(
                f"DELETE FROM {_Q} WHERE id = ? AND attempts = ? AND lease_until IS NOT NULL", (row_id, attempts)
            )
        except sqlite3.Error as exc:
            raise WorldError(f"SQLite queue: cannot ack {receipt}: {exc}") from exc

    def release(self, receipt: str) -> None:
        """Clear the lease: the row is claimable again at once, keeping its place (due time). No-op when stale."""
        row_id, attempts = parse_receipt(receipt)
        with self._write() as conn:
            conn.execute(
                f"UPDATE {_Q} SET lease_until = NULL WHERE id = ? AND attempts = ? AND lease_until IS NOT NULL",
                (row_id, attempts),
            )

    def retry_later(self, receipt: str, delay: float, *, error: str | None = None) -> None:
        """Clear the lease and make the row due ``delay`` seconds from now, recording a failed delivery (and
        ``error``, when given, as its last error). No-op when the receipt is stale."""
        row_id, attempts = parse_receipt(receipt)
        now = self._now()
        with self._write() as conn:
            conn.execute(
                f"UPDATE {_Q} SET lease_until = NULL, not_before = ?, first_failed_at = COALESCE(first_failed_at, ?),"
                " last_failed_at = ?, last_error = COALESCE(?, last_error)"
                " WHERE id = ? AND attempts = ? AND lease_until IS NOT NULL",
                (now + micros(max(delay, 0.0)), now, now, cut_error(error), row_id, attempts),
            )

    def extend(self, receipts: Sequence[str], lease: float) -> None:
        """Set the lease of each still-held claim to ``lease`` seconds from now; stale receipts are skipped."""
        if not receipts:
            return
        parsed = [parse_receipt(r) for r in receipts]
        until = self._now() + micros(lease)
        with self._write() as conn:
            conn.executemany(
                f"UPDATE {_Q} SET lease_until = ? WHERE id = ? AND attempts = ? AND lease_until IS NOT NULL",
                [(until, row_id, attempts) for row_id, attempts in parsed],
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
        """Insert one message (due at ``not_before``, epoch seconds, or now); ``False`` when deduplicated. ``ttl``:
        it expires that many seconds from now (see :class:`~celery_workflow.transport.store.ExpiringStore`)."""
        now = self._now()
        due = now if not_before is None else micros(not_before)
        with self._write() as conn:
            if ttl is None:
                cur = conn.execute(_INSERT, (queue, payload, run_id, due, idempotency_key, due, queue, now))
            else:
                cur = conn.execute(
                    _INSERT_EXPIRING,
                    {
                        "queue": queue, "payload": payload, "run_id": run_id, "due": due, "key": idempotency_key,
                        "expires": now + micros(max(ttl, 0.0)), "now": now,
                    },
                )  # fmt: skip
            return cur.rowcount == 1

    def put_fanout(
        self, exchange: str, payload: bytes, *, not_before: float | None = None, ttl: float | None = None
    ) -> int:
        """Insert a copy of the message on every queue bound to ``exchange``; return the number of copies. ``ttl``:
        as for :meth:`put`."""
        now = self._now()
        due = now if not_before is None else micros(not_before)
        expires = None if ttl is None else now + micros(max(ttl, 0.0))
        with self._write() as conn:
            cur = conn.execute(
                f"INSERT INTO {_Q} (queue, payload, not_before, expires_at, created_at)"
                " SELECT b.queue, :payload, :due, MIN(COALESCE(:due + d.message_ttl_ms * 1000, :expires),"
                " COALESCE(:expires, :due + d.message_ttl_ms * 1000)), :now"
                f" FROM (SELECT DISTINCT queue FROM {_BINDINGS} WHERE exchange = :exchange) AS b"
                f" LEFT JOIN {_QUEUES} AS d ON d.name = b.queue",
                {"payload": payload, "due": due, "expires": expires, "now": now, "exchange": exchange},
            )
            return int(cur.rowcount)

    def _candidates(
        self, conn: sqlite3.Connection, queues: Sequence[str], now: int, limit: int
    ) -> list[tuple[int, int]]:
        found: list[tuple[int, int]] = []
        for queue in dict.fromkeys(queues):
            found.extend(
                conn.execute(
                    f"SELECT not_before, id FROM {_Q} WHERE {_CLAIMABLE} ORDER BY not_before, id LIMIT ?",
                    (queue, now, now, now, limit),
                ).fetchall()
            )
        found.sort()
        return found[:limit]

    def receive(
        self, queues: Sequence[str], *, no_ack: Collection[str] = (), limit: int = 1, lease: float = 60.0
    ) -> list[ClaimedDelivery]:
        """Claim up to ``limit`` due rows of ``queues``, oldest due first.

        Rows of queues in ``no_ack`` are deleted in the same transaction (delete-on-receive for consumers that never
        ack); the others are leased for ``lease`` seconds. An empty queue costs one read, not a write transaction.
        """
        if not queues or limit <= 0:
            return []
        now = self._now()
        try:
            if not self._candidates(self.db.connection(), queues, now, 1):
                return []
        except sqlite3.Error as exc:
            raise WorldError(f"SQLite queue: {exc}") from exc
        with self._write() as conn:
            now = self._now()
            ids = [row_id for _, row_id in self._candidates(conn, queues, now, limit)]
            if not ids:
                return []
            rows = conn.execute(  # a lease still set has run out: the delivery it covered failed
                f"UPDATE {_Q} SET lease_until = ?, attempts = attempts + 1, idempotency_key = NULL,"
                " first_failed_at = COALESCE(first_failed_at, lease_until), last_failed_at = COALESCE(lease_until,"
                " last_failed_at), last_error = CASE WHEN lease_until IS NULL THEN last_error ELSE ? END"
                f" WHERE id IN ({marks(ids)}) RETURNING id, queue, payload, attempts, run_id, not_before",
                (now + micros(lease), LEASE_EXPIRED, *ids),
            ).fetchall()
            gone = [r[0] for r in rows if r[1] in no_ack]
            if gone:
                conn.execute(f"DELETE FROM {_Q} WHERE id IN ({marks(gone)})", gone)
        rows.sort(key=lambda r: (r[5], r[0]))
        return [claimed(r[0], r[1], r[2], r[3], r[4]) for r in rows]

    def poll(
        self, queues: Sequence[str], *, no_ack: Collection[str] = (), limit: int = 1, lease: float = 60.0
    ) -> tuple[list[ClaimedDelivery], dict[str, float]]:
        """:meth:`receive`, then :meth:`due_times` of ``queues`` (what the claim left)."""
        claims = self.receive(queues, no_ack=no_ack, limit=limit, lease=lease)
        return claims, self.due_times(queues)

    def due_times(self, queues: Sequence[str]) -> dict[str, float]:
        """For each of ``queues`` holding a row: epoch seconds at which its next row becomes claimable (due, or its
        lease runs out). Queues without rows are left out."""
        now = self._now()
        out: dict[str, float] = {}
        for queue in dict.fromkeys(queues):
            rows = self._read(
                f"SELECT not_before FROM {_Q} WHERE queue = ? AND (lease_until IS NULL OR lease_until <= ?)"
                " AND (expires_at IS NULL OR expires_at > ?) ORDER BY not_before, id LIMIT 1",
                (queue, now, now),
            )
            rows += self._read(
                f"SELECT MIN(lease_until) FROM {_Q} WHERE queue = ? AND lease_until > ? HAVING COUNT(*) > 0",
                (queue, now),
            )
            found = [int(value) for (value,) in rows if value is not None]
            if found:
                out[queue] = min(found) / 1_000_000
        return out

    def next_due(self, queues: Sequence[str]) -> float | None:
        """Epoch seconds at which the next row of ``queues`` becomes claimable (due or lease run out), or None."""
        return min(self.due_times(queues).values(), default=None)

    def peek(self, queues: Sequence[str] | None = None) -> list[QueuedMessage]:
        """Every stored message of ``queues`` (all queues when None), claimed or not, in claim order (due time, id):
        what an operator, the CLI or a test looks at instead of the table."""
        sql = (
            f"SELECT id, queue, run_id, attempts, not_before, lease_until, idempotency_key, expires_at, payload"
            f" FROM {_Q}"
        )
        names = list(dict.fromkeys(queues)) if queues is not None else None
        if names is not None:
            if not names:
                return []
            sql += f" WHERE queue IN ({marks(names)})"
        rows = self._read(sql + " ORDER BY not_before, id", names or ())
        return queued_messages(rows, lambda micros: micros / 1e6)

    def size(self, queue: str) -> int:
        """Messages waiting on ``queue``: not leased and not expired (delayed ones included)."""
        now = self._now()
        rows = self._read(
            f"SELECT COUNT(*) FROM {_Q} WHERE queue = ? AND (lease_until IS NULL OR lease_until <= ?)"
            " AND (expires_at IS NULL OR expires_at > ?)",
            (queue, now, now),
        )
        return int(rows[0][0])

    def purge(self, queue: str) -> int:
        """Delete the messages :meth:`size` counts (claimed ones stay with their holders); return the count."""
        now = self._now()
        with self._write() as conn:
            cur = conn.execute(
                f"DELETE FROM {_Q} WHERE queue = ? AND (lease_until IS NULL OR lease_until <= ?)",
                (queue, now),
            )
            return int(cur.rowcount)

    # -- dead letters (celery_workflow.dead_letters.DeadLetterStore) -------------------------------------------

    def dead_letter(self, receipt: str, *, reason: str, error: str | None = None) -> DeadLetter | None:
        """Move the claimed row to the dead letters with its history (``error`` becomes its last error when given);
        None when the receipt is stale."""
        row_id, attempts = parse_receipt(receipt)
        now = self._now()
        with self._write() as conn:
            rows = conn.execute(
                f"INSERT INTO {_DEAD} (message_id, queue, payload, run_id, attempts, reason, last_error,"
                " first_failed_at, last_failed_at, enqueued_at, dead_at, run_settled_at)"
                " SELECT id, queue, payload, run_id, attempts, ?, COALESCE(?, last_error), first_failed_at,"
                " last_failed_at, created_at, ?, CASE WHEN run_id IS NULL THEN ? END"
                f" FROM {_Q} WHERE id = ? AND attempts = ? AND lease_until IS NOT NULL RETURNING {_DEAD_COLUMNS}",
                (reason, cut_error(error), now, now, row_id, attempts),
            ).fetchall()
            if rows:
                conn.execute(f"DELETE FROM {_Q} WHERE id = ?", (row_id,))
        letters = dead_letters(rows, from_micros)
        return letters[0] if letters else None

    @staticmethod
    def _selection(ids: Sequence[int | str] | None, queue: str | None, alias: str = "") -> tuple[str, list[Any]]:
        where: list[str] = ["1 = 1"]
        params: list[Any] = []
        if ids is not None:
            where.append(f"{alias}id IN ({marks(ids)})")
            params.extend(dead_letters_.letter_id(i) for i in ids)
        if queue is not None:
            where.append(f"{alias}queue = ?")
            params.append(queue)
        return " AND ".join(where), params

    def list_dead_letters(
        self, *, queue: str | None = None, run_id: str | None = None, after: int | str = 0, limit: int = 100
    ) -> list[DeadLetter]:
        """Dead letters with ids above ``after``, oldest first (of ``queue`` / ``run_id`` when given)."""
        where, params = self._selection(None, queue)
        if run_id is not None:
            where += " AND run_id = ?"
            params.append(run_id)
        rows = self._read(
            f"SELECT {_DEAD_COLUMNS} FROM {_DEAD} WHERE {where} AND id > ? ORDER BY id LIMIT ?",
            (*params, dead_letters_.letter_id(after), max(limit, 0)),
        )
        return dead_letters(rows, from_micros)

    def get_dead_letter(self, letter_id: int | str) -> DeadLetter:
        rows = self._read(f"SELECT {_DEAD_COLUMNS} FROM {_DEAD} WHERE id = ?", (dead_letters_.letter_id(letter_id),))
        if not rows:
            raise DeadLetterNotFound(f"no dead letter {letter_id}")
        return dead_letters(rows, from_micros)[0]

    def unsettled_dead_letters(self, *, limit: int = 100) -> list[DeadLetter]:
        """Dead letters whose run has not been failed because of them yet, oldest first."""
        rows = self._read(
            f"SELECT {_DEAD_COLUMNS} FROM {_DEAD} WHERE run_settled_at IS NULL ORDER BY id LIMIT ?", (max(limit, 0),)
        )
        return dead_letters(rows, from_micros)

    def settle_dead_letters(self, ids: Sequence[int | str]) -> None:
        """Record that the runs of these dead letters have been dealt with."""
        if not ids:
            return
        with self._write() as conn:
            conn.execute(
                f"UPDATE {_DEAD} SET run_settled_at = ? WHERE id IN ({marks(ids)}) AND run_settled_at IS NULL",
                (self._now(), *ids),
            )

    def redrive_dead_letters(self, ids: Sequence[int | str] | None = None, *, queue: str | None = None) -> int:
        """Put the selected dead letters back on their queues, due now with attempts reset, and delete them."""
        if ids is not None and not ids:
            return 0
        where, params = self._selection(ids, queue)
        aliased, _ = self._selection(ids, queue, "d.")
        now = self._now()
        with self._write() as conn:
            moved = conn.execute(
                f"INSERT INTO {_Q} (queue, payload, run_id, not_before, expires_at, created_at)"
                f" SELECT d.queue, d.payload, d.run_id, ?, ? + q.message_ttl_ms * 1000, ? FROM {_DEAD} AS d"
                f" LEFT JOIN {_QUEUES} AS q ON q.name = d.queue WHERE {aliased} ORDER BY d.id",
                (now, now, now, *params),
            ).rowcount
            conn.execute(f"DELETE FROM {_DEAD} WHERE {where}", params)
        return int(moved)

    def purge_dead_letters(self, ids: Sequence[int | str] | None = None, *, queue: str | None = None) -> int:
        if ids is not None and not ids:
            return 0
        where, params = self._selection(ids, queue)
        with self._write() as conn:
            return int(conn.execute(f"DELETE FROM {_DEAD} WHERE {where}", params).rowcount)

    # -- BrokerStore: change notification ------------------------------------------------------------------------

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
