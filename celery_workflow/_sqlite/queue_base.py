"""What every part of the SQLite queue shares: its database, its clock (microseconds since the epoch, replaceable in
tests) and its transactions (:class:`Transactions`). Each part of :class:`~celery_workflow._sqlite.queue.SQLiteQueue`
(deliveries, dead letters, broker state) holds the same :class:`Transactions`, so a clock a test sets on the queue
applies to every part."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence, Sized
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from celery_workflow._sqlite.database import Database
from celery_workflow.errors import WorldError


def micros(seconds: float) -> int:
    return round(seconds * 1_000_000)


def from_micros(micros: int | None) -> datetime | None:
    return None if micros is None else datetime.fromtimestamp(micros / 1_000_000, UTC)


def marks(values: Sized) -> str:
    return ", ".join("?" * len(values))


class Transactions:
    """A :class:`~celery_workflow._sqlite.database.Database` and the queue's clock, shared by the parts of the queue."""

    def __init__(self, db: Database) -> None:
        self.db = db
        #: Wall clock in seconds since the epoch; tests may replace it.
        self.clock: Callable[[], float] = time.time

    def now(self) -> int:
        return micros(self.clock())

    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """One ``BEGIN IMMEDIATE`` transaction; sqlite3 errors become WorldError."""
        try:
            with self.db.transaction() as conn:
                yield conn
        except sqlite3.Error as exc:
            raise WorldError(f"SQLite queue: {exc}") from exc

    def read(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        try:
            return self.db.connection().execute(sql, params).fetchall()
        except sqlite3.Error as exc:
            raise WorldError(f"SQLite queue: {exc}") from exc
