"""The SQLite World: the embedded default, one database file in WAL mode shared by the processes of one machine.

Tables (migration ``sql/sqlite/0001_world.sql``, all prefixed ``celery_workflow_``): ``runs`` (the run view plus its
``event_count``), ``events`` keyed by ``(run_id, slot)``, ``steps``, ``hooks``, ``hook_tokens`` (its primary key makes
a token single-owner), ``waits``, ``streams`` and ``stream_chunks`` keyed by ``(run_id, name, idx)``. The queue table
(``0002_queue.sql``) belongs to :class:`celery_workflow._sqlite.queue.SQLiteQueue`, which is also the storage of the
SQLite Kombu transport (:meth:`SQLiteWorld.broker`).

Guarantees:

* Every append is one ``BEGIN IMMEDIATE`` transaction: it reads the run row (the write lock serialises writers of
  every process), builds the :class:`~celery_workflow.events.Snapshot` of the rows :func:`~celery_workflow.events.
  keys_of` names, lets :func:`~celery_workflow.events.plan_append` apply the rules, and writes the events, the views,
  hook and token rows, the run-end cleanup (hooks, tokens, waits) and the deliveries. Slots are contiguous, a batch
  is all or nothing, and a rejected batch writes nothing (the rule's ``EventRejected`` propagates unchanged).
* Reads that span several statements run in one read transaction, so they see one committed state.
* Waiters (:meth:`SQLiteWorld.wait_for_terminal`, :meth:`SQLiteWorld.read_stream` with ``wait``) sleep in
  :meth:`~celery_workflow._sqlite.database.Database.wait_for_change`, which wakes within milliseconds of a commit by any
  process, and re-check at least every ``poll_interval`` seconds.
* sqlite3 errors are raised as :class:`~celery_workflow.errors.WorldError` with the driver error as ``__cause__``.

Times are stored as integer microseconds since the epoch (UTC), JSON values as codec-tagged BLOBs.
"""

from __future__ import annotations

import dataclasses
import os
import sqlite3
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from enum import StrEnum
from typing import Any, cast
from urllib.parse import quote

from celery_workflow import codec, ids
from celery_workflow import events as rules
from celery_workflow._backend.checks import check_chunks, check_deliveries, check_stream_name, normalise
from celery_workflow._sqlite.database import Database
from celery_workflow._sqlite.queue import SQLiteQueue
from celery_workflow.errors import (
    ConfigurationError,
    EntityExists,
    EventConflict,
    HookNotFound,
    RunNotFound,
    StepNotFound,
    WorldError,
)
from celery_workflow.events import (
    Event,
    EventType,
    HookView,
    NewEvent,
    RunStatus,
    RunView,
    StepStatus,
    StepView,
    WaitStatus,
    WaitView,
)
from celery_workflow.world import (
    AppendResult,
    BrokerSpec,
    ClaimedDelivery,
    Delivery,
    NewRun,
    Page,
    StreamChunk,
    StreamPage,
)

__all__ = ["COLUMNS", "SQLiteWorld"]

#: The columns the code reads and writes, per table (the migration test checks the schema against this).
COLUMNS: dict[str, tuple[str, ...]] = {
    f"celery_workflow_{table}": tuple(columns.split())
    for table, columns in {
        "runs": "run_id workflow_name status queue input output error event_count created_at updated_at started_at"
        " completed_at",
        "events": "run_id slot event_type correlation_id data created_at",
        "steps": "run_id step_id step_name status input output error attempt owner queue created_slot created_at"
        " updated_at started_at completed_at retry_after",
        "hooks": "run_id hook_id token metadata is_webhook respond_with created_slot created_at",
        "hook_tokens": "token run_id hook_id created_at",
        "waits": "run_id wait_id status resume_at created_slot created_at completed_at",
        "streams": "run_id name closed chunk_count created_at updated_at",
        "stream_chunks": "run_id name idx data created_at",
    }.items()
}

_RUN = ", ".join(COLUMNS["celery_workflow_runs"])
_EVENT = ", ".join(COLUMNS["celery_workflow_events"])
_STEP = ", ".join(COLUMNS["celery_workflow_steps"])
_HOOK = ", ".join(COLUMNS["celery_workflow_hooks"])
_WAIT = ", ".join(COLUMNS["celery_workflow_waits"])
_HOOK_H = ", ".join(f"h.{c}" for c in COLUMNS["celery_workflow_hooks"])
_NO_LIMIT = 1 << 62  # values written here were size-checked by events.validate already
_CHUNK = 500  # keys per IN (...) list
#: Columns an event may change after the row was created.
_FIXED = frozenset({"run_id", "step_id", "wait_id", "workflow_name", "step_name", "queue", "input", "created_slot"})
_RUN_MUTABLE = tuple(c for c in COLUMNS["celery_workflow_runs"] if c not in _FIXED | {"created_at"})
_STEP_MUTABLE = tuple(c for c in COLUMNS["celery_workflow_steps"] if c not in _FIXED | {"created_at"})
_WAIT_MUTABLE = ("status", "completed_at")
_BLOBS = frozenset({"input", "output", "error", "metadata", "respond_with"})
_TIMES = frozenset({"created_at", "updated_at", "started_at", "completed_at", "retry_after", "resume_at"})


def _marks(n: int) -> str:
    return ", ".join("?" * n)


def _blob(value: Any) -> bytes | None:
    return None if value is None else codec.dumps(value, limit=_NO_LIMIT)


def _value(blob: bytes | None) -> Any:
    return None if blob is None else codec.loads(blob)


def _us(value: datetime | None) -> int | None:
    return None if value is None else ids.to_micros(value)


def _dt(value: int | None) -> datetime | None:
    return None if value is None else ids.from_micros(value)


_ENUMS: dict[str, type[StrEnum]] = {"runs": RunStatus, "steps": StepStatus, "waits": WaitStatus}
_VIEWS: dict[str, type[Any]] = {"runs": RunView, "steps": StepView, "hooks": HookView, "waits": WaitView}
_FIELDS = {table: frozenset(f.name for f in dataclasses.fields(cls)) for table, cls in _VIEWS.items()}


def _row(table: str, view: Any, **extra: Any) -> dict[str, Any]:
    """The row of ``celery_workflow_<table>`` for a view: blobs, microseconds, enum values; ``extra`` fills the rest."""
    row: dict[str, Any] = {}
    for column in COLUMNS[f"celery_workflow_{table}"]:
        value = extra[column] if column in extra else getattr(view, column)
        if column in _BLOBS:
            value = _blob(value)
        elif column in _TIMES:
            value = _us(value)
        elif isinstance(value, StrEnum):
            value = value.value
        elif isinstance(value, bool):
            value = int(value)
        row[column] = value
    return row


def _decode(table: str, column: str, stored: Any) -> Any:
    if column in _BLOBS:
        return _value(stored)
    if column in _TIMES:
        return _dt(stored)
    if column == "status":
        return _ENUMS[table](stored)
    if column == "is_webhook":
        return bool(stored)
    return stored


def _view(table: str, row: Sequence[Any]) -> Any:
    """The view of a row of ``celery_workflow_<table>`` (columns in :data:`COLUMNS` order)."""
    columns = COLUMNS[f"celery_workflow_{table}"]
    fields = {c: _decode(table, c, v) for c, v in zip(columns, row, strict=True) if c in _FIELDS[table]}
    return _VIEWS[table](**fields)


def _run_view(row: Sequence[Any]) -> RunView:
    return cast(RunView, _view("runs", row))


def _step_view(row: Sequence[Any]) -> StepView:
    return cast(StepView, _view("steps", row))


def _hook_view(row: Sequence[Any]) -> HookView:
    return cast(HookView, _view("hooks", row))


def _wait_view(row: Sequence[Any]) -> WaitView:
    return cast(WaitView, _view("waits", row))


def _event(row: Sequence[Any]) -> Event:
    run_id, slot, kind, cid, data, created_at = row
    return Event(run_id, slot, EventType(kind), cid, codec.loads(data), ids.from_micros(created_at))


def _insert(conn: sqlite3.Connection, table: str, row: dict[str, Any]) -> None:
    conn.execute(f"INSERT INTO {table} ({', '.join(row)}) VALUES ({_marks(len(row))})", tuple(row.values()))


def _update(
    conn: sqlite3.Connection, table: str, row: dict[str, Any], columns: Sequence[str], key: Sequence[str]
) -> None:
    """UPDATE ``columns`` of the row of ``table`` whose ``key`` columns match ``row``."""
    conn.execute(
        f"UPDATE {table} SET {', '.join(f'{c} = ?' for c in columns)} WHERE {' AND '.join(f'{k} = ?' for k in key)}",
        (*(row[c] for c in columns), *(row[k] for k in key)),
    )


@contextmanager
def _errors() -> Iterator[None]:
    """Raise sqlite3 errors as WorldError (the driver error is ``__cause__``)."""
    try:
        yield
    except sqlite3.Error as exc:
        raise WorldError(f"SQLite World: {exc}") from exc


def _chunked(keys: Iterable[str]) -> Iterator[list[str]]:
    items = sorted(keys)
    for i in range(0, len(items), _CHUNK):
        yield items[i : i + _CHUNK]


class SQLiteWorld:
    """A World in one SQLite file (WAL), safe for the threads and processes of one machine.

    ``path`` is created with its parent folders if missing and migrated unless ``migrate=False``; a database
    migrated by a newer celery_workflow raises :class:`~celery_workflow.errors.SchemaVersionError`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        poll_interval: float = 0.05,
        synchronous: str = "NORMAL",
        migrate: bool = True,
    ) -> None:
        self.poll_interval = poll_interval
        with _errors():
            self.db = Database(path, synchronous=synchronous, migrate=migrate)
        #: The queue store (shared with the SQLite Kombu transport).
        self.store = SQLiteQueue(self.db)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> SQLiteWorld:
        """``sqlite:///relative.db`` (three slashes) or ``sqlite:////abs/path.db`` (four); same form as the transport."""
        if not url.lower().startswith("sqlite://"):
            raise ConfigurationError(f"not a SQLite URL: {url!r}")
        from celery_workflow.transport.sqlite import database_path

        try:
            path = database_path(url)
        except ValueError as exc:
            raise ConfigurationError(str(exc)) from exc
        return cls(path, **options)

    @property
    def path(self) -> str:
        return self.db.path

    def __repr__(self) -> str:
        return f"SQLiteWorld({self.db.path!r})"

    # -- plumbing ------------------------------------------------------------------------------------------------

    @contextmanager
    def _tx(self, mode: str = "IMMEDIATE") -> Iterator[sqlite3.Connection]:
        """A write transaction (IMMEDIATE: takes the write lock at once), or a read one (DEFERRED)."""
        with _errors(), self.db.transaction(mode) as conn:
            yield conn

    def _version(self) -> int:
        with _errors():
            return self.db.data_version()

    def _wait_for_change(self, version: int, deadline: float | None) -> None:
        left = self.poll_interval if deadline is None else min(self.poll_interval, deadline - time.monotonic())
        if left > 0:
            with _errors():
                self.db.wait_for_change(version, left)

    @staticmethod
    def _load_run(conn: sqlite3.Connection, run_id: str) -> RunView | None:
        row = conn.execute(f"SELECT {_RUN} FROM celery_workflow_runs WHERE run_id = ?", (run_id,)).fetchone()
        return None if row is None else _run_view(row)

    @staticmethod
    def _require_run(conn: sqlite3.Connection, run_id: str) -> None:
        if conn.execute("SELECT 1 FROM celery_workflow_runs WHERE run_id = ?", (run_id,)).fetchone() is None:
            raise RunNotFound(f"run {run_id} does not exist")

    # -- storage: writes -----------------------------------------------------------------------------------------

    def create_run(self, run: NewRun, deliveries: Sequence[Delivery] = ()) -> tuple[RunView, bool]:
        check_deliveries(deliveries)
        (created,) = normalise([NewEvent(EventType.RUN_CREATED, None, run.event_data())])
        with self._tx() as conn:
            existing = self._load_run(conn, run.run_id)
            if existing is not None:
                if existing.workflow_name != run.workflow_name:
                    raise EntityExists(
                        f"run {run.run_id} belongs to workflow {existing.workflow_name!r}, not {run.workflow_name!r}"
                    )
                return existing, False
            view, event = rules.new_run(run.run_id, created.data, ids.utcnow())
            _insert(conn, "celery_workflow_runs", _row("runs", view))
            self._insert_events(conn, [event])
            self.store.insert(conn, deliveries)
        return view, True

    def append(
        self,
        run_id: str,
        events: Sequence[NewEvent],
        *,
        expected_count: int | None = None,
        deliveries: Sequence[Delivery] = (),
        ack: str | None = None,
        durable: bool = True,  # WAL with synchronous=NORMAL never waits for fsync at commit: nothing to relax
    ) -> AppendResult:
        check_deliveries(deliveries)
        batch = normalise(events)
        keys = rules.keys_of(batch)
        with self._tx() as conn:
            snapshot = self._snapshot(conn, run_id, keys)
            plan = rules.plan_append(snapshot, batch, now=ids.utcnow(), expected_count=expected_count)
            self._write_plan(conn, plan)
            self.store.insert(conn, deliveries)
            if ack is not None:
                self.store.delete_claim(conn, ack)
        return AppendResult(plan.events, plan.run)

    def _snapshot(self, conn: sqlite3.Connection, run_id: str, keys: rules.Keys) -> rules.Snapshot:
        snapshot = rules.Snapshot(self._load_run(conn, run_id))
        if snapshot.run is None:
            return snapshot
        for table, key, wanted, found in (
            ("steps", "step_id", keys.steps, snapshot.steps),
            ("hooks", "hook_id", keys.hooks, snapshot.hooks),
            ("waits", "wait_id", keys.waits, snapshot.waits),
        ):
            columns = ", ".join(COLUMNS[f"celery_workflow_{table}"])
            for part in _chunked(wanted):
                sql = (
                    f"SELECT {columns} FROM celery_workflow_{table} WHERE run_id = ? AND {key} IN ({_marks(len(part))})"
                )
                for row in conn.execute(sql, (run_id, *part)):
                    view = _view(table, row)
                    found[getattr(view, key)] = view
        for part in _chunked(keys.hooks):
            for (hook_id,) in conn.execute(
                "SELECT correlation_id FROM celery_workflow_events WHERE run_id = ?"
                f" AND event_type IN ('hook_created', 'hook_conflict') AND correlation_id IN ({_marks(len(part))})",
                (run_id, *part),
            ):
                snapshot.created_hooks.add(hook_id)
        for part in _chunked(keys.tokens):
            for row in conn.execute(
                f"SELECT {_HOOK_H} FROM celery_workflow_hook_tokens AS t JOIN celery_workflow_hooks AS h"
                f" ON h.run_id = t.run_id AND h.hook_id = t.hook_id WHERE t.token IN ({_marks(len(part))})",
                part,
            ):
                hook = _hook_view(row)
                snapshot.token_owners[hook.token] = hook
        return snapshot

    @staticmethod
    def _insert_events(conn: sqlite3.Connection, new: Sequence[Event]) -> None:
        conn.executemany(
            f"INSERT INTO celery_workflow_events ({_EVENT}) VALUES ({_marks(6)})",
            [
                (e.run_id, e.slot, e.event_type.value, e.correlation_id, _blob(dict(e.data)), _us(e.created_at))
                for e in new
            ],
        )

    def _write_plan(self, conn: sqlite3.Connection, plan: rules.Plan) -> None:
        if not plan.events:
            return  # a no-op batch (a repeated run_started or run_cancelled) changes nothing
        run = plan.run
        created = {
            (e.event_type, e.correlation_id): e.slot for e in plan.events if e.event_type in rules.CREATION_EVENTS
        }
        self._insert_events(conn, plan.events)
        _update(conn, "celery_workflow_runs", _row("runs", run), _RUN_MUTABLE, ("run_id",))
        for step in plan.steps.values():
            slot = created.get((EventType.STEP_CREATED, step.step_id))
            row = _row("steps", step, created_slot=slot)
            if slot is None:
                _update(conn, "celery_workflow_steps", row, _STEP_MUTABLE, ("run_id", "step_id"))
            else:
                _insert(conn, "celery_workflow_steps", row)
        for wait in plan.waits.values():
            slot = created.get((EventType.WAIT_CREATED, wait.wait_id))
            row = _row("waits", wait, created_slot=slot)
            if slot is None:
                _update(conn, "celery_workflow_waits", row, _WAIT_MUTABLE, ("run_id", "wait_id"))
            else:
                _insert(conn, "celery_workflow_waits", row)
        # Deleting a hook releases its token: hook_tokens references hooks ON DELETE CASCADE (foreign_keys is on).
        for hook_id, hook in plan.hooks_deleted.items():
            conn.execute("DELETE FROM celery_workflow_hooks WHERE run_id = ? AND hook_id = ?", (hook.run_id, hook_id))
        for hook_id, hook in plan.hooks_inserted.items():
            row = _row("hooks", hook, created_slot=created[(EventType.HOOK_CREATED, hook_id)])
            _insert(conn, "celery_workflow_hooks", row)
            conn.execute(
                "INSERT INTO celery_workflow_hook_tokens (token, run_id, hook_id, created_at) VALUES (?, ?, ?, ?)",
                (hook.token, hook.run_id, hook_id, _us(hook.created_at)),
            )
        if plan.run_ended:
            conn.execute("DELETE FROM celery_workflow_hooks WHERE run_id = ?", (run.run_id,))
            conn.execute("DELETE FROM celery_workflow_waits WHERE run_id = ?", (run.run_id,))

    # -- storage: reads ------------------------------------------------------------------------------------------

    def get_run(self, run_id: str) -> RunView:
        with self._tx("DEFERRED") as conn:
            view = self._load_run(conn, run_id)
        if view is None:
            raise RunNotFound(f"run {run_id} does not exist")
        return view

    def get_run_with_events(self, run_id: str) -> tuple[RunView, list[Event]]:
        with self._tx("DEFERRED") as conn:
            view = self._load_run(conn, run_id)
            if view is None:
                raise RunNotFound(f"run {run_id} does not exist")
            rows = conn.execute(
                f"SELECT {_EVENT} FROM celery_workflow_events WHERE run_id = ? ORDER BY slot", (run_id,)
            ).fetchall()
        return view, [_event(row) for row in rows]

    def list_runs(
        self,
        *,
        workflow: str | None = None,
        status: RunStatus | str | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> Page[RunView]:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        where: list[str] = []
        params: list[Any] = []
        if workflow is not None:
            where.append("workflow_name = ?")
            params.append(workflow)
        if status is not None:
            where.append("status = ?")
            params.append(RunStatus(status).value)
        if cursor is not None:
            where.append("run_id < ?")
            params.append(cursor)
        sql = f"SELECT {_RUN} FROM celery_workflow_runs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        with self._tx("DEFERRED") as conn:
            rows = conn.execute(sql + " ORDER BY run_id DESC LIMIT ?", (*params, limit + 1)).fetchall()
        views = [_run_view(row) for row in rows[:limit]]
        return Page(views, views[-1].run_id if len(rows) > limit else None)

    def list_events(self, run_id: str, *, after_slot: int = 0, limit: int | None = None) -> list[Event]:
        with self._tx("DEFERRED") as conn:
            rows = conn.execute(
                f"SELECT {_EVENT} FROM celery_workflow_events WHERE run_id = ? AND slot > ? ORDER BY slot LIMIT ?",
                (run_id, after_slot, -1 if limit is None else max(limit, 0)),
            ).fetchall()
            if not rows:
                self._require_run(conn, run_id)
        return [_event(row) for row in rows]

    def get_step(self, run_id: str, step_id: str) -> StepView:
        with self._tx("DEFERRED") as conn:
            row = conn.execute(
                f"SELECT {_STEP} FROM celery_workflow_steps WHERE run_id = ? AND step_id = ?", (run_id, step_id)
            ).fetchone()
            if row is None:
                self._require_run(conn, run_id)
                raise StepNotFound(f"step {step_id} of run {run_id} does not exist")
        return _step_view(row)

    def _list(self, run_id: str, sql: str) -> list[Any]:
        with self._tx("DEFERRED") as conn:
            rows = conn.execute(sql, (run_id,)).fetchall()
            if not rows:
                self._require_run(conn, run_id)
        return rows

    def list_steps(self, run_id: str) -> list[StepView]:
        rows = self._list(run_id, f"SELECT {_STEP} FROM celery_workflow_steps WHERE run_id = ? ORDER BY created_slot")
        return [_step_view(row) for row in rows]

    def get_hook_by_token(self, token: str) -> HookView:
        with self._tx("DEFERRED") as conn:
            row = conn.execute(
                f"SELECT {_HOOK_H} FROM celery_workflow_hook_tokens AS t JOIN celery_workflow_hooks AS h"
                " ON h.run_id = t.run_id AND h.hook_id = t.hook_id WHERE t.token = ?",
                (token,),
            ).fetchone()
        if row is None:
            raise HookNotFound(f"no live hook owns token {token!r}")
        return _hook_view(row)

    def list_hooks(self, run_id: str) -> list[HookView]:
        rows = self._list(run_id, f"SELECT {_HOOK} FROM celery_workflow_hooks WHERE run_id = ? ORDER BY created_slot")
        return [_hook_view(row) for row in rows]

    def list_waits(self, run_id: str) -> list[WaitView]:
        rows = self._list(run_id, f"SELECT {_WAIT} FROM celery_workflow_waits WHERE run_id = ? ORDER BY created_slot")
        return [_wait_view(row) for row in rows]

    def wait_for_terminal(self, run_id: str, timeout: float | None) -> RunView:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            version = self._version()
            view = self.get_run(run_id)
            if view.status.terminal or (deadline is not None and time.monotonic() >= deadline):
                return view
            self._wait_for_change(version, deadline)

    # -- queue (SQLiteQueue) -------------------------------------------------------------------------------------

    def enqueue(self, deliveries: Sequence[Delivery]) -> list[bool]:
        check_deliveries(deliveries)
        return self.store.enqueue(deliveries)

    def claim(self, queues: Sequence[str], *, limit: int = 1, lease: float = 60.0) -> list[ClaimedDelivery]:
        if lease <= 0:
            raise ValueError("lease must be positive")
        return self.store.claim(queues, limit=limit, lease=lease)

    def ack(self, receipt: str) -> None:
        self.store.ack(receipt)

    def release(self, receipt: str) -> None:
        self.store.release(receipt)

    def retry_later(self, receipt: str, delay: float) -> None:
        self.store.retry_later(receipt, delay)

    def extend(self, receipts: Sequence[str], lease: float) -> None:
        self.store.extend(receipts, lease)

    # -- streams -------------------------------------------------------------------------------------------------

    def write_stream(self, run_id: str, name: str, chunks: Sequence[bytes]) -> int:
        check_stream_name(name)
        data = check_chunks(chunks)
        now = ids.to_micros(ids.utcnow())
        with self._tx() as conn:
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
        now = ids.to_micros(ids.utcnow())
        with self._tx() as conn:
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
        deadline = time.monotonic() + max(wait, 0.0)
        while True:
            version = self._version()
            page = self._read_stream(run_id, name, start, limit)
            if page.chunks or page.closed or time.monotonic() >= deadline:
                return page
            self._wait_for_change(version, deadline)

    def _read_stream(self, run_id: str, name: str, start: int, limit: int | None) -> StreamPage:
        with self._tx("DEFERRED") as conn:
            state = conn.execute(
                "SELECT closed, chunk_count FROM celery_workflow_streams WHERE run_id = ? AND name = ?", (run_id, name)
            ).fetchone()
            if state is None:
                self._require_run(conn, run_id)
                return StreamPage([], False, start)
            rows = conn.execute(
                "SELECT idx, data FROM celery_workflow_stream_chunks WHERE run_id = ? AND name = ? AND idx >= ?"
                " ORDER BY idx LIMIT ?",
                (run_id, name, start, -1 if limit is None else max(limit, 0)),
            ).fetchall()
        chunks = [StreamChunk(int(idx), bytes(data)) for idx, data in rows]
        next_index = start + len(chunks)
        return StreamPage(chunks, bool(state[0]) and next_index >= int(state[1]), next_index)

    def list_streams(self, run_id: str) -> list[str]:
        rows = self._list(run_id, "SELECT name FROM celery_workflow_streams WHERE run_id = ? ORDER BY name")
        return [str(row[0]) for row in rows]

    # -- wiring --------------------------------------------------------------------------------------------------

    def broker(self) -> BrokerSpec:
        """The SQLite Kombu transport on this database file (``sqlite:////abs/path``, percent-escaped)."""
        return BrokerSpec(
            transport="celery_workflow.transport.sqlite:Transport",
            url="sqlite:///" + quote(self.db.path, safe="/"),
            options={},
        )

    def close(self) -> None:
        """Close this process's connections (the World reopens them on next use)."""
        self.db.close()
