"""What every part of the Postgres queue shares: the database, the clock its statements compare with, and one
statement as one transaction (:class:`Statements`). Each part of :class:`~celery_workflow._postgres.queue.PostgresQueue`
(deliveries, dead letters, broker state, standing claims) holds the same :class:`Statements`, so a clock a test sets
on the queue applies to every part."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeAlias

from celery_workflow._postgres.database import PgDatabase
from celery_workflow._postgres.script import Script, commit_setting

if TYPE_CHECKING:  # psycopg is imported (or its absence reported) by celery_workflow._postgres.database
    import psycopg

Conn: TypeAlias = "psycopg.Connection[Any]"


def seconds(value: float | None) -> timedelta | None:
    return None if value is None else timedelta(seconds=value)


def at(epoch: float | None) -> datetime | None:
    return None if epoch is None else datetime.fromtimestamp(epoch, UTC)


def utc(value: datetime | None) -> datetime | None:
    return None if value is None else value.astimezone(UTC)


def total(value: timedelta | None) -> float | None:
    return None if value is None else value.total_seconds()


class Statements:
    """A :class:`~celery_workflow._postgres.database.PgDatabase` and the clock of the queue's statements, shared by
    the parts of the queue."""

    def __init__(self, db: PgDatabase) -> None:
        self.db = db
        #: None (the default): the database server's clock. Tests may set a Python clock (epoch seconds).
        self.clock: Callable[[], float] | None = None

    def params(self, **values: Any) -> dict[str, Any]:
        values["now"] = None if self.clock is None else datetime.fromtimestamp(self.clock(), UTC)
        return values

    def local_now(self) -> float:
        return time.time() if self.clock is None else self.clock()

    def rows(
        self, what: str, sql: str, *, commit_mode: str = "", before: Sequence[str] = (), **values: Any
    ) -> list[tuple[Any, ...]]:
        """Run one statement in its own transaction (one round trip); its rows (none for a statement without a
        result). ``commit_mode``: ``"lazy"`` commits without waiting for the disk, ``"disk"`` is on disk when this
        returns (see the module docstring), ``""`` as the session does. ``before``: statements (taking the same
        parameters) run first in that transaction and round trip, each with its own snapshot."""
        return self._run(what, sql, values, commit_mode, before)[0]

    def rowcount(self, what: str, sql: str, *, commit_mode: str = "", **values: Any) -> int:
        return self._run(what, sql, values, commit_mode)[1]

    def _run(
        self, what: str, sql: str, values: dict[str, Any], commit_mode: str, before: Sequence[str] = ()
    ) -> tuple[list[tuple[Any, ...]], int]:
        params = self.params(**values)
        setting = None  # only when the session's own setting differs
        if commit_mode == "lazy" and not self.db.lazy_commits:
            setting = False
        elif commit_mode == "disk" and self.db.lazy_commits:
            setting = True

        def go(conn: Conn) -> tuple[list[tuple[Any, ...]], int]:
            # one round trip, one implicit transaction (a set_config that is local to it, when it commits otherwise)
            script = Script(conn)
            if setting is not None:
                script.add(*commit_setting(setting))
            for statement in before:
                script.add(statement, params)
            index = script.add(sql, params)
            result = script.send()[index]
            return result.rows, result.rowcount

        return self.db.run(go, what=f"queue: {what}", transaction=False)
