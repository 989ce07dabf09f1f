"""SQLite plumbing shared by the SQLite World and the SQLite transport: connections, transactions, migrations.

* One connection per (process, thread): safe across ``fork()`` (Celery's prefork pool) and threads.
* WAL mode, ``busy_timeout``; writes run in ``BEGIN IMMEDIATE`` transactions so writers queue instead of
  deadlocking on lock upgrades.
* Migrations (:mod:`celery_workflow._backend.migrations`): ``celery_workflow/sql/sqlite/NNNN_name.sql`` applied in
  order inside one exclusive transaction; a database newer than this library is refused.
* URLs: :func:`parse_database_url` reads the ``sqlite:///…[?prefix=…]`` form the World and the transport share
  (:func:`database_path` is its path alone), :func:`database_url` writes it.
* :meth:`Database.wait_for_change` polls ``PRAGMA data_version`` (a shared-memory read, no disk I/O), so waiters in
  other processes wake within milliseconds of a commit without re-running their queries in a loop.

Table prefix
============
``Database(path, prefix="app1_")`` (URL ``sqlite:///path.db?prefix=app1_``) gives every table and index the name
``app1_celery_workflow_…`` instead of ``celery_workflow_…``, so several apps (each a World and its transport) share
one file without seeing each other's runs, queues, bindings or consumers, as Postgres schemas isolate them there.
A prefix is 1 to 31 characters, a letter then letters, digits or ``_`` (``^[A-Za-z][A-Za-z0-9_]{0,30}$``); ``""``
is none. Each prefix is a database of its own in the file: its own ``…celery_workflow_schema_version`` table, its own
migrations (one prefix may be at a newer schema than another), its own rows; only the file's locks are shared.

The code and the migrations keep writing the unprefixed names. A prefixed Database opens :class:`PrefixedConnection`
(``factory=`` of ``sqlite3.connect``), whose ``execute`` / ``executemany`` / ``executescript`` and cursors rewrite each
statement before SQLite sees it (:func:`prefixed`, cached per statement text), so SQL added anywhere later is prefixed
with no change; an unprefixed Database opens plain ``sqlite3.Connection`` objects and pays nothing.

The rewrite: every name starting with ``celery_workflow_`` that is not the tail of a longer word (bare,
``"quoted"``, ``[bracketed]`` or qualified like ``h.``) gets the prefix; string literals (``'…'``, also inside
``X'…'``) and comments (``--…`` and ``/*…*/``) are copied unchanged. The rule that makes this safe: **data are
always bound parameters** (``?``), never spliced into SQL text; statements interpolate only names (tables, columns,
indexes) and placeholders, and their only literals are constants (``'hook_created'``, ``CHECK (status IN
('pending', …))``, ``DEFAULT '{}'``). Keep it that way, and never name a column, alias or function
``celery_workflow_…``: it would be prefixed too.
"""

from __future__ import annotations

import functools
import os
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self, TypeVar, overload
from urllib.parse import parse_qsl, quote, unquote

from celery_workflow._backend.migrations import check_version, migrations
from celery_workflow.errors import ConfigurationError, WorldError

if TYPE_CHECKING:
    from sqlite3 import _Parameters

BUSY_TIMEOUT_MS = 30_000
CHANGE_POLL = 0.005


def _journal_mode_wal(conn: sqlite3.Connection) -> str:
    """Put the file in WAL mode (a no-op when it is), retrying for up to ``BUSY_TIMEOUT_MS`` while it is locked.

    SQLite can answer ``database is locked`` here without calling the busy handler: a new connection does not yet know
    the file is in WAL mode, so the pragma takes the path that changes the mode, and the locks it meets while another
    process creates the file, runs WAL recovery, or (as the last connection) cleans up the WAL on close fail at once
    (https://www.sqlite.org/wal.html, "Sometimes queries return SQLITE_BUSY in WAL mode"). Two processes opening one
    new World at the same moment met it (a prefork worker and its web server do)."""
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    pause = 0.005
    while True:
        try:
            return str(conn.execute("PRAGMA journal_mode = WAL").fetchone()[0])
        except sqlite3.OperationalError as exc:
            busy = (getattr(exc, "sqlite_errorcode", 0) & 0xFF) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
            if not busy or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.25)


PREFIX = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,30}")
#: The query parameters a ``sqlite://`` URL may carry.
URL_PARAMETERS = ("prefix",)


def prefix_problem(prefix: str) -> str | None:
    """Why ``prefix`` is not a valid table prefix, or None when it is (``""`` is: no prefix)."""
    if not isinstance(prefix, str):
        return f"a table prefix is a string, got {prefix!r}"
    if prefix and PREFIX.fullmatch(prefix) is None:
        return f"invalid table prefix {prefix!r}: a letter, then up to 30 letters, digits or '_' (like 'app1_')"
    return None


def check_prefix(prefix: str) -> str:
    """``prefix`` if it is a valid table prefix (``""`` included), else ConfigurationError."""
    problem = prefix_problem(prefix)
    if problem is not None:
        raise ConfigurationError(problem)
    return prefix


def parse_database_url(url: str) -> tuple[str, str]:
    """``(absolute path, table prefix)`` of ``sqlite:////abs/path.db``, ``sqlite:///relative.db`` or a bare path,
    each optionally followed by ``?prefix=app1_`` (``""`` when absent).

    The form the SQLite World and the SQLite transport share; ValueError for another scheme, a host, any query
    parameter but one ``prefix``, an invalid prefix, or an in-memory database (which other processes cannot open).
    A ``?`` in the file name must be percent-escaped (``%3F``, as :func:`database_url` writes it).
    """
    text = (url or "").strip()
    if "://" in text:
        scheme, rest = text.split("://", 1)
        if scheme.lower() != "sqlite":
            raise ValueError(f"a SQLite database needs a sqlite:// URL, got {url!r}")
        if not rest.startswith("/"):
            raise ValueError(f"use sqlite:///relative.db or sqlite:////abs/path.db (no host), got {url!r}")
        text = rest[1:]
    prefix = ""
    if "?" in text:
        text, query = text.split("?", 1)
        try:
            pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=True)
        except ValueError:  # a field without "=", an empty field
            pairs = [("", "")]
        names = [name for name, _ in pairs]
        unknown = sorted({name for name in names if name not in URL_PARAMETERS})
        if unknown or not names or len(names) != len(set(names)):
            got = (
                f"unknown {', '.join(map(repr, unknown))}"
                if any(unknown)
                else f"an empty, malformed or repeated parameter in {query!r}"
            )
            raise ValueError(
                f"a SQLite database URL takes one query parameter, 'prefix' (like ?prefix=app1_), and nothing else:"
                f" {got} in {url!r}"
            )
        prefix = dict(pairs).get("prefix", "")
        problem = prefix_problem(prefix)
        if problem is not None:
            raise ValueError(f"{problem}, in {url!r}")
    path = unquote(text)
    if not path or path == ":memory:" or path.startswith("file:"):
        raise ValueError(f"a SQLite database needs a file path, got {url!r}")
    return str(Path(path).expanduser().resolve()), prefix


def database_path(url: str) -> str:
    """The absolute database path of a URL :func:`parse_database_url` reads (which see; its prefix is checked and
    dropped: code that opens the database needs both)."""
    return parse_database_url(url)[0]


def database_url(path: str, prefix: str = "") -> str:
    """The ``sqlite:////abs/path[?prefix=…]`` URL of an absolute path (percent-escaped) and a table prefix:
    :func:`parse_database_url` reads it back."""
    url = "sqlite:///" + quote(path, safe="/")
    return f"{url}?prefix={check_prefix(prefix)}" if prefix else url


# -- the table prefix ------------------------------------------------------------------------------------------------

# What a statement is made of, for the rewrite: a string literal or a comment (copied as they are) or a name to prefix.
# Two adjacent literals ('it''s') are one escaped literal to SQLite and two here: the same text is skipped either way.
_TOKENS = re.compile(r"('[^']*'?|--[^\n]*|/\*.*?(?:\*/|\Z))|\bcelery_workflow_", re.DOTALL)


@functools.lru_cache(maxsize=4096)
def prefixed(sql: str, prefix: str) -> str:
    """``sql`` with ``prefix`` before each ``celery_workflow_…`` name, literals and comments unchanged (see the
    module docstring for the rule that makes this safe)."""
    if not prefix:
        return sql
    return _TOKENS.sub(lambda m: m.group(1) or prefix + "celery_workflow_", sql)


_C = TypeVar("_C", bound=sqlite3.Cursor)


class PrefixedCursor(sqlite3.Cursor):
    """A cursor of a :class:`PrefixedConnection`: its statements are rewritten with the connection's prefix."""

    def _prefix(self) -> str:
        return str(getattr(self.connection, "prefix", ""))

    def execute(self, sql: str, parameters: _Parameters = (), /) -> Self:
        return super().execute(prefixed(sql, self._prefix()), parameters)

    def executemany(self, sql: str, seq_of_parameters: Iterable[_Parameters], /) -> Self:
        return super().executemany(prefixed(sql, self._prefix()), seq_of_parameters)

    def executescript(self, sql_script: str, /) -> sqlite3.Cursor:
        return super().executescript(prefixed(sql_script, self._prefix()))


class PrefixedConnection(sqlite3.Connection):
    """A connection whose every statement names the ``prefix``-ed tables (:func:`prefixed`).

    ``execute``, ``executemany`` and ``executescript`` run on a :class:`PrefixedCursor`, as do cursors from
    :meth:`cursor` (a ``factory`` must make PrefixedCursor objects: another cursor would run statements unchanged).
    """

    prefix: str = ""

    @overload
    def cursor(self, factory: None = None) -> PrefixedCursor: ...
    @overload
    def cursor(self, factory: Callable[[sqlite3.Connection], _C]) -> _C: ...
    def cursor(self, factory: Callable[[sqlite3.Connection], Any] | None = None) -> Any:
        if factory is None:
            return super().cursor(PrefixedCursor)
        cursor = super().cursor(factory)
        if not isinstance(cursor, PrefixedCursor):
            cursor.close()
            raise TypeError(f"a cursor of a prefixed connection must be a PrefixedCursor, got {type(cursor)!r}")
        return cursor

    def execute(self, sql: str, parameters: _Parameters = (), /) -> PrefixedCursor:
        return self.cursor().execute(sql, parameters)

    def executemany(self, sql: str, parameters: Iterable[_Parameters], /) -> PrefixedCursor:
        return self.cursor().executemany(sql, parameters)

    def executescript(self, sql_script: str, /) -> sqlite3.Cursor:
        return self.cursor().executescript(sql_script)


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
    """A SQLite file shared by processes on one machine; with ``prefix``, the tables of that prefix in it (see the
    module docstring). An invalid prefix raises ConfigurationError.

    Creating: a missing file is created (mode 0600) when ``create``, with its missing directories when ``parents``
    too (else a missing directory is a WorldError naming it: the transport's case, whose URL in a directory that is
    not there is a failed connection, not a new tree). With ``create=False`` the database must exist and hold this
    prefix's tables (a schema version): a missing file, or one without them, is a ConfigurationError naming the
    path, and nothing is created (what reads an existing World, like the command line's ``runs list``, opens it so).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        prefix: str = "",
        synchronous: str = "NORMAL",
        migrate: bool = True,
        create: bool = True,
        parents: bool = True,
    ) -> None:
        self.path = str(Path(path).expanduser().resolve())
        self.prefix = check_prefix(prefix)
        self.synchronous = synchronous
        self.create = create
        self.parents = parents
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

    def _create_file(self) -> None:
        """Create the database file unless it exists (see the class docstring for what may be created)."""
        path = Path(self.path)
        if path.exists():
            return
        if not self.create:
            raise ConfigurationError(
                f"no SQLite World at {self.path}: the file does not exist (check the URL; `celery-workflow --world"
                " URL migrate` creates a World)"
            )
        if not path.parent.is_dir():
            if not self.parents:
                raise WorldError(
                    f"cannot create SQLite database {self.path}: its directory {path.parent} does not exist"
                )
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise WorldError(f"cannot create the directory of SQLite database {self.path}: {exc}") from exc
        try:  # a new file is the owner's alone (SQLite gives its -wal and -shm files the same mode)
            os.close(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            pass
        except OSError as exc:
            raise WorldError(f"cannot create SQLite database {self.path}: {exc}") from exc

    def _open(self) -> sqlite3.Connection:
        self._create_file()
        try:
            conn = sqlite3.connect(
                f"file:{quote(self.path)}?mode={'rwc' if self.create else 'rw'}",
                uri=True,
                isolation_level=None,
                check_same_thread=False,
                timeout=BUSY_TIMEOUT_MS / 1000,
                factory=PrefixedConnection if self.prefix else sqlite3.Connection,
            )
            if isinstance(conn, PrefixedConnection):
                conn.prefix = self.prefix
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            mode = _journal_mode_wal(conn)
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
        database newer than this library. With a prefix, the prefix's own tables and version table."""
        packaged = migrations("sqlite")
        known = [m for m in packaged if up_to is None or m.version <= up_to]
        with self.transaction("EXCLUSIVE") as conn:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS celery_workflow_schema_version ("
                " version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at INTEGER NOT NULL)"
            )
            row = conn.execute("SELECT COALESCE(MAX(version), 0) FROM celery_workflow_schema_version").fetchone()
            current = int(row[0])
            if current == 0 and not self.create:  # a file, but no World in it: make none (this rolls back)
                tables = f"tables with the prefix {self.prefix!r}" if self.prefix else "tables"
                raise ConfigurationError(
                    f"no SQLite World at {self.path}: the file has no celery_workflow {tables} (check the URL;"
                    " `celery-workflow --world URL migrate` creates a World)"
                )
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
