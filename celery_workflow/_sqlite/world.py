"""The SQLite World: the embedded default, one database file in WAL mode shared by the processes of one machine.

Tables (migration ``sql/sqlite/0001_world.sql``, all prefixed ``celery_workflow_``): ``runs`` (the run view plus its
``event_count``), ``events`` keyed by ``(run_id, slot)``, ``steps``, ``hooks``, ``hook_tokens`` (its primary key makes
a token single-owner), ``waits``, ``streams`` and ``stream_chunks`` keyed by ``(run_id, name, idx)``. The queue table
(``0002_queue.sql``) belongs to :class:`celery_workflow._sqlite.queue.SQLiteQueue`, which is also the storage of the
SQLite Kombu transport (:meth:`SQLiteWorld.broker`).

Guarantees:

* Every append follows the template of :mod:`celery_workflow._backend.template` in one ``BEGIN IMMEDIATE``
  transaction (:mod:`celery_workflow._sqlite.append`): it reads the run row (the write lock serialises writers of
  every process) and the rows the batch names, lets :func:`~celery_workflow.rules.plan_append` apply the rules, and
  writes the events, the views, hook and token rows, the run-end cleanup (hooks, tokens, waits), the deliveries and
  the ack. Slots are contiguous, a batch is all or nothing, and a rejected batch writes nothing (the rule's
  ``EventRejected`` propagates unchanged).
* Reads that span several statements run in one read transaction, so they see one committed state.
* Waiters (:meth:`SQLiteWorld.wait_for_terminal`, :meth:`SQLiteWorld.read_stream` with ``wait``) sleep in
  :meth:`~celery_workflow._sqlite.database.Database.wait_for_change`, which wakes within milliseconds of a commit by any
  process, and re-check at least every ``poll_interval`` seconds.
* sqlite3 errors are raised as :class:`~celery_workflow.errors.WorldError` with the driver error as ``__cause__``.

Times are stored as integer microseconds since the epoch (UTC), JSON values as codec-tagged BLOBs.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any

from celery_workflow import ids, rules
from celery_workflow._backend import template
from celery_workflow._backend.base import StoreQueue, TemplateWorld
from celery_workflow._backend.checks import check_chunks, check_stream_name
from celery_workflow._backend.listing import RunFilter
from celery_workflow._backend.schedules_sql import SQLSchedules
from celery_workflow._backend.waiting import wait_until
from celery_workflow._sqlite.append import SQLiteAppend, insert_events, load_run
from celery_workflow._sqlite.database import Database, database_url, parse_database_url
from celery_workflow._sqlite.queue import SQLiteQueue
from celery_workflow._sqlite.rows import (
    CODEC,
    COLUMNS,
    EVENT,
    HOOK,
    HOOK_BY_TOKEN,
    RETAINED_BY_TOKEN,
    RUN,
    STEP,
    WAIT,
    insert,
    retained_token,
    sqlite_errors,
)
from celery_workflow.errors import ConfigurationError, EventConflict, HookNotFound, RunNotFound, StepNotFound
from celery_workflow.events import Event, HookView, RunStatus, RunView, StepView, WaitView
from celery_workflow.world import (
    DEFAULT_MAX_PAYLOAD,
    BrokerSpec,
    Capabilities,
    Delivery,
    NewRun,
    Page,
    StreamChunk,
    StreamPage,
    Upkeep,
)

__all__ = ["COLUMNS", "SQLiteWorld"]


def _execute(conn: sqlite3.Connection, sql: str, params: Sequence[Any]) -> tuple[list[Any], int]:
    cursor = conn.execute(sql, tuple(params))
    return cursor.fetchall(), cursor.rowcount


class SQLiteWorld(TemplateWorld, StoreQueue):
    """A World in one SQLite file (WAL), safe for the threads and processes of one machine.

    ``path`` is created with its parent folders if missing and migrated unless ``migrate=False``; with
    ``create=False`` it must hold a World already (else ConfigurationError naming the path, and nothing is created:
    how the command line opens a World to read it). A database migrated by a newer celery_workflow raises
    :class:`~celery_workflow.errors.SchemaVersionError`. With ``prefix``
    (``"app1_"``; URL ``sqlite:///path.db?prefix=app1_``) the World and its transport use the tables
    ``app1_celery_workflow_…`` of the file, so several apps share one file without seeing each other's runs and
    queues (:mod:`celery_workflow._sqlite.database`); an invalid prefix raises ConfigurationError.
    """

    capabilities = Capabilities()
    routes: Mapping[str, str] = MappingProxyType({})
    queue_names: frozenset[str] | None = None  # the queue table takes any name
    #: The largest value it stores: the event-data limit less the event's other fields (a row holds no more).
    max_payload: int = DEFAULT_MAX_PAYLOAD
    store: SQLiteQueue
    _steps: SQLiteAppend

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        prefix: str = "",
        poll_interval: float = 0.05,
        synchronous: str = "NORMAL",
        migrate: bool = True,
        create: bool = True,
    ) -> None:
        self.poll_interval = poll_interval
        with sqlite_errors():
            self.db = Database(path, prefix=prefix, synchronous=synchronous, migrate=migrate, create=create)
        #: The queue store (shared with the SQLite Kombu transport).
        self.store = SQLiteQueue(self.db)
        self._steps = SQLiteAppend(self)
        #: The schedules (table ``celery_workflow_schedules``, :mod:`celery_workflow.schedules`).
        self.schedule_store = SQLSchedules(self._schedules_tx, _execute, CODEC, "?")

    @classmethod
    def from_url(cls, url: str, **options: Any) -> SQLiteWorld:
        """``sqlite:///relative.db`` (three slashes) or ``sqlite:////abs/path.db`` (four), optionally with
        ``?prefix=app1_``; same form as the transport. A ``prefix`` option must agree with the URL's."""
        if not url.lower().startswith("sqlite://"):
            raise ConfigurationError(f"not a SQLite URL: {url!r}")
        try:
            path, prefix = parse_database_url(url)
        except ValueError as exc:
            raise ConfigurationError(str(exc)) from exc
        option = options.pop("prefix", None)
        if option is not None and prefix and option != prefix:
            raise ConfigurationError(f"prefix={option!r} contradicts the URL's prefix {prefix!r}: {url!r}")
        return cls(path, prefix=prefix or option or "", **options)

    @property
    def path(self) -> str:
        return self.db.path

    @property
    def prefix(self) -> str:
        """The table prefix (``""``: none)."""
        return self.db.prefix

    def __repr__(self) -> str:
        if self.db.prefix:
            return f"SQLiteWorld({self.db.path!r}, prefix={self.db.prefix!r})"
        return f"SQLiteWorld({self.db.path!r})"

    # -- plumbing ------------------------------------------------------------------------------------------------

    @contextmanager
    def transaction(self, mode: str = "IMMEDIATE") -> Iterator[sqlite3.Connection]:
        """A write transaction (IMMEDIATE: takes the write lock at once), or a read one (DEFERRED); sqlite3 errors
        become WorldError."""
        with sqlite_errors(), self.db.transaction(mode) as conn:
            yield conn

    def _read(self, sql: str, params: Sequence[Any], run_id: str | None = None) -> list[Any]:
        """The rows of one query in a read transaction; RunNotFound when there are none and ``run_id`` names no
        run."""
        with self.transaction("DEFERRED") as conn:
            rows = conn.execute(sql, params).fetchall()
            if not rows and run_id is not None:
                self._require_run(conn, run_id)
        return rows

    def _schedules_tx(self, body: Callable[[Any], Any], write: bool) -> Any:
        with self.transaction("IMMEDIATE" if write else "DEFERRED") as conn:
            return body(conn)

    def _wait(self, version: int, seconds: float) -> None:
        with sqlite_errors():
            self.db.wait_for_change(version, seconds)

    def _version(self) -> int:
        with sqlite_errors():
            return self.db.data_version()

    @staticmethod
    def _require_run(conn: sqlite3.Connection, run_id: str) -> None:
        if conn.execute("SELECT 1 FROM celery_workflow_runs WHERE run_id = ?", (run_id,)).fetchone() is None:
            raise RunNotFound(f"run {run_id} does not exist")

    # -- storage: writes -----------------------------------------------------------------------------------------

    def create_run(self, run: NewRun, deliveries: Sequence[Delivery] = ()) -> tuple[RunView, bool]:
        view, event = template.prepare_run(run, deliveries, ids.utcnow())
        with self.transaction() as conn:
            existing = load_run(conn, run.run_id)
            if existing is not None:
                return template.existing_run(existing, run)
            insert(conn, "celery_workflow_runs", CODEC.record("runs", view))
            insert_events(conn, [event])
            self.store.insert(conn, deliveries)
        return view, True

    # -- storage: reads ------------------------------------------------------------------------------------------

    def get_run(self, run_id: str) -> RunView:
        with self.transaction("DEFERRED") as conn:
            view = load_run(conn, run_id)
        if view is None:
            raise RunNotFound(f"run {run_id} does not exist")
        return view

    def get_run_with_events(self, run_id: str) -> tuple[RunView, list[Event]]:
        with self.transaction("DEFERRED") as conn:
            view = load_run(conn, run_id)
            if view is None:
                raise RunNotFound(f"run {run_id} does not exist")
            rows = conn.execute(
                f"SELECT {EVENT} FROM celery_workflow_events WHERE run_id = ? ORDER BY slot", (run_id,)
            ).fetchall()
        return view, [CODEC.event(row) for row in rows]

    def runs_listed(self, wanted: RunFilter) -> Page[RunView]:
        rows = self._read(*wanted.sql(RUN, "celery_workflow_runs", "?", CODEC.store_time))
        return wanted.page([CODEC.run(row) for row in rows])

    def list_events(self, run_id: str, *, after_slot: int = 0, limit: int | None = None) -> list[Event]:
        rows = self._read(
            f"SELECT {EVENT} FROM celery_workflow_events WHERE run_id = ? AND slot > ? ORDER BY slot LIMIT ?",
            (run_id, after_slot, -1 if limit is None else max(limit, 0)),
            run_id,
        )
        return [CODEC.event(row) for row in rows]

    def get_step(self, run_id: str, step_id: str) -> StepView:
        rows = self._read(
            f"SELECT {STEP} FROM celery_workflow_steps WHERE run_id = ? AND step_id = ?", (run_id, step_id), run_id
        )
        if not rows:
            raise StepNotFound(f"step {step_id} of run {run_id} does not exist")
        return CODEC.step(rows[0])

    def list_steps(self, run_id: str) -> list[StepView]:
        sql = f"SELECT {STEP} FROM celery_workflow_steps WHERE run_id = ? ORDER BY created_slot"
        return [CODEC.step(row) for row in self._read(sql, (run_id,), run_id)]

    def get_hook_by_token(self, token: str) -> HookView:
        rows = self._read(HOOK_BY_TOKEN.format("= ?"), (token,))
        if not rows:
            held = [retained_token(row) for row in self._read(RETAINED_BY_TOKEN.format("= ?"), (token,))]
            if held and held[0].holds(ids.utcnow()):
                raise rules.retained_error(held[0])
            raise HookNotFound(f"no live hook owns token {token!r}")
        return CODEC.hook(rows[0])

    def list_hooks(self, run_id: str) -> list[HookView]:
        sql = f"SELECT {HOOK} FROM celery_workflow_hooks WHERE run_id = ? ORDER BY created_slot"
        return [CODEC.hook(row) for row in self._read(sql, (run_id,), run_id)]

    def list_waits(self, run_id: str) -> list[WaitView]:
        sql = f"SELECT {WAIT} FROM celery_workflow_waits WHERE run_id = ? ORDER BY created_slot"
        return [CODEC.wait(row) for row in self._read(sql, (run_id,), run_id)]

    def wait_for_terminal(self, run_id: str, timeout: float | None) -> RunView:
        return wait_until(
            lambda: self.get_run(run_id),
            lambda view: view.status.terminal,
            timeout=timeout,
            poll_interval=self.poll_interval,
            mark=self._version,
            wait=self._wait,
        )

    # -- streams -------------------------------------------------------------------------------------------------

    def write_stream(self, run_id: str, name: str, chunks: Sequence[bytes]) -> int:
        check_stream_name(name)
        data = check_chunks(chunks)
        now = CODEC.store_time(ids.utcnow())
        with self.transaction() as conn:
            row = conn.execute(
                "SELECT closed, chunk_count FROM celery_workflow_streams WHERE run_id = ? AND name = ?", (run_id, name)
            ).fetchone()
            if row is None:
                self._require_run(conn, run_id)
                conn.execute(
                    "INSERT INTO celery_workflow_streams (run_id, name, closed, chunk_count, created_at, updated_at)"
                    " VALUES (?, ?, 0, 0, ?, ?)",
                    (run_id, name, now, now),
                )
                count = 0
            elif row[0]:
                raise EventConflict(f"stream {name!r} of run {run_id} is closed")
            else:
                count = int(row[1])
            conn.executemany(
                "INSERT INTO celery_workflow_stream_chunks (run_id, name, idx, data, created_at) VALUES (?, ?, ?, ?, ?)",
                [(run_id, name, count + i, chunk, now) for i, chunk in enumerate(data)],
            )
            conn.execute(
                "UPDATE celery_workflow_streams SET chunk_count = ?, updated_at = ? WHERE run_id = ? AND name = ?",
                (count + len(data), now, run_id, name),
            )
        return count + len(data)

    def close_stream(self, run_id: str, name: str) -> None:
        check_stream_name(name)
        now = CODEC.store_time(ids.utcnow())
        with self.transaction() as conn:
            self._require_run(conn, run_id)
            conn.execute(
                "INSERT INTO celery_workflow_streams (run_id, name, closed, chunk_count, created_at, updated_at)"
                " VALUES (?, ?, 1, 0, ?, ?) ON CONFLICT (run_id, name) DO UPDATE SET closed = 1,"
                " updated_at = excluded.updated_at WHERE closed = 0",
                (run_id, name, now, now),
            )

    def read_stream(
        self, run_id: str, name: str, *, start: int = 0, limit: int | None = None, wait: float = 0.0
    ) -> StreamPage:
        if start < 0:
            raise ValueError("start must be >= 0")
        page, _ = wait_until(  # a reader of an ended run waits for nothing: it reads what is there
            lambda: self._read_stream(run_id, name, start, limit),
            lambda read: bool(read[0].chunks or read[0].closed or read[1]),
            timeout=max(wait, 0.0),
            poll_interval=self.poll_interval,
            mark=self._version,
            wait=self._wait,
        )
        return page

    def _read_stream(self, run_id: str, name: str, start: int, limit: int | None) -> tuple[StreamPage, bool]:
        """The page, and whether the run has ended (read in the same transaction)."""
        with self.transaction("DEFERRED") as conn:
            run = conn.execute("SELECT status FROM celery_workflow_runs WHERE run_id = ?", (run_id,)).fetchone()
            if run is None:
                raise RunNotFound(f"run {run_id} does not exist")
            ended = RunStatus(run[0]).terminal
            state = conn.execute(
                "SELECT closed, chunk_count FROM celery_workflow_streams WHERE run_id = ? AND name = ?", (run_id, name)
            ).fetchone()
            if state is None:
                return StreamPage([], False, start), ended
            rows = conn.execute(
                "SELECT idx, data FROM celery_workflow_stream_chunks WHERE run_id = ? AND name = ? AND idx >= ?"
                " ORDER BY idx LIMIT ?",
                (run_id, name, start, -1 if limit is None else max(limit, 0)),
            ).fetchall()
        chunks = [StreamChunk(int(idx), bytes(data)) for idx, data in rows]
        next_index = start + len(chunks)
        return StreamPage(chunks, bool(state[0]) and next_index >= int(state[1]), next_index), ended

    def list_streams(self, run_id: str) -> list[str]:
        rows = self._read("SELECT name FROM celery_workflow_streams WHERE run_id = ? ORDER BY name", (run_id,), run_id)
        return [str(row[0]) for row in rows]

    # -- wiring --------------------------------------------------------------------------------------------------

    def broker(self) -> BrokerSpec:
        """The SQLite Kombu transport on this database file (``sqlite:////abs/path``, percent-escaped, with
        ``?prefix=…`` when the World has a prefix: the URL alone names the tables, so ``celery inspect`` and Flower,
        which rebuild a connection from it, see the same queues)."""
        return BrokerSpec(
            transport="celery_workflow.transport.sqlite:Transport", url=database_url(self.db.path, self.db.prefix)
        )

    def start_upkeep(self) -> Upkeep | None:
        """None: the SQLite World needs no background work (the transport collects its own queues)."""
        return None

    def close(self) -> None:
        """Close this process's connections (the World reopens them on next use)."""
        self.db.close()
