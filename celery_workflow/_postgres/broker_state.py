"""Broker state of the Postgres Kombu transport, beside the queue table's messages: queue declarations (AMQP-style
arguments: ``x-expires``, ``x-message-ttl``, auto-delete), exchanges and their bindings, the consumers alive on each
queue, and the collection of what nobody uses any more. It lives in the World's schema, shared by every process, so
any worker or producer sees the same declarations (the tables are in migration ``0002_queue.sql``)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from celery_workflow._backend.broker import Binding, queue_declaration
from celery_workflow._postgres import queue_sql as stmt
from celery_workflow._postgres.queue_base import Conn, Statements, seconds, total
from celery_workflow._postgres.script import query

#: Class id of the advisory lock taken by :meth:`PostgresQueue.gc` (the object id is a hash of the schema).
GC_LOCK = 0x63776763  # "cwgc"


class BrokerState:
    """Queues, exchanges, bindings, consumers and their collection (a part of
    :class:`~celery_workflow._postgres.queue.PostgresQueue`)."""

    def __init__(self, sql: Statements) -> None:
        self.sql = sql

    def declare_queue(
        self,
        name: str,
        *,
        durable: bool = True,
        exclusive: bool = False,
        auto_delete: bool = False,
        expires: float | None = None,
        message_ttl: float | None = None,
    ) -> None:
        """Create or update a queue declaration (``expires``/``message_ttl`` in seconds) and mark it used now."""
        self.sql.rowcount(
            "declare queue",
            f"INSERT INTO {stmt.QUEUES} (name, durable, exclusive, auto_delete, expires, message_ttl, last_used, created_at)"
            f" VALUES (%(name)s, %(durable)s, %(exclusive)s, %(auto_delete)s, %(expires)s, %(ttl)s, {stmt.NOW}, {stmt.NOW})"
            " ON CONFLICT (name) DO UPDATE SET durable = excluded.durable, exclusive = excluded.exclusive,"
            " auto_delete = excluded.auto_delete, expires = excluded.expires, message_ttl = excluded.message_ttl,"
            " last_used = excluded.last_used",
            name=name,
            durable=durable,
            exclusive=exclusive,
            auto_delete=auto_delete,
            expires=seconds(expires),
            ttl=seconds(message_ttl),
        )

    def has_queue(self, name: str) -> bool:
        """True when the queue is declared or holds messages."""
        rows = self.sql.rows(
            "has queue",
            f"SELECT EXISTS (SELECT 1 FROM {stmt.QUEUES} WHERE name = %(name)s)"
            f" OR EXISTS (SELECT 1 FROM {stmt.Q} WHERE queue = %(name)s)",
            name=name,
        )
        return bool(rows[0][0])

    def queue_info(self, name: str) -> dict[str, Any] | None:
        """The stored declaration of a queue, or None."""
        rows = self.sql.rows(
            "queue info",
            f"SELECT durable, exclusive, auto_delete, expires, message_ttl, last_used FROM {stmt.QUEUES}"
            " WHERE name = %(name)s",
            name=name,
        )
        if not rows:
            return None
        durable, exclusive, auto_delete, expires, ttl, last_used = rows[0]
        return queue_declaration((durable, exclusive, auto_delete), total(expires), total(ttl), last_used.timestamp())

    def delete_queue(self, name: str) -> int:
        """Delete a queue: its declaration, bindings, consumers and every message; return the messages deleted."""
        # one statement as a script: one round trip, READ COMMITTED on any session (see script.ISOLATION)
        row = self.sql.db.run(
            lambda conn: query(conn, stmt.DROP_QUEUES, {"names": [name]}).one(),
            what="queue: delete queue",
            transaction=False,
        )
        return int(row[0]) if row else 0

    @staticmethod
    def _drop_queues(conn: Conn, names: Sequence[str]) -> int:
        if not names:
            return 0
        row = conn.execute(stmt.DROP_QUEUES, {"names": list(dict.fromkeys(names))}).fetchone()
        return int(row[0]) if row else 0

    def declare_exchange(
        self,
        name: str,
        type: str,
        *,
        durable: bool = True,
        auto_delete: bool = False,
        arguments: Mapping[str, Any] | None = None,
    ) -> None:
        """Create or update an exchange (its type is what routing in other processes will use)."""
        self.sql.rowcount(
            "declare exchange",
            f"INSERT INTO {stmt.EXCHANGES} (name, type, durable, auto_delete, arguments, created_at)"
            f" VALUES (%(name)s, %(type)s, %(durable)s, %(auto_delete)s, %(arguments)s::jsonb, {stmt.NOW})"
            " ON CONFLICT (name) DO UPDATE SET type = excluded.type, durable = excluded.durable,"
            " auto_delete = excluded.auto_delete, arguments = excluded.arguments",
            name=name,
            type=type,
            durable=durable,
            auto_delete=auto_delete,
            arguments=json.dumps(dict(arguments or {}), sort_keys=True, default=str),
        )

    def exchange_type(self, name: str) -> str | None:
        rows = self.sql.rows("exchange type", f"SELECT type FROM {stmt.EXCHANGES} WHERE name = %(name)s", name=name)
        return str(rows[0][0]) if rows else None

    def queues(self) -> list[str]:
        """The names of the declared queues."""
        return [str(r[0]) for r in self.sql.rows("queues", f"SELECT name FROM {stmt.QUEUES} ORDER BY name")]

    def consumers(self) -> dict[str, int]:
        """How many live consumers (heartbeats not yet collected) each consumed queue has."""
        rows = self.sql.rows("consumers", f"SELECT queue, count(*) FROM {stmt.CONSUMERS} GROUP BY queue")
        return {str(q): int(n) for q, n in rows}

    def exchanges(self) -> list[str]:
        return [str(r[0]) for r in self.sql.rows("exchanges", f"SELECT name FROM {stmt.EXCHANGES} ORDER BY name")]

    def delete_exchange(self, name: str) -> None:
        """Delete an exchange and its bindings (queues stay, as in AMQP)."""
        self.sql.rowcount(
            "delete exchange",
            f"WITH b AS (DELETE FROM {stmt.BINDINGS} WHERE exchange = %(name)s)"
            f" DELETE FROM {stmt.EXCHANGES} WHERE name = %(name)s",
            name=name,
        )

    def bind(self, exchange: str, routing_key: str, pattern: str | None, queue: str) -> None:
        self.sql.rowcount(
            "bind",
            f"INSERT INTO {stmt.BINDINGS} (exchange, routing_key, queue, pattern, created_at)"
            f" VALUES (%(exchange)s, %(key)s, %(queue)s, %(pattern)s, {stmt.NOW})"
            " ON CONFLICT (exchange, routing_key, queue) DO UPDATE SET pattern = excluded.pattern",
            exchange=exchange,
            key=routing_key or "",
            queue=queue,
            pattern=pattern,
        )

    def unbind(self, exchange: str, routing_key: str, queue: str) -> None:
        self.sql.rowcount(
            "unbind",
            f"DELETE FROM {stmt.BINDINGS} WHERE exchange = %(exchange)s AND routing_key = %(key)s AND queue = %(queue)s",
            exchange=exchange,
            key=routing_key or "",
            queue=queue,
        )

    def bindings(self, exchange: str | None = None) -> list[Binding]:
        """Bindings of one exchange, or all of them (in creation order)."""
        sql = f"SELECT exchange, routing_key, pattern, queue FROM {stmt.BINDINGS}"
        if exchange is not None:
            sql += " WHERE exchange = %(exchange)s"
        rows = self.sql.rows("bindings", sql + " ORDER BY created_at, exchange, routing_key, queue", exchange=exchange)
        return [Binding(str(e), str(k), None if p is None else str(p), str(q)) for e, k, p, q in rows]

    def touch(self, consumer: str, queues: Sequence[str]) -> list[str]:
        """Record that ``consumer`` is alive on ``queues`` and mark them used; return those not declared."""
        if not queues:
            return []
        names = list(dict.fromkeys(queues))
        rows = self.sql.rows(
            "touch",
            f"WITH c AS (INSERT INTO {stmt.CONSUMERS} (queue, consumer, seen_at)"
            f" SELECT u.name, %(consumer)s, {stmt.NOW} FROM unnest(%(names)s::text[]) AS u(name)"
            " ON CONFLICT (queue, consumer) DO UPDATE SET seen_at = excluded.seen_at)"
            f" UPDATE {stmt.QUEUES} SET last_used = {stmt.NOW} WHERE name = ANY(%(names)s::text[]) RETURNING name",
            commit_mode="lazy",
            consumer=consumer,
            names=sorted(names),
        )
        known = {str(r[0]) for r in rows}
        return [q for q in names if q not in known]

    def drop_consumer(self, consumer: str, queues: Sequence[str]) -> list[str]:
        """Forget ``consumer`` on ``queues``; delete the auto_delete ones left without consumers (returned)."""
        if not queues:
            return []
        names = sorted(dict.fromkeys(queues))

        def go(conn: Conn) -> list[str]:
            conn.execute(
                f"DELETE FROM {stmt.CONSUMERS} WHERE consumer = %(consumer)s AND queue = ANY(%(names)s::text[])",
                {"consumer": consumer, "names": names},
            )
            doomed = [str(r[0]) for r in conn.execute(stmt.ORPHANED_AUTO_DELETE, {"names": names}).fetchall()]
            self._drop_queues(conn, doomed)
            return doomed

        return self.sql.db.run(go, what="queue: drop consumer")

    def hold_lease(self, name: str, holder: str, seconds: float) -> bool:
        """A named lease is a consumer row of the pseudo-queue ``name``: held by the one row whose heartbeat is younger
        than ``seconds``; a transaction-level advisory lock on the name serialises the holders."""
        rows = self.sql.rows(
            "hold lease",
            f"WITH other AS (SELECT 1 FROM {stmt.CONSUMERS} WHERE queue = %(name)s AND consumer <> %(holder)s"
            f" AND seen_at > {stmt.NOW} - %(lease)s LIMIT 1),"
            f" gone AS (DELETE FROM {stmt.CONSUMERS} WHERE queue = %(name)s AND consumer <> %(holder)s"
            f" AND seen_at <= {stmt.NOW} - %(lease)s),"
            f" held AS (INSERT INTO {stmt.CONSUMERS} (queue, consumer, seen_at)"
            f" SELECT %(name)s, %(holder)s, {stmt.NOW} WHERE NOT EXISTS (SELECT 1 FROM other)"
            " ON CONFLICT (queue, consumer) DO UPDATE SET seen_at = excluded.seen_at RETURNING 1)"
            " SELECT COUNT(*) FROM held",
            before=("SELECT pg_advisory_xact_lock(hashtext('celery_workflow_lease:' || %(name)s))",),
            name=name,
            holder=holder,
            lease=timedelta(seconds=seconds),
        )
        return bool(rows and rows[0][0])

    def drop_lease(self, name: str, holder: str) -> None:
        self.sql.rowcount(
            "drop lease",
            f"DELETE FROM {stmt.CONSUMERS} WHERE queue = %(name)s AND consumer = %(holder)s",
            name=name,
            holder=holder,
        )

    def gc(self, *, consumer_timeout: float = 60.0) -> dict[str, int]:
        """Collect what nobody uses any more, in one transaction (skipped while another process collects).

        * queues declared with ``x-expires`` and unused (no declaration, no consumer heartbeat) for that long;
        * consumers silent for ``consumer_timeout`` seconds (dead processes) and the auto_delete queues they leave
          without consumers;
        * messages past their TTL that nobody holds.

        A collected queue goes with its bindings and messages. Returns counts by kind.
        """
        params = self.sql.params(timeout=timedelta(seconds=consumer_timeout))

        def go(conn: Conn) -> dict[str, int]:
            locked = conn.execute(
                "SELECT pg_try_advisory_xact_lock(%s, hashtext(current_schema()))", (GC_LOCK,)
            ).fetchone()
            if not (locked and locked[0]):
                return {"queues": 0, "consumers": 0, "messages": 0}
            unused = f"SELECT name FROM {stmt.QUEUES} WHERE expires IS NOT NULL AND last_used + expires <= {stmt.NOW}"
            expired = [str(r[0]) for r in conn.execute(unused, params).fetchall()]
            stale = conn.execute(
                f"DELETE FROM {stmt.CONSUMERS} WHERE seen_at <= {stmt.NOW} - %(timeout)s RETURNING queue", params
            ).fetchall()
            stale_queues = sorted({str(r[0]) for r in stale})
            orphaned = [str(r[0]) for r in conn.execute(stmt.ORPHANED_AUTO_DELETE, {"names": stale_queues}).fetchall()]
            queues = list(dict.fromkeys(expired + orphaned))
            dropped = self._drop_queues(conn, queues)
            ttl = conn.execute(
                f"DELETE FROM {stmt.Q} WHERE expires_at IS NOT NULL AND expires_at <= {stmt.NOW}"
                f" AND (lease_until IS NULL OR lease_until <= {stmt.NOW})",
                params,
            ).rowcount
            conn.execute(stmt.DEAD_STANDING)  # standing claims of processes that are gone
            return {"queues": len(queues), "consumers": len(stale), "messages": dropped + int(ttl)}

        return self.sql.db.run(go, what="queue: collect garbage")
