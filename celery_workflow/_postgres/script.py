"""Statements sent together in one round trip (not part of the public API): :class:`Script` and its :class:`Result`.

Every write of the Postgres World and most of its reads are scripts: a few statements queued in Python, sent at
once in libpq's pipeline mode and answered together. A script speaks to libpq directly, through psycopg's
``pq`` layer, its adapters (:class:`psycopg.adapt.Transformer`) and its non-blocking wait: a statement costs the
dumping of its parameters and one ``Bind``/``Execute``, with none of the per-statement cursor machinery of
``Connection.execute`` (about three times the client CPU per statement, measured in ``bench/RESULTS.md``).
Statements with parameters are prepared once per connection (named ``_cw_<n>``: psycopg's own names are
``_pg3_<n>``) and the server plans each once per connection.
"""

from __future__ import annotations

import itertools
import re
from collections import deque
from collections.abc import Callable, Mapping, Sequence, Sized
from contextlib import suppress
from functools import lru_cache, partial
from typing import TYPE_CHECKING, Any

from psycopg import IsolationLevel, pq
from psycopg import errors as pg_errors
from psycopg.adapt import PyFormat, Transformer
from psycopg.generators import fetch_many, pipeline_communicate, send

from celery_workflow.errors import EventInvalid

if TYPE_CHECKING:
    import psycopg

__all__ = [
    "ISOLATION",
    "MAX_PARAMETERS",
    "Result",
    "Script",
    "commit_setting",
    "forget_prepared",
    "no_auto_prepare",
    "pin_isolation",
    "query",
]

_ATTRIBUTE = "_celery_workflow_prepared"
#: Set on a connection whose session defaults to :data:`ISOLATION` (the sessions of the pools PgDatabase opens).
_PINNED = "_celery_workflow_pinned"
#: The isolation every transaction of the World and the transport relies on: each statement sees what was committed
#: before it (a read after a lock sees the state under that lock; an insert that meets a row committed meanwhile
#: conflicts with it). A session may default to another (``default_transaction_isolation``, set by a DBA for a role
#: or a database): every transaction here says its own (issue #27, item 9).
ISOLATION = "READ COMMITTED"
_BEGIN = f"BEGIN ISOLATION LEVEL {ISOLATION}"
_PLACEHOLDER = re.compile(r"%(?:%|s|\((\w+)\)s)")
#: The largest script (bytes of parameters) sent in one go before its answers are read: well within the socket
#: buffers, so the server's answers can wait in them until the script is sent whole.
_ONE_SEND = 32768
_OK = (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK, pq.ExecStatus.EMPTY_QUERY)
#: The most parameters one statement may have: the protocol's Bind message counts them in 16 bits (libpq refuses
#: more with "number of parameters must be between 0 and 65535"). A script may hold any number of statements.
MAX_PARAMETERS = 65535


class Script:
    """Statements queued and sent together in pipeline mode: one round trip for all of them.

    Use it on an autocommit connection (``PgDatabase.run(..., transaction=False)``). Without ``BEGIN``, the
    statements of one :meth:`send` are one implicit transaction, committed when the server reaches the end of the
    script (or rolled back, if a statement fails). With ``BEGIN`` / ``COMMIT`` in the script itself, a transaction
    may span two sends, when its writes depend on what it read (read under lock, decide in Python, then write and
    commit). Each statement still gets its own snapshot (READ COMMITTED), so reads after a lock see the state under
    that lock. An error aborts the rest of the script (and the transaction it is in) and is raised by :meth:`send`.

    The isolation is :data:`ISOLATION` whatever the session's default: :meth:`begin` says it, and on a connection
    whose session is not pinned to it (a caller's pool, see :func:`pin_isolation`) a script sent outside a
    transaction is sent as ``BEGIN ISOLATION LEVEL READ COMMITTED`` … ``COMMIT`` (the same round trip).

    Placeholders are psycopg's: ``%s`` with a sequence of parameters, ``%(name)s`` with a mapping; ``%%`` is a
    percent sign in a statement that has parameters.
    """

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn
        self._queued: list[tuple[str, Any]] = []

    def add(self, sql: str, params: Any = None) -> int:
        """Queue one statement; return the index of its result in :meth:`send`'s answer. EventInvalid for a
        statement with more than :data:`MAX_PARAMETERS` parameters (split it: see ``rows.insert_rows``), before
        anything is sent."""
        if isinstance(params, Sized) and len(params) > MAX_PARAMETERS:
            raise EventInvalid(
                f"a statement with {len(params)} parameters; Postgres takes at most {MAX_PARAMETERS} per statement"
            )
        self._queued.append((sql, params))
        return len(self._queued) - 1

    def begin(self, mode: str = "", *, synchronous_commit: bool | None = None) -> None:
        """Queue ``BEGIN [mode]`` and, if given, this transaction's ``synchronous_commit`` (False: commit without
        waiting for the disk; True: on disk at commit, whatever the session says). A ``mode`` that names no
        isolation level gets :data:`ISOLATION`."""
        if "ISOLATION" in mode.upper():
            self.add(f"BEGIN {mode}")
        else:
            self.add(f"{_BEGIN}, {mode}" if mode else _BEGIN)
        if synchronous_commit is not None:
            self.add(f"SET LOCAL synchronous_commit = {'on' if synchronous_commit else 'off'}")

    def __len__(self) -> int:
        return len(self._queued)

    def send(self) -> list[Result]:
        """Send the queued statements at once and wait for all their answers; one :class:`Result` per statement."""
        if not self._queued:
            return []
        queued, self._queued = self._queued, []
        conn = self._conn
        if (
            not getattr(conn, _PINNED, False)
            and conn.pgconn.transaction_status == pq.TransactionStatus.IDLE
            and queued[0][0].lstrip()[:5].upper() != "BEGIN"
        ):
            # one implicit transaction on a session that may default to another isolation: say it (see the class)
            try:
                return _Prepared.of(conn).run(conn, [(_BEGIN, None), *queued, ("COMMIT", None)])[1:-1]
            except BaseException:
                if not conn.closed and conn.pgconn.transaction_status != pq.TransactionStatus.IDLE:
                    with suppress(pg_errors.Error):  # as an implicit transaction would: nothing of it stays
                        conn.rollback()
                raise
        return _Prepared.of(conn).run(conn, queued)


class Result:
    """The rows and row count of one statement of a :class:`Script`."""

    __slots__ = ("rowcount", "rows")

    def __init__(self, rows: list[Any], rowcount: int) -> None:
        self.rows = rows
        self.rowcount = rowcount

    def one(self) -> Any:
        return self.rows[0] if self.rows else None


def query(conn: psycopg.Connection[Any], sql: str, params: Any = None) -> Result:
    """Run one statement as a script (prepared on the connection, when it has parameters); its result."""
    script = Script(conn)
    script.add(sql, params)
    return script.send()[0]


def commit_setting(durable: bool) -> tuple[str, tuple[str]]:
    """The statement (and its parameter, for :meth:`Script.add`) that makes the transaction it is in commit on disk
    (True) or without waiting for the disk (False), whatever the session says. It lasts to that commit, also in a
    script's implicit transaction (where ``SET LOCAL`` would warn that it is outside a transaction block, though it
    works)."""
    return "SELECT set_config('synchronous_commit', %s, true)", ("on" if durable else "off",)


def pin_isolation(conn: psycopg.Connection[Any]) -> str:
    """Record that ``conn``'s session defaults to :data:`ISOLATION` and make psycopg's own transactions
    (``conn.transaction()``) say it; return the statement that sets the session's default, for the caller to run
    (the session settings of a pool PgDatabase opens)."""
    conn.isolation_level = IsolationLevel.READ_COMMITTED
    setattr(conn, _PINNED, True)
    return f"SET default_transaction_isolation = '{ISOLATION.lower()}'"


def no_auto_prepare(conn: psycopg.Connection[Any]) -> None:
    """Leave preparing statements on ``conn`` to scripts: psycopg prepares a statement run often
    (``prepare_threshold``) and, when it rolls back a transaction while it holds statements of its own, deallocates
    every statement of the connection (``DEALLOCATE ALL``), the scripts' too."""
    conn.prepare_threshold = None


def forget_prepared(conn: psycopg.Connection[Any]) -> None:
    """Forget what ``conn`` prepared for scripts (after ``DISCARD ALL`` or ``DEALLOCATE ALL`` on it)."""
    if hasattr(conn, _ATTRIBUTE):
        delattr(conn, _ATTRIBUTE)


@lru_cache(maxsize=512)
def _convert(sql: str) -> tuple[bytes, tuple[str, ...] | None]:
    """``sql`` with its placeholders numbered (``$1``, ``$2`` …) and, unless they are positional, the names of its
    ``%(name)s`` placeholders in parameter order (a mapping may name more; a statement without placeholders takes
    either)."""
    names: dict[str, int] = {}
    positional = 0

    def number(match: re.Match[str]) -> str:
        nonlocal positional
        text, name = match.group(0), match.group(1)
        if text == "%%":
            return "%"
        if name is None:
            positional += 1
            return f"${positional}"
        return f"${names.setdefault(name, len(names) + 1)}"

    query = _PLACEHOLDER.sub(number, sql)
    if positional and names:
        raise TypeError("a statement cannot mix %s and %(name)s placeholders")
    return query.encode(), (None if positional else tuple(names))


def _values(params: Any, names: tuple[str, ...] | None) -> Sequence[Any]:
    if isinstance(params, Mapping):
        if names is None:
            raise TypeError("a statement with %s placeholders takes a sequence of parameters")
        return [params[name] for name in names]
    if names:
        raise TypeError("a statement with %(name)s placeholders takes a mapping of parameters")
    return params if isinstance(params, (list, tuple)) else tuple(params)


class _Prepared:
    """What one connection prepared for scripts, and the adapters that dump their parameters and load their rows."""

    __slots__ = ("encoding", "names", "numbers", "transformer")

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.names: dict[tuple[bytes, tuple[int, ...]], bytes] = {}
        self.numbers = itertools.count()  # a name is never reused on its connection
        self.transformer = Transformer(conn)
        self.encoding = conn.info.encoding

    @classmethod
    def of(cls, conn: psycopg.Connection[Any]) -> _Prepared:
        found: _Prepared | None = getattr(conn, _ATTRIBUTE, None)
        if found is None:
            no_auto_prepare(conn)
            found = cls(conn)
            setattr(conn, _ATTRIBUTE, found)
        return found

    def run(self, conn: psycopg.Connection[Any], queued: list[tuple[str, Any]]) -> list[Result]:
        pgconn = conn.pgconn
        dump = self.transformer.dump_sequence
        commands: deque[Callable[[], None]] = deque()
        # what each command answers: the index of its statement, or the key of a statement it prepares
        answers: list[int | tuple[bytes, tuple[int, ...]]] = []
        size = 0  # bytes of parameters
        for index, (sql, params) in enumerate(queued):
            if params is None:
                commands.append(partial(pgconn.send_query_params, sql.encode(), None))
                answers.append(index)
                continue
            query, names = _convert(sql)
            values = _values(params, names)
            dumped = dump(values, [PyFormat.AUTO] * len(values))
            size += sum(map(len, filter(None, dumped)))
            types = tuple(self.transformer.types or ())
            key = (query, types)
            name = self.names.get(key)
            if name is None:
                name = self.names[key] = f"_cw_{next(self.numbers)}".encode()
                commands.append(partial(pgconn.send_prepare, name, query, types))
                answers.append(key)
            commands.append(partial(pgconn.send_query_prepared, name, dumped, self.transformer.formats))
            answers.append(index)
        commands.append(pgconn.pipeline_sync)
        with conn.lock:
            pgconn.enter_pipeline_mode()
            try:
                if size <= _ONE_SEND:
                    # All at once: libpq keeps the commands in its buffer until the sync flushes them, so the server
                    # gets one packet and runs the script without waiting for the next statement to arrive
                    for command in commands:
                        command()
                    conn.wait(send(pgconn))
                    results: list[Any] = []
                else:  # a large script is sent while the answers are read (neither side's buffer fills up)
                    results = [r for rs in conn.wait(pipeline_communicate(pgconn, commands)) for r in rs]
                while not results or results[-1].status != pq.ExecStatus.PIPELINE_SYNC:
                    results.extend(conn.wait(fetch_many(pgconn)))
            except BaseException:
                self.names.clear()  # the connection is likely broken; if not, the server may lack some names
                with suppress(pg_errors.Error):  # uncollected results: the connection goes back broken
                    pgconn.exit_pipeline_mode()
                raise
            pgconn.exit_pipeline_mode()
        return self._answer(queued, answers, results)

    def _answer(
        self, queued: list[tuple[str, Any]], answers: list[int | tuple[bytes, tuple[int, ...]]], results: list[Any]
    ) -> list[Result]:
        out: list[Result] = []
        error: pg_errors.Error | None = None
        for answer, res in zip(answers, results, strict=False):
            status = res.status
            if status not in _OK:
                if isinstance(answer, tuple):
                    self.names.pop(answer, None)  # not prepared (failed, or skipped after an error)
                if error is None and status == pq.ExecStatus.FATAL_ERROR:
                    error = pg_errors.error_from_result(res, encoding=self.encoding)
                continue
            if isinstance(answer, tuple):
                continue
            rows: list[Any] = []
            if status == pq.ExecStatus.TUPLES_OK and res.ntuples:
                self.transformer.set_pgresult(res)
                rows = self.transformer.load_rows(0, res.ntuples, tuple)
            rowcount = res.command_tuples
            out.append(Result(rows, -1 if rowcount is None else rowcount))
        if error is not None:
            if isinstance(error, pg_errors.InvalidSqlStatementName):
                self.names.clear()  # someone deallocated what this connection prepared (DISCARD ALL)
            raise error
        if len(out) != len(queued):  # pragma: no cover - libpq answers every command of a pipeline
            raise pg_errors.InterfaceError(f"a script of {len(queued)} statements got {len(out)} answers")
        return out
