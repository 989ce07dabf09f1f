"""PostgreSQL plumbing shared by the Postgres World and the Postgres transport.

* :class:`PgDatabase` wraps a psycopg pool. A pool it opened itself (:meth:`PgDatabase.open`) is re-created in a
  forked child (Celery's prefork pool forks after the app module imported it), so no socket is shared across
  processes; a caller's pool is the caller's to manage.
* :meth:`PgDatabase.run` runs a function in one transaction and retries it on serialization failures, deadlocks and
  lost connections (a restarted server), with jittered backoff; what still fails is raised as WorldError
  (:class:`~celery_workflow.errors.WorldUnavailable` when the server could not be reached or did not answer). Pooled
  connections are in autocommit mode, so a single statement costs one round trip (``run(..., transaction=False)``)
  and :class:`Script` sends a whole transaction (``BEGIN`` … ``COMMIT``, prepared statements) as one or two round
  trips. Every transaction is READ COMMITTED whatever the session's default (``default_transaction_isolation``
  set for a role or database): the pools opened here set it per session, and on a caller's pool each transaction
  says it (see :data:`celery_workflow._postgres.script.ISOLATION`).
* ``unavailable_timeout`` bounds a whole :meth:`PgDatabase.run` call, retries included, when the server is
  unreachable or stops answering (see :class:`PgDatabase`): libpq's ``connect_timeout``, the wait for a pooled
  connection, the retry loop, and a watchdog (:class:`Watchdog`) that breaks the socket of a call still running at
  its deadline, which is the only thing that ends a wait on a server that accepted the connection and went silent
  (TCP keeps acknowledging a hung server's socket). The call then raises WorldUnavailable.
* Migrations (:mod:`celery_workflow._backend.migrations`): ``celery_workflow/sql/postgres/NNNN_name.sql`` applied in
  one transaction under ``pg_advisory_xact_lock``; a database newer than this library is refused with
  :class:`~celery_workflow.errors.SchemaVersionError`. Tables go to the connection's ``search_path``.
* :attr:`PgDatabase.listener`: the process's one ``LISTEN`` connection (:mod:`celery_workflow._postgres.listener`).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, TypeVar

import psycopg  # the package's __init__ says what to install when it is missing
from psycopg import errors as pg_errors
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.pq import TransactionStatus
from psycopg_pool import ConnectionPool, PoolTimeout

from celery_workflow._backend.migrations import check_version, migrations
from celery_workflow._postgres.listener import Listener
from celery_workflow._postgres.script import no_auto_prepare, pin_isolation
from celery_workflow.errors import ConfigurationError, EventInvalid, WorldError, WorldUnavailable

log = logging.getLogger("celery_workflow.postgres")

T = TypeVar("T")

#: Key of the advisory lock that serialises migrations across processes.
MIGRATION_LOCK = 0x63656C7779  # "celwy"
# InvalidSqlStatementName: what a connection prepared was deallocated under it (a pool's DISCARD ALL); a script
# forgets its names on it, so the next attempt prepares them again.
_RETRYABLE = (
    pg_errors.SerializationFailure,
    pg_errors.DeadlockDetected,
    pg_errors.LockNotAvailable,
    pg_errors.InvalidSqlStatementName,
)


class PgDatabase:
    """A psycopg connection pool plus retrying transactions, migrations and a per-process listener.

    ``unavailable_timeout`` (seconds; None: no bound, as the Postgres transport's database has it): the longest a
    :meth:`run` call takes, retries included, when the server refuses connections, does not answer or stops answering
    in the middle of a call; it then raises :class:`~celery_workflow.errors.WorldUnavailable`. It also becomes the
    connections' ``connect_timeout`` (libpq's minimum is 2 s) and ``tcp_user_timeout``, with TCP keepalives, unless the
    connection string sets them; a pool opened here gives up a reconnection attempt after that long (so that, once the
    server is back, the next call opens a connection at once instead of waiting out a long backoff). A call whose
    deadline passes while a statement runs has its connection broken: whether its transaction committed is then
    unknown, exactly as when the server goes away during ``COMMIT`` (the World's writes recognise their own commit
    on retry).
    """

    def __init__(
        self,
        pool: ConnectionPool | None = None,
        *,
        url: str | None = None,
        min_size: int = 1,
        max_size: int = 10,
        retries: int = 8,
        timeout: float = 30.0,
        lazy_commits: bool = False,
        unavailable_timeout: float | None = None,
    ) -> None:
        """``lazy_commits``: the sessions of a pool opened here commit without waiting for the disk
        (``synchronous_commit = off``); statements that must be durable say so (``SET LOCAL``)."""
        if pool is None and url is None:
            raise ConfigurationError("PgDatabase needs a pool or a URL")
        if unavailable_timeout is not None and not unavailable_timeout > 0:
            raise ConfigurationError("unavailable_timeout must be positive (or None: no bound)")
        self.url = url
        self.min_size = min_size
        self.max_size = max_size
        self.retries = retries
        self.timeout = timeout  # longest wait for a pooled connection (an outage fails fast, then retries)
        self.unavailable_timeout = unavailable_timeout
        self.lazy_commits = lazy_commits and pool is None
        self._own = pool is None
        self._pool = pool
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._listener: Listener | None = None
        self._watchdog: Watchdog | None = None

    @classmethod
    def open(
        cls,
        url: str,
        *,
        min_size: int = 1,
        max_size: int = 10,
        timeout: float = 30.0,
        unavailable_timeout: float | None = None,
    ) -> PgDatabase:
        return cls(
            url=url, min_size=min_size, max_size=max_size, timeout=timeout, unavailable_timeout=unavailable_timeout
        )

    @property
    def conninfo(self) -> str:
        if self.url is not None:
            return self.url
        assert self._pool is not None
        return str(self._pool.conninfo)

    @property
    def dial_conninfo(self) -> str:
        """The connection string this process connects with: :attr:`conninfo` plus the timeouts ``unavailable_timeout``
        implies (see the class docstring), where the string does not set them."""
        return bounded_conninfo(self.conninfo, self.unavailable_timeout)

    @property
    def pool(self) -> ConnectionPool:
        pid = os.getpid()
        if self._pool is not None and (self._pid == pid or not self._own):
            return self._pool
        with self._lock:
            if self._pool is None or (self._own and self._pid != pid):
                # a pool inherited through fork is abandoned, never closed here: its sockets belong to the parent
                limit = self.unavailable_timeout
                self._pool = ConnectionPool(
                    self.dial_conninfo,
                    kwargs={"autocommit": True},  # BEGIN only where a transaction is asked for
                    configure=_lazy_session if self.lazy_commits else _session,
                    min_size=self.min_size,
                    max_size=self.max_size,
                    timeout=self.timeout,
                    reconnect_timeout=300.0 if limit is None else max(limit, 2.0),
                    open=True,
                    name="celery_workflow",
                )
                self._pid = pid
                self._listener = None
                self._watchdog = None
        return self._pool

    def resize(self, max_size: int) -> None:
        """At most ``max_size`` connections in this process's pool from now on, when the pool is this object's own
        (a forked child's pool, opened on first use, takes it too)."""
        if not self._own or max_size < 1:
            return
        with self._lock:
            self.max_size = max_size
            self.min_size = min(self.min_size, max_size)
            if self._pool is not None and self._pid == os.getpid():
                self._pool.resize(self.min_size, max_size)

    def close(self) -> None:
        if self._listener is not None and self._pid == os.getpid():
            self._listener.close()
            self._listener = None
        if self._watchdog is not None and self._pid == os.getpid():
            self._watchdog.stop()
            self._watchdog = None
        if self._own and self._pool is not None and self._pid == os.getpid():
            self._pool.close()
            self._pool = None

    # -- transactions --------------------------------------------------------------------------------------------

    def run(
        self,
        fn: Callable[[psycopg.Connection[Any]], T],
        *,
        what: str = "transaction",
        transaction: bool = True,
        watch: bool = True,
    ) -> T:
        """Run ``fn(conn)`` in one transaction; retry on serialization failures, deadlocks and lost connections.

        ``transaction=False``: ``fn`` gets the connection in autocommit mode, to run one statement (one round trip,
        atomic by itself) or to manage its own transaction with a :class:`Script`; a transaction it leaves open
        (after an error) is rolled back.

        ``fn`` must be safe to run again (it is, when all its effects are inside the transaction). Errors that are
        celery_workflow errors (rule violations) propagate unchanged; driver errors become WorldError, and
        WorldUnavailable when no connection could be had or kept: the server refused or did not answer, or the call
        outlived ``unavailable_timeout`` (see the class docstring). ``watch=False`` (migrations, whose statements may
        legitimately take long): the bound applies to getting a connection and to the retries, not to ``fn``.
        """
        limit = self.unavailable_timeout
        deadline = None if limit is None else time.monotonic() + limit
        delay = 0.005
        attempt = 0
        while True:
            attempt += 1
            try:
                wait = self.timeout if deadline is None else min(self.timeout, deadline - time.monotonic())
                if wait <= 0:
                    raise PoolTimeout("the call's deadline passed before a connection was free")
                with (
                    self.pool.connection(timeout=wait) as conn,
                    self._watched(conn, deadline if watch else None),
                ):
                    if transaction:
                        with _read_committed(conn), conn.transaction():
                            return fn(conn)
                    return _autocommit(conn, fn)
            except (psycopg.DataError, pg_errors.ProgramLimitExceeded) as exc:
                # the server refuses the data itself (an untranslatable character, a value out of range, a key too
                # long for its index): refused again if retried, so bad input rather than an outage
                raise EventInvalid(f"Postgres {what}: the data was refused: {exc}") from exc
            except _RETRYABLE as exc:
                if attempt >= self.retries:
                    raise WorldError(f"Postgres {what}: gave up after {attempt} attempts: {exc}") from exc
                error: psycopg.Error = exc
            except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
                if deadline is not None and time.monotonic() >= deadline:
                    raise WorldUnavailable(f"Postgres {what}: no answer within {limit:g} s ({exc})") from exc
                if attempt >= self.retries:
                    raise WorldUnavailable(f"Postgres {what}: {exc}") from exc
                log.warning("Postgres %s failed (%s); retrying", what, exc)
                if not isinstance(exc, PoolTimeout):
                    # the server may have restarted: every idle connection is likely dead too. Replace them without
                    # a round trip (checking them would wait on a server that may not answer).
                    self.pool.drain()
                delay = max(delay, 0.1)
                error = exc
            except psycopg.Error as exc:
                raise WorldError(f"Postgres {what}: {exc}") from exc
            pause = delay * (0.5 + random.random())
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorldUnavailable(f"Postgres {what}: no answer within {limit:g} s ({error})") from error
                pause = min(pause, left)
            time.sleep(pause)
            delay = min(delay * 2, 2.0)

    def _watched(self, conn: psycopg.Connection[Any], deadline: float | None) -> AbstractContextManager[None]:
        """A context in which ``conn``'s socket is broken if it is still in use at ``deadline``."""
        if deadline is None:
            return nullcontext()
        watchdog = self._watchdog
        if watchdog is None or watchdog.pid != os.getpid():  # a forked child starts its own thread
            with self._lock:
                if self._watchdog is None or self._watchdog.pid != os.getpid():
                    self._watchdog = Watchdog()
                watchdog = self._watchdog
        return watchdog.watching(conn, deadline)

    # -- migrations ----------------------------------------------------------------------------------------------

    def migrate(self, *, up_to: int | None = None) -> int:
        """Apply missing migrations (those up to version ``up_to``, if given) under an advisory lock; return the
        schema version."""
        packaged = migrations("postgres")
        known = [m for m in packaged if up_to is None or m.version <= up_to]

        def apply(conn: psycopg.Connection[Any]) -> int:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
            conn.execute(
                "CREATE TABLE IF NOT EXISTS celery_workflow_schema_version ("
                " version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
            )
            row = conn.execute("SELECT COALESCE(MAX(version), 0) FROM celery_workflow_schema_version").fetchone()
            current = int(row[0]) if row else 0
            check_version(current, packaged, "the database")
            for version, name, sql in known:
                if version > current:
                    conn.execute(sql.encode())  # no parameters: several statements run as one script
                    conn.execute(
                        "INSERT INTO celery_workflow_schema_version (version, name) VALUES (%s, %s)", (version, name)
                    )
            return max([current, *(m.version for m in known)])

        return self.run(apply, what="migration", watch=False)

    # -- notifications -------------------------------------------------------------------------------------------

    def listening_mark(self, channel: str, key: str | None = None) -> tuple[int, int] | None:
        """:meth:`Listener.mark` if this process listens on ``channel`` already (None: it does not; nothing is
        started)."""
        listener = self._listener
        if listener is None or self._pid != os.getpid() or not listener.listens(channel):
            return None
        return listener.mark(channel, key)

    @property
    def listener(self) -> Listener:
        _ = self.pool  # re-creates per-process state after a fork
        with self._lock:
            if self._listener is None:
                limit = self.unavailable_timeout
                self._listener = Listener(self.dial_conninfo, ready_timeout=5.0 if limit is None else min(5.0, limit))
            return self._listener


#: Session settings of the pools PgDatabase opens. The statements that run often are scripts, prepared on each
#: connection (see celery_workflow._postgres.script), and look rows up by key; a generic plan serves them all, where
#: the default would plan most of them anew on every execution (their custom plans look cheaper), which costs more
#: than running them.
#: They also default to READ COMMITTED, whatever the role or database says (see script.ISOLATION), so that their
#: transactions need not say it.
_SESSION = "SET plan_cache_mode = force_generic_plan"


def _session(conn: psycopg.Connection[Any]) -> None:
    no_auto_prepare(conn)
    conn.execute(f"{_SESSION}; {pin_isolation(conn)}")


def _lazy_session(conn: psycopg.Connection[Any]) -> None:
    no_auto_prepare(conn)
    conn.execute(f"{_SESSION}; {pin_isolation(conn)}; SET synchronous_commit = off")


@contextmanager
def _read_committed(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """psycopg's transactions on ``conn`` begin READ COMMITTED meanwhile (``BEGIN ISOLATION LEVEL …``, no extra
    round trip); a caller's connection gets its own setting back."""
    before = conn.isolation_level
    if before == psycopg.IsolationLevel.READ_COMMITTED:
        yield
        return
    conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
    try:
        yield
    finally:
        if not conn.closed:
            conn.isolation_level = before


def _autocommit(conn: psycopg.Connection[Any], fn: Callable[[psycopg.Connection[Any]], T]) -> T:
    """``fn(conn)`` with ``conn`` in autocommit mode (a caller's pool may hand out others); never leaves a
    transaction open."""
    switched = not conn.autocommit
    if switched:
        conn.autocommit = True
    try:
        return fn(conn)
    finally:
        if not conn.closed and conn.info.transaction_status != TransactionStatus.IDLE:
            conn.rollback()
        if switched and not conn.closed:
            conn.autocommit = False


def bounded_conninfo(conninfo: str, limit: float | None) -> str:
    """``conninfo`` with the connection timeouts a call bound of ``limit`` seconds implies, where neither it nor
    ``PGCONNECT_TIMEOUT`` sets them: ``connect_timeout`` (whole seconds, at least libpq's 2), ``tcp_user_timeout``
    (unacknowledged data for that long closes the connection) and TCP keepalives (an idle connection, such as the
    LISTEN one, notices a vanished peer). None: ``conninfo`` unchanged."""
    if limit is None:
        return conninfo
    given = conninfo_to_dict(conninfo)
    if os.environ.get("PGCONNECT_TIMEOUT"):  # libpq's environment sets it: leave it be
        given["connect_timeout"] = os.environ["PGCONNECT_TIMEOUT"]
    wanted: dict[str, Any] = {
        "connect_timeout": max(2, math.ceil(limit)),
        "tcp_user_timeout": max(1000, round(limit * 1000)),
        "keepalives": 1,
        "keepalives_idle": max(1, math.ceil(limit)),
        "keepalives_interval": max(1, math.ceil(limit / 3)),
        "keepalives_count": 3,
    }
    extra = {k: v for k, v in wanted.items() if k not in given}
    return make_conninfo(conninfo, **extra) if extra else conninfo


class Watchdog:
    """Breaks the socket of a connection that is still in use at its deadline (one daemon thread, started on first
    use, asleep while nothing is watched).

    Breaking is ``shutdown(SHUT_RDWR)`` on the socket (through a duplicate of its descriptor): a thread blocked
    reading or writing it gets an error at once, psycopg marks the connection broken and the pool discards it. A
    watch ends before its connection goes back to the pool (:meth:`watching`), and the break happens under the same
    lock, so a connection that has moved on is never touched. Deadlines are honoured to :data:`GRAIN` seconds, so a
    busy process wakes the thread at most ``1 / GRAIN`` times a second.
    """

    GRAIN = 0.05

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, list[Any]]] = []  # (deadline, order, [connection or None])
        self._order = itertools.count()
        self._stopped = False
        self.pid = os.getpid()
        self.broken = 0  # connections broken so far (for tests and monitoring)
        self._thread = threading.Thread(target=self._loop, name="celery_workflow-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def watching(self, conn: psycopg.Connection[Any], deadline: float) -> Iterator[None]:
        entry: list[Any] = [conn]
        with self._cond:
            heapq.heappush(self._heap, (deadline, next(self._order), entry))
            if self._heap[0][2] is entry:
                self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                entry[0] = None  # left in the heap until its time (cheaper than removing it)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _loop(self) -> None:
        with self._cond:
            while not self._stopped:
                now = time.monotonic()
                while self._heap and self._heap[0][0] <= now:
                    _, _, entry = heapq.heappop(self._heap)
                    if entry[0] is not None:
                        _break(entry[0])
                        entry[0] = None
                        self.broken += 1
                if self._heap:
                    self._cond.wait(max(self._heap[0][0] - now, self.GRAIN))
                else:
                    self._cond.wait()


def _break(conn: psycopg.Connection[Any]) -> None:
    """Shut ``conn``'s socket down in both directions (its descriptor stays open: psycopg closes it)."""
    try:
        fd = conn.pgconn.socket
    except psycopg.Error:  # already closed
        return
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()
    log.warning("Postgres call still running at its deadline: its connection was broken")
