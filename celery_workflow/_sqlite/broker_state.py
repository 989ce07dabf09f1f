"""Broker state of the SQLite Kombu transport, beside the queue table's messages: queue declarations (AMQP-style
arguments: ``x-expires``, ``x-message-ttl``, auto-delete), exchanges and their bindings, the consumers alive on each
queue, and the collection of what nobody uses any more, in the World's database file, shared by every process that
opens it."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping, Sequence
from typing import Any

from celery_workflow._backend.broker import (
    BROKER_BINDINGS,
    BROKER_CONSUMERS,
    BROKER_EXCHANGES,
    BROKER_QUEUES,
    QUEUE,
    Binding,
    queue_declaration,
)
from celery_workflow._sqlite.queue_base import Transactions, marks, micros

_Q = QUEUE
_QUEUES = BROKER_QUEUES
_EXCHANGES = BROKER_EXCHANGES
_BINDINGS = BROKER_BINDINGS
_CONSUMERS = BROKER_CONSUMERS


class BrokerState:
    """Queues, exchanges, bindings, consumers and their collection (a part of
    :class:`~celery_workflow._sqlite.queue.SQLiteQueue`)."""

    def __init__(self, tx: Transactions) -> None:
        self.tx = tx

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
        now = self.tx.now()
        with self.tx.write() as conn:
            conn.execute(
                f"INSERT INTO {_QUEUES} (name, durable, exclusive, auto_delete, expires_ms, message_ttl_ms,"
                " last_used, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (name) DO UPDATE SET durable = excluded.durable, exclusive = excluded.exclusive,"
                " auto_delete = excluded.auto_delete, expires_ms = excluded.expires_ms,"
                " message_ttl_ms = excluded.message_ttl_ms, last_used = excluded.last_used",
                (
                    name,
                    int(durable),
                    int(exclusive),
                    int(auto_delete),
                    None if expires is None else int(expires * 1000),
                    None if message_ttl is None else int(message_ttl * 1000),
                    now,
                    now,
                ),
            )

    def has_queue(self, name: str) -> bool:
        """True when the queue is declared or holds messages."""
        rows = self.tx.read(
            f"SELECT EXISTS (SELECT 1 FROM {_QUEUES} WHERE name = ?) OR EXISTS (SELECT 1 FROM {_Q} WHERE queue = ?)",
            (name, name),
        )
        return bool(rows[0][0])

    def queue_info(self, name: str) -> dict[str, Any] | None:
        """The stored declaration of a queue, or None."""
        rows = self.tx.read(
            f"SELECT durable, exclusive, auto_delete, expires_ms, message_ttl_ms, last_used FROM {_QUEUES}"
            " WHERE name = ?",
            (name,),
        )
        if not rows:
            return None
        durable, exclusive, auto_delete, expires_ms, ttl_ms, last_used = rows[0]
        return queue_declaration(
            (durable, exclusive, auto_delete),
            None if expires_ms is None else expires_ms / 1000,
            None if ttl_ms is None else ttl_ms / 1000,
            last_used / 1_000_000,
        )

    def delete_queue(self, name: str) -> int:
        """Delete a queue: its declaration, bindings, consumers and every message; return the messages deleted."""
        with self.tx.write() as conn:
            return self._drop_queues(conn, [name])

    @staticmethod
    def _drop_queues(conn: sqlite3.Connection, names: Sequence[str]) -> int:
        deleted = 0
        for name in dict.fromkeys(names):
            deleted += conn.execute(f"DELETE FROM {_Q} WHERE queue = ?", (name,)).rowcount
            conn.execute(f"DELETE FROM {_BINDINGS} WHERE queue = ?", (name,))
            conn.execute(f"DELETE FROM {_CONSUMERS} WHERE queue = ?", (name,))
            conn.execute(f"DELETE FROM {_QUEUES} WHERE name = ?", (name,))
        return deleted

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
        args = json.dumps(dict(arguments or {}), sort_keys=True, default=str)
        with self.tx.write() as conn:
            conn.execute(
                f"INSERT INTO {_EXCHANGES} (name, type, durable, auto_delete, arguments, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (name) DO UPDATE SET type = excluded.type,"
                " durable = excluded.durable, auto_delete = excluded.auto_delete, arguments = excluded.arguments",
                (name, type, int(durable), int(auto_delete), args, self.tx.now()),
            )

    def exchange_type(self, name: str) -> str | None:
        rows = self.tx.read(f"SELECT type FROM {_EXCHANGES} WHERE name = ?", (name,))
        return str(rows[0][0]) if rows else None

    def queues(self) -> list[str]:
        """The names of the declared queues."""
        return [str(r[0]) for r in self.tx.read(f"SELECT name FROM {_QUEUES} ORDER BY name")]

    def consumers(self) -> dict[str, int]:
        """How many live consumers (heartbeats not yet collected) each consumed queue has."""
        return {str(q): int(n) for q, n in self.tx.read(f"SELECT queue, COUNT(*) FROM {_CONSUMERS} GROUP BY queue")}

    def exchanges(self) -> list[str]:
        return [str(r[0]) for r in self.tx.read(f"SELECT name FROM {_EXCHANGES} ORDER BY name")]

    def delete_exchange(self, name: str) -> None:
        """Delete an exchange and its bindings (queues stay, as in AMQP)."""
        with self.tx.write() as conn:
            conn.execute(f"DELETE FROM {_BINDINGS} WHERE exchange = ?", (name,))
            conn.execute(f"DELETE FROM {_EXCHANGES} WHERE name = ?", (name,))

    def bind(self, exchange: str, routing_key: str, pattern: str | None, queue: str) -> None:
        with self.tx.write() as conn:
            conn.execute(
                f"INSERT INTO {_BINDINGS} (exchange, routing_key, queue, pattern, created_at) VALUES (?, ?, ?, ?, ?)"
                " ON CONFLICT (exchange, routing_key, queue) DO UPDATE SET pattern = excluded.pattern",
                (exchange, routing_key or "", queue, pattern, self.tx.now()),
            )

    def unbind(self, exchange: str, routing_key: str, queue: str) -> None:
        with self.tx.write() as conn:
            conn.execute(
                f"DELETE FROM {_BINDINGS} WHERE exchange = ? AND routing_key = ? AND queue = ?",
                (exchange, routing_key or "", queue),
            )

    def bindings(self, exchange: str | None = None) -> list[Binding]:
        """Bindings of one exchange, or all of them."""
        sql = f"SELECT exchange, routing_key, pattern, queue FROM {_BINDINGS}"
        rows = self.tx.read(sql + " WHERE exchange = ?", (exchange,)) if exchange is not None else self.tx.read(sql)
        return [Binding(str(e), str(k), None if p is None else str(p), str(q)) for e, k, p, q in rows]

    def touch(self, consumer: str, queues: Sequence[str]) -> list[str]:
        """Record that ``consumer`` is alive on ``queues`` and mark them used; return those not declared."""
        if not queues:
            return []
        names = list(dict.fromkeys(queues))
        now = self.tx.now()
        with self.tx.write() as conn:
            conn.executemany(
                f"INSERT INTO {_CONSUMERS} (queue, consumer, seen_at) VALUES (?, ?, ?)"
                " ON CONFLICT (queue, consumer) DO UPDATE SET seen_at = excluded.seen_at",
                [(q, consumer, now) for q in names],
            )
            conn.execute(f"UPDATE {_QUEUES} SET last_used = ? WHERE name IN ({marks(names)})", (now, *names))
            known = {r[0] for r in conn.execute(f"SELECT name FROM {_QUEUES} WHERE name IN ({marks(names)})", names)}
        return [q for q in names if q not in known]

    def drop_consumer(self, consumer: str, queues: Sequence[str]) -> list[str]:
        """Forget ``consumer`` on ``queues``; delete the auto_delete ones left without consumers (returned)."""
        if not queues:
            return []
        names = list(dict.fromkeys(queues))
        with self.tx.write() as conn:
            conn.executemany(
                f"DELETE FROM {_CONSUMERS} WHERE queue = ? AND consumer = ?", [(q, consumer) for q in names]
            )
            doomed = self._orphaned_auto_delete(conn, names)
            self._drop_queues(conn, doomed)
        return doomed

    @staticmethod
    def _orphaned_auto_delete(conn: sqlite3.Connection, names: Sequence[str]) -> list[str]:
        if not names:
            return []
        rows = conn.execute(
            f"SELECT name FROM {_QUEUES} AS d WHERE name IN ({marks(names)}) AND auto_delete = 1"
            f" AND NOT EXISTS (SELECT 1 FROM {_CONSUMERS} AS c WHERE c.queue = d.name)",
            list(names),
        ).fetchall()
        return [str(r[0]) for r in rows]

    def hold_lease(self, name: str, holder: str, seconds: float) -> bool:
        """A named lease is a consumer row of the pseudo-queue ``name``: held by the one row whose heartbeat is younger
        than ``seconds`` (``BEGIN IMMEDIATE`` serialises the holders)."""
        now = self.tx.now()
        with self.tx.write() as conn:
            conn.execute(
                f"DELETE FROM {_CONSUMERS} WHERE queue = ? AND consumer <> ? AND seen_at <= ?",
                (name, holder, now - micros(seconds)),
            )
            other = conn.execute(
                f"SELECT 1 FROM {_CONSUMERS} WHERE queue = ? AND consumer <> ? LIMIT 1", (name, holder)
            ).fetchone()
            if other is not None:
                return False
            conn.execute(
                f"INSERT INTO {_CONSUMERS} (queue, consumer, seen_at) VALUES (?, ?, ?)"
                " ON CONFLICT (queue, consumer) DO UPDATE SET seen_at = excluded.seen_at",
                (name, holder, now),
            )
        return True

    def drop_lease(self, name: str, holder: str) -> None:
        with self.tx.write() as conn:
            conn.execute(f"DELETE FROM {_CONSUMERS} WHERE queue = ? AND consumer = ?", (name, holder))

    def gc(self, *, consumer_timeout: float = 60.0) -> dict[str, int]:
        """Collect what nobody uses any more, in one transaction.

        * queues declared with ``x-expires`` and unused (no declaration, no consumer heartbeat) for that long;
        * consumers silent for ``consumer_timeout`` seconds (dead processes) and the auto_delete queues they leave
          without consumers;
        * messages past their TTL that nobody holds.

        A collected queue goes with its bindings and messages. Returns counts by kind.
        """
        now = self.tx.now()
        with self.tx.write() as conn:
            expired = [
                str(r[0])
                for r in conn.execute(
                    f"SELECT name FROM {_QUEUES} WHERE expires_ms IS NOT NULL AND last_used + expires_ms * 1000 <= ?",
                    (now,),
                )
            ]
            stale = conn.execute(
                f"DELETE FROM {_CONSUMERS} WHERE seen_at <= ? RETURNING queue", (now - micros(consumer_timeout),)
            ).fetchall()
            orphaned = self._orphaned_auto_delete(conn, list(dict.fromkeys(str(r[0]) for r in stale)))
            queues = list(dict.fromkeys(expired + orphaned))
            dropped = self._drop_queues(conn, queues)
            ttl = conn.execute(
                f"DELETE FROM {_Q} WHERE expires_at IS NOT NULL AND expires_at <= ?"
                " AND (lease_until IS NULL OR lease_until <= ?)",
                (now, now),
            ).rowcount
        return {"queues": len(queues), "consumers": len(stale), "messages": dropped + int(ttl)}
