"""The SQLite World's tables and how views are stored in them (not part of the public API).

:data:`TABLES` is what the code expects of each table (columns, keys, indexes; the migration test compares the schema
with it); the view tables follow :data:`celery_workflow._backend.records.VIEW_COLUMNS`. Times are integer
microseconds since the epoch (UTC), JSON values codec-tagged BLOBs, flags integers.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from celery_workflow import ids
from celery_workflow._backend.records import RecordCodec, world_tables
from celery_workflow._backend.schedules_sql import schedule_table
from celery_workflow.errors import WorldError
from celery_workflow.rules import RetainedToken

__all__ = ["CODEC", "COLUMNS", "TABLES"]

#: The World's tables as the code expects them (the migration test compares the migrated schema with this).
TABLES = {
    **world_tables(
        write_id=False,
        indexes={
            "celery_workflow_runs": {
                "celery_workflow_runs_created": False,
                "celery_workflow_runs_workflow": False,
                "celery_workflow_runs_status": False,
            },
            "celery_workflow_events": {"celery_workflow_events_correlation": False},
            "celery_workflow_hook_tokens": {"celery_workflow_hook_tokens_hook": False},
        },
    ),
    **schedule_table(),
}
#: The columns the code reads and writes, per table, in table order.
COLUMNS: dict[str, tuple[str, ...]] = {name: table.columns for name, table in TABLES.items()}

CODEC = RecordCodec(time_out=ids.to_micros, time_in=ids.from_micros, flag_out=int, flag_in=bool)

RUN = ", ".join(COLUMNS["celery_workflow_runs"])
EVENT = ", ".join(COLUMNS["celery_workflow_events"])
STEP = ", ".join(COLUMNS["celery_workflow_steps"])
HOOK = ", ".join(COLUMNS["celery_workflow_hooks"])
WAIT = ", ".join(COLUMNS["celery_workflow_waits"])
HOOK_H = ", ".join(f"h.{c}" for c in COLUMNS["celery_workflow_hooks"])
#: A live hook by token: its token row joined with the hook (``%s`` takes the condition on ``t.token``).
HOOK_BY_TOKEN = (
    f"SELECT {HOOK_H} FROM celery_workflow_hook_tokens AS t JOIN celery_workflow_hooks AS h"
    " ON h.run_id = t.run_id AND h.hook_id = t.hook_id WHERE t.token {}"
)
#: Tokens that ended runs retain (their hooks are gone; see :mod:`celery_workflow.rules`): the token row's run,
#: hook, token and retention end (``{}`` takes the condition on ``t.token``).
RETAINED_BY_TOKEN = (
    "SELECT t.run_id, t.hook_id, t.token, t.retain_until FROM celery_workflow_hook_tokens AS t"
    " WHERE t.token {} AND NOT EXISTS (SELECT 1 FROM celery_workflow_hooks AS h"
    " WHERE h.run_id = t.run_id AND h.hook_id = t.hook_id)"
)
_CHUNK = 500  # keys per IN (...) list


def retained_token(row: Sequence[Any]) -> RetainedToken:
    """A :data:`RETAINED_BY_TOKEN` row; a row without a retention end (left over) is over already."""
    run_id, hook_id, token, until = row
    return RetainedToken(run_id, hook_id, token, ids.from_micros(0 if until is None else int(until)))


def marks(n: int) -> str:
    return ", ".join("?" * n)


def chunked(keys: Iterable[str]) -> Iterator[list[str]]:
    """``keys`` sorted, in lists short enough for one ``IN (...)``."""
    items = sorted(keys)
    for i in range(0, len(items), _CHUNK):
        yield items[i : i + _CHUNK]


def insert(conn: sqlite3.Connection, table: str, row: dict[str, Any]) -> None:
    conn.execute(f"INSERT INTO {table} ({', '.join(row)}) VALUES ({marks(len(row))})", tuple(row.values()))


def update(
    conn: sqlite3.Connection, table: str, row: dict[str, Any], columns: Sequence[str], key: Sequence[str]
) -> None:
    """UPDATE ``columns`` of the row of ``table`` whose ``key`` columns match ``row``."""
    conn.execute(
        f"UPDATE {table} SET {', '.join(f'{c} = ?' for c in columns)} WHERE {' AND '.join(f'{k} = ?' for k in key)}",
        (*(row[c] for c in columns), *(row[k] for k in key)),
    )


@contextmanager
def sqlite_errors() -> Iterator[None]:
    """Raise sqlite3 errors as WorldError (the driver error is ``__cause__``)."""
    try:
        yield
    except sqlite3.Error as exc:
        raise WorldError(f"SQLite World: {exc}") from exc
