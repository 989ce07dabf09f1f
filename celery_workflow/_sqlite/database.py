"""SQLite plumbing shared by the SQLite World and the SQLite transport: connections, transactions, migrations.

* One connection per (process, thread): safe across ``fork()`` (Celery's prefork pool) and threads.
* WAL mode, ``busy_timeout``; writes run in ``BEGIN IMMEDIATE`` transactions so writers queue instead of
  deadlocking on lock upgrades.
* Migrations (:mod:`celery_workflow._backend.migrations`): ``celery_workflow/sql/sqlite/NNNN_name.sql`` applied in
  order inside one exclusive transaction; a database newer than this library is refused.
* URLs: :func:`database_path` reads the ``sqlite:///…`` form the World and the transport share.
* :meth:`Database.wait_for_change` polls ``PRAGMA data_version`` (a shared-memory read, no disk I/O), so waiters in
  other processes wake within milliseconds of a commit without re-running their queries in a loop.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote, unquote

from celery_workflow._backend.migrations import check_version, migrations
from celery_workflow.errors import WorldError

BUSY_TIMEOUT_MS = 30_000
CHANGE_POLL = 0.005


def database_path(url: str) -> str:
    """The absolute database path of ``sqlite:////abs/path.db``, ``sqlite:///relative.db`` or a bare path.

    The form the SQLite World and the SQLite transport share; ValueError for another scheme, a host, a query string
    or an in-memory database (which other processes cannot open).
    """
    text = (url or "").strip()
    if "://" in text:
        scheme, rest = text.split("://", 1)
        if scheme.lower() != "sqlite":
            raise ValueError(f"a SQLite database needs a sqlite:// URL, got {url!r}")
        if not rest.startswith("/"):
            raise ValueError(f"use sqlite:///relative.db or sqlite:////abs/path.db (no host), got {url!r}")
        text = rest[1:]
    if "?" in text:
        raise ValueError(f"a SQLite database URL takes no query string: {url!r}")
    path = unquote(text)
    if not path or path == ":memory:" or path.startswith("file:"):
        raise ValueError(f"a SQLite database needs a file path, got {url!r}")
    return str(Path(path).expanduser().resolve())


def database_url(path: str) -> str:
    """The ``sqlite:////abs/path`` URL of an absolute path (percent-escaped): :func:`database_path` reads it back."""
    return "sqlite:///" + quote(path, safe="/")


def _statements(script: str) -> Iterator[str]:
    buf = ""
    for line in script.splitlines(keepends=True):
        buf += line
        if sqlite3.complete_statement(buf):
            if buf.strip():
                yield buf
            buf = ""
    if buf.strip() and not buf.strip().startswith("--"):
        yield buf


class Database:
    """A SQLite file shared by processes on one machine."""

    def __init__(self, path: str | os.PathLike[str], *, synchronous: str = "NORMAL", migrate: bool = True) -> None:
        self.path = str(Path(path).expanduser().resolve())
        self.synchronous = synchronous
        self._lock = threading.Lock()
        self._conns: dict[tuple[int, int], sqlite3.Connection] = {}
        self._orphans: list[sqlite3.Connection] = []  # connections inherited through fork: never used nor closed
        self._pid = os.getpid()
        if migrate:
            self.migrate()

    # -- connections ---------------------------------------------------------------------------------------------

    def connection(self) -> sqlite3.Connection:
        key = (os.getpid(), threading.get_ident())
        conn = self._conns.get(key)
        if conn is not None:
            return conn
        with self._lock:
            if self._pid != key[0]:  # forked: the parent's connections must not be touched here
                self._orphans.extend(self._conns.values())
                self._conns = {}
                self._pid = key[0]
            conn = self._open()
            self._conns[key] = conn
        return conn

    def _open(self) -> sqlite3.Connection:
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        try:  # a new file is the owner's alone (SQLite gives its -wal and -shm files the same mode)
            os.close(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            pass
        except OSError as exc:
            raise WorldError(f"cannot create SQLite database {self.path}: {exc}") from exc
        try:
            conn = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_MS / 1000
            )
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise WorldError(f"cannot put {self.path} in WAL mode (got {mode})")
            conn.execute(f"PRAGMA synchronous = {self.synchronous}")
            conn.execute("PRAGMA foreign_keys = ON")
        except sqlite3.Error as exc:
            raise WorldError(f"cannot open SQLite database {self.path}: {exc}") from exc
        return conn

    def close(self) -> None:
        with self._lock:
            if self._pid == os.getpid():
                for conn in self._conns.values():
                    conn.close()
            self._conns = {}

    # -- transactions --------------------------------------------------------------------------------------------

    @contextmanager
    def transaction(self, mode: str = "IMMEDIATE") -> Iterator[sqlite3.Connection]:
        """A write transaction (``BEGIN IMMEDIATE``); sqlite3 errors become WorldError."""
        conn = self.connection()
        try:
            conn.execute(f"BEGIN {mode}")
        except sqlite3.Error as exc:
            raise WorldError(f"SQLite: cannot begin a transaction: {exc}") from exc
        try:
            yield conn
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        try:
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise WorldError(f"SQLite: commit failed: {exc}") from exc

    @contextmanager
    def snapshot(self) -> Iterator[sqlite3.Connection]:
        """A read transaction: every statement inside sees the same committed state."""
        with self.transaction("DEFERRED") as conn:
            yield conn

    # -- change detection ----------------------------------------------------------------------------------------

    def data_version(self) -> int:
        return int(self.connection().execute("PRAGMA data_version").fetchone()[0])

    def wait_for_change(self, since: int, timeout: float) -> int:
        """Block until another connection commits (data_version differs from ``since``) or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while True:
            current = self.data_version()
            if current != since:
                return current
            left = deadline - time.monotonic()
            if left <= 0:
                return current
            time.sleep(min(CHANGE_POLL, left))

    # -- migrations ----------------------------------------------------------------------------------------------

    def migrate(self, *, up_to: int | None = None) -> int:
        """Apply missing migrations (those up to version ``up_to``, if given); return the schema version. Refuses a
        database newer than this library."""
        packaged = migrations("sqlite")
        known = [m for m in packaged if up_to is None or m.version <= up_to]
        with self.transaction("EXCLUSIVE") as conn:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS celery_workflow_schema_version ("
                " version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at INTEGER NOT NULL)"
            )
            row = conn.execute("SELECT COALESCE(MAX(version), 0) FROM celery_workflow_schema_version").fetchone()
            current = int(row[0])
            check_version(current, packaged, self.path)
            for version, name, sql in known:
                if version <= current:
                    continue
                for statement in _statements(sql):
                    conn.execute(statement)
                conn.execute(
                    "INSERT INTO celery_workflow_schema_version (version, name, applied_at) VALUES (?, ?, ?)",
                    (version, name, int(time.time() * 1_000_000)),
                )
            return max([current, *(m.version for m in known)])
