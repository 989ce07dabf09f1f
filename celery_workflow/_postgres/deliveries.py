"""The deliveries of the Postgres queue: inserts (in a caller's transaction or their own), claims, leases, acks,
retries and what the transport reads of them (a part of :class:`~celery_workflow._postgres.queue.PostgresQueue`; the
guarantees are in :mod:`celery_workflow._postgres.queue`)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from datetime import timedelta
from typing import Any

from celery_workflow._backend.broker import QueuedMessage, claimed, parse_receipt, queued_messages
from celery_workflow._postgres import queue_sql as stmt
from celery_workflow._postgres.queue_base import Conn, Statements, at
from celery_workflow._postgres.script import Script
from celery_workflow._postgres.standing import Registration
from celery_workflow.dead_letters import cut_error
from celery_workflow.ids import to_utc
from celery_workflow.world import ClaimedDelivery, Delivery

__all__ = ["Deliveries"]


def _interval(seconds: float | None) -> timedelta | None:
    return None if seconds is None else timedelta(seconds=max(seconds, 0.0))


class Deliveries:
    """The queue table's rows: what a World stores and claims, and what the transport puts, polls and looks at."""

    #: A message's own TTL is honoured (``put(…, ttl=…)``).
    expires_messages = True

    def __init__(self, sql: Statements) -> None:
        self.sql = sql

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
                self.sql.params(
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

    def enqueue(self, deliveries: Sequence[Delivery]) -> list[bool]:
        """Store deliveries in one transaction; ``False`` for one deduplicated by its idempotency key."""
        if not deliveries:
            return []

        def go(conn: Conn) -> list[bool]:
            script = Script(conn)
            whole = len(deliveries) > 1 or self.sql.db.lazy_commits
            if whole:  # a stored message is on disk, whatever the session says
                script.begin(synchronous_commit=True if self.sql.db.lazy_commits else None)
            slots = self.add_inserts(script, deliveries)
            if whole:
                script.add("COMMIT")
            results = script.send()  # one round trip for the whole transaction
            return [len(results[i].rows) == 1 for i in slots]

        return self.sql.db.run(go, what="queue: enqueue", transaction=False)

    def claim(self, queues: Sequence[str], *, limit: int = 1, lease: float = 60.0) -> list[ClaimedDelivery]:
        """Claim up to ``limit`` due rows of ``queues``, oldest due first, hidden for ``lease`` seconds."""
        return self.receive(queues, limit=limit, lease=lease)

    def ack(self, receipt: str, *, register: Registration | None = None, lease: float = 60.0) -> None:
        """Delete the claimed row; no-op when the receipt is stale. ``register``: and make that standing claim (with
        ``lease``), in the same round trip (see :mod:`.standing`)."""
        row_id, attempts = parse_receipt(receipt)
        delete = f"DELETE FROM {stmt.Q} WHERE id = %(id)s AND attempts = %(attempts)s AND lease_until IS NOT NULL"
        if register is None:
            self.sql.rowcount("ack", delete, commit_mode="lazy", id=row_id, attempts=attempts)
            return
        self.sql.rows(
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
        self.sql.rows(
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
        self.sql.rowcount(
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

    def extend(self, receipts: Sequence[str], lease: float) -> None:
        """Set the lease of each still-held claim to ``lease`` seconds from now; stale receipts are skipped."""
        if not receipts:
            return
        parsed = sorted(parse_receipt(r) for r in receipts)  # one lock order for every extender
        self.sql.rowcount(
            "extend leases",
            f"UPDATE {stmt.Q} AS q SET lease_until = {stmt.NOW} + %(lease)s"
            " FROM unnest(%(ids)s::bigint[], %(attempts)s::integer[]) AS r(id, attempts)"
            " WHERE q.id = r.id AND q.attempts = r.attempts AND q.lease_until IS NOT NULL",
            commit_mode="lazy",
            ids=[p[0] for p in parsed],
            attempts=[p[1] for p in parsed],
            lease=timedelta(seconds=lease),
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
        """Insert one message (due at ``not_before``, epoch seconds, or now) and notify; ``False`` when deduplicated.
        ``ttl``: it expires that many seconds from now (see :class:`~celery_workflow.transport.store.ExpiringStore`).

        A message due now without an idempotency key is handed to an idle consumer's standing claim when there is
        one (:mod:`.standing`)."""
        payload = bytes(payload)
        rows = self.sql.rows(
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
            self.sql.rows(
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
        rows = self.sql.rows(
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
        rows = self.sql.rows("claim", sql, commit_mode="lazy", before=before, **claim)
        now = self.sql.local_now()
        taken = sorted((r for r in rows if r[0] is not None), key=lambda r: (r[5], r[0]))  # oldest due first
        claims = [claimed(r[0], r[1], r[2], r[3], r[4]) for r in taken]
        return claims, {str(r[1]): now + float(r[6]) for r in rows if r[0] is None}

    def due_times(self, queues: Sequence[str]) -> dict[str, float]:
        """For each of ``queues`` holding a row: epoch seconds (this process's clock) at which its next row becomes
        claimable (due, or its lease runs out). Queues without rows are left out."""
        if not queues:
            return {}
        rows = self.sql.rows("due times", stmt.DUE_TIMES, queues=list(dict.fromkeys(queues)))
        now = self.sql.local_now()
        return {str(name): now + float(seconds) for name, seconds in rows}

    def next_due(self, queues: Sequence[str]) -> float | None:
        """Epoch seconds (this process's clock) at which the next row of ``queues`` becomes claimable, or None."""
        return min(self.due_times(queues).values(), default=None)

    def peek(self, queues: Sequence[str] | None = None) -> list[QueuedMessage]:
        """Every stored message of ``queues`` (all queues when None), claimed or not, in claim order (due time, id):
        what an operator, the CLI or a test looks at instead of the table. Times are the database server's."""
        if queues is not None and not queues:
            return []
        rows = self.sql.rows(
            "peek",
            "SELECT id, queue, run_id, attempts, not_before, lease_until, idempotency_key, expires_at,"
            f" payload FROM {stmt.Q}"
            " WHERE %(queues)s::text[] IS NULL OR queue = ANY(%(queues)s::text[]) ORDER BY not_before, id",
            queues=None if queues is None else list(dict.fromkeys(queues)),
        )
        return queued_messages(rows, lambda moment: float(moment.timestamp()))

    def delayed(self, queues: Sequence[str], *, limit: int = 1000) -> list[QueuedMessage]:
        """The messages of ``queues`` held for later: not yet due, not claimed and not expired, soonest due first (at
        most ``limit``). What a worker would hold in its ETA timer on a broker that delivers at once (Celery's
        ``inspect scheduled``); here the store holds them. Times are the database server's."""
        if not queues or limit <= 0:
            return []
        rows = self.sql.rows(
            "delayed",
            "SELECT id, queue, run_id, attempts, not_before, lease_until, idempotency_key, expires_at,"
            f" payload FROM {stmt.Q} WHERE queue = ANY(%(queues)s::text[]) AND not_before > {stmt.NOW}"
            f" AND (lease_until IS NULL OR lease_until <= {stmt.NOW}) AND (expires_at IS NULL OR expires_at > {stmt.NOW})"
            " ORDER BY not_before, id LIMIT %(limit)s",
            queues=list(dict.fromkeys(queues)),
            limit=limit,
        )
        return queued_messages(rows, lambda moment: float(moment.timestamp()))

    def size(self, queue: str) -> int:
        """Messages waiting on ``queue``: not leased and not expired (delayed ones included)."""
        rows = self.sql.rows(
            "size",
            f"SELECT count(*) FROM {stmt.Q} WHERE queue = %(queue)s AND (lease_until IS NULL OR lease_until <= {stmt.NOW})"
            f" AND (expires_at IS NULL OR expires_at > {stmt.NOW})",
            queue=queue,
        )
        return int(rows[0][0])

    def purge(self, queue: str) -> int:
        """Delete the messages :meth:`size` counts (claimed ones stay with their holders); return the count."""
        return self.sql.rowcount(
            "purge",
            f"DELETE FROM {stmt.Q} WHERE queue = %(queue)s AND (lease_until IS NULL OR lease_until <= {stmt.NOW})",
            queue=queue,
        )
