"""The deliveries of the SQLite queue: inserts (in a caller's transaction or their own), claims, leases, acks,
retries and what the transport reads of them (a part of :class:`~celery_workflow._sqlite.queue.SQLiteQueue`; the
guarantees are in :mod:`celery_workflow._sqlite.queue`)."""

from __future__ import annotations

import sqlite3
from collections.abc import Collection, Sequence

from celery_workflow._backend.broker import (
    BROKER_BINDINGS,
    BROKER_QUEUES,
    DEAD_LETTER_COLUMNS,
    DEAD_LETTERS,
    QUEUE,
    QueuedMessage,
    claimed,
    parse_receipt,
    queued_messages,
)
from celery_workflow._sqlite.queue_base import Transactions, marks, micros
from celery_workflow.dead_letters import LEASE_EXPIRED, cut_error
from celery_workflow.errors import WorldError
from celery_workflow.ids import to_micros
from celery_workflow.world import ClaimedDelivery, Delivery

__all__ = ["Deliveries"]

_Q = QUEUE
_QUEUES = BROKER_QUEUES
_BINDINGS = BROKER_BINDINGS
_DEAD = DEAD_LETTERS
_DEAD_COLUMNS = ", ".join(DEAD_LETTER_COLUMNS.split())

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


class Deliveries:
    """The queue table's rows: what a World stores and claims, and what the transport puts, polls and looks at."""

    #: A message's own TTL is honoured (``put(…, ttl=…)``).
    expires_messages = True

    def __init__(self, tx: Transactions) -> None:
        self.tx = tx

    def insert(self, conn: sqlite3.Connection, deliveries: Sequence[Delivery]) -> list[bool]:
        """Insert deliveries in the caller's open transaction; ``False`` for one deduplicated by its key."""
        now = self.tx.now()
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

    def enqueue(self, deliveries: Sequence[Delivery]) -> list[bool]:
        """Store deliveries in one transaction; ``False`` for one deduplicated by its idempotency key."""
        if not deliveries:
            return []
        with self.tx.write() as conn:
            return self.insert(conn, deliveries)

    def claim(self, queues: Sequence[str], *, limit: int = 1, lease: float = 60.0) -> list[ClaimedDelivery]:
        """Claim up to ``limit`` due rows of ``queues``, oldest due first, hidden for ``lease`` seconds."""
        return self.receive(queues, limit=limit, lease=lease)

    def ack(self, receipt: str) -> None:
        """Delete the claimed row; no-op when the receipt is stale."""
        with self.tx.write() as conn:
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
        with self.tx.write() as conn:
            conn.execute(
                f"UPDATE {_Q} SET lease_until = NULL WHERE id = ? AND attempts = ? AND lease_until IS NOT NULL",
                (row_id, attempts),
            )

    def retry_later(self, receipt: str, delay: float, *, error: str | None = None) -> None:
        """Clear the lease and make the row due ``delay`` seconds from now, recording a failed delivery (and
        ``error``, when given, as its last error). No-op when the receipt is stale."""
        row_id, attempts = parse_receipt(receipt)
        now = self.tx.now()
        with self.tx.write() as conn:
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
        until = self.tx.now() + micros(lease)
        with self.tx.write() as conn:
            conn.executemany(
                f"UPDATE {_Q} SET lease_until = ? WHERE id = ? AND attempts = ? AND lease_until IS NOT NULL",
                [(until, row_id, attempts) for row_id, attempts in parsed],
            )

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
        now = self.tx.now()
        due = now if not_before is None else micros(not_before)
        with self.tx.write() as conn:
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
        now = self.tx.now()
        due = now if not_before is None else micros(not_before)
        expires = None if ttl is None else now + micros(max(ttl, 0.0))
        with self.tx.write() as conn:
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
        now = self.tx.now()
        try:
            if not self._candidates(self.tx.db.connection(), queues, now, 1):
                return []
        except sqlite3.Error as exc:
            raise WorldError(f"SQLite queue: {exc}") from exc
        with self.tx.write() as conn:
            now = self.tx.now()
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
        now = self.tx.now()
        out: dict[str, float] = {}
        for queue in dict.fromkeys(queues):
            rows = self.tx.read(
                f"SELECT not_before FROM {_Q} WHERE queue = ? AND (lease_until IS NULL OR lease_until <= ?)"
                " AND (expires_at IS NULL OR expires_at > ?) ORDER BY not_before, id LIMIT 1",
                (queue, now, now),
            )
            rows += self.tx.read(
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
        rows = self.tx.read(sql + " ORDER BY not_before, id", names or ())
        return queued_messages(rows, lambda micros: micros / 1e6)

    def delayed(self, queues: Sequence[str], *, limit: int = 1000) -> list[QueuedMessage]:
        """The messages of ``queues`` held for later: not yet due, not claimed and not expired, soonest due first (at
        most ``limit``). What a worker would hold in its ETA timer on a broker that delivers at once (Celery's
        ``inspect scheduled``); here the store holds them."""
        names = list(dict.fromkeys(queues))
        if not names or limit <= 0:
            return []
        now = self.tx.now()
        rows = self.tx.read(
            f"SELECT id, queue, run_id, attempts, not_before, lease_until, idempotency_key, expires_at, payload"
            f" FROM {_Q} WHERE queue IN ({marks(names)}) AND not_before > ?"
            " AND (lease_until IS NULL OR lease_until <= ?) AND (expires_at IS NULL OR expires_at > ?)"
            " ORDER BY not_before, id LIMIT ?",
            (*names, now, now, now, limit),
        )
        return queued_messages(rows, lambda micros: micros / 1e6)

    def size(self, queue: str) -> int:
        """Messages waiting on ``queue``: not leased and not expired (delayed ones included)."""
        now = self.tx.now()
        rows = self.tx.read(
            f"SELECT COUNT(*) FROM {_Q} WHERE queue = ? AND (lease_until IS NULL OR lease_until <= ?)"
            " AND (expires_at IS NULL OR expires_at > ?)",
            (queue, now, now),
        )
        return int(rows[0][0])

    def purge(self, queue: str) -> int:
        """Delete the messages :meth:`size` counts (claimed ones stay with their holders); return the count."""
        now = self.tx.now()
        with self.tx.write() as conn:
            cur = conn.execute(
                f"DELETE FROM {_Q} WHERE queue = ? AND (lease_until IS NULL OR lease_until <= ?)",
                (queue, now),
            )
            return int(cur.rowcount)
