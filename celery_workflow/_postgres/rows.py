"""The Postgres World's tables and how views are stored in them (not part of the public API).

:data:`TABLES` is what the code expects of each table (columns, keys, indexes; the migration test compares the catalog
with it); the view tables follow :data:`celery_workflow._backend.records.VIEW_COLUMNS`. JSON values are
codec-tagged ``bytea``, times ``timestamptz`` (read back as UTC), enums their text values. ``write_id`` tags the
events and stream chunks one call wrote, so a retry after a lost answer recognises its own committed write.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from celery_workflow._backend.records import EVENT_COLUMNS, RecordCodec, world_tables
from celery_workflow._backend.schedules_sql import schedule_table
from celery_workflow._postgres.script import MAX_PARAMETERS, Script
from celery_workflow.events import Event

__all__ = ["CODEC", "COLUMNS", "MAX_INSERT_ROWS", "TABLES", "insert_rows"]

#: The World's tables as the code expects them (the migration test compares the migrated catalog with this).
TABLES = {
    **world_tables(
        write_id=True,
        indexes={
            "celery_workflow_runs": {
                "celery_workflow_runs_created": False,
                "celery_workflow_runs_workflow": False,
                "celery_workflow_runs_status": False,
                "celery_workflow_runs_completed": False,
            },
            "celery_workflow_events": {
                "celery_workflow_events_created": True,
                "celery_workflow_events_hook_created": True,
            },
            "celery_workflow_hook_tokens": {"celery_workflow_hook_tokens_hook": False},
        },
    ),
    **schedule_table(),
}
#: The columns the code reads and writes, per table, in table order.
COLUMNS: dict[str, tuple[str, ...]] = {name: table.columns for name, table in TABLES.items()}


def _utc(stored: datetime) -> datetime:
    """A ``timestamptz`` as an aware UTC datetime (psycopg returns the session's time zone)."""
    return stored.astimezone(UTC)


CODEC = RecordCodec(time_in=_utc)  # times are stored as they are (timestamptz)

RUN = ", ".join(COLUMNS["celery_workflow_runs"])
EVENT = ", ".join(EVENT_COLUMNS)  # the columns of an Event (write_id is the World's)
STEP = ", ".join(COLUMNS["celery_workflow_steps"])
HOOK = ", ".join(COLUMNS["celery_workflow_hooks"])
WAIT = ", ".join(COLUMNS["celery_workflow_waits"])
HOOK_H = ", ".join(f"h.{c}" for c in COLUMNS["celery_workflow_hooks"])
TABLE = {"steps": "celery_workflow_steps", "hooks": "celery_workflow_hooks", "waits": "celery_workflow_waits"}

#: First key of the two-key advisory locks that stand for hook tokens (a key space of its own: the one-key
#: ``bigint`` advisory locks, such as the migration lock, never collide with two-key ones).
TOKEN_LOCK_SPACE = 0x63770001


def token_lock_keys(tokens: Sequence[str] | frozenset[str]) -> list[int]:
    """The advisory lock keys of ``tokens``, ascending and distinct: the order every transaction takes them in."""
    return sorted(
        {int.from_bytes(hashlib.blake2b(t.encode(), digest_size=4).digest(), "big", signed=True) for t in tokens}
    )


def event_row(e: Event, write_id: str) -> tuple[Any, ...]:
    """The row of an event (all of :data:`COLUMNS`), written by the write ``write_id``."""
    return (*CODEC.event_record(e), write_id)


def insert_sql(table: str, columns: Sequence[str], *, rows: int = 1) -> str:
    """INSERT of ``rows`` rows; parameters: the values of each row in turn."""
    one = f"({', '.join(['%s'] * len(columns))})"
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES {', '.join([one] * rows)}"


#: The most rows one multi-row INSERT takes: well within the parameters a statement may have
#: (:data:`~celery_workflow._postgres.script.MAX_PARAMETERS`) for any of our tables, and few enough distinct
#: statements (one per row count) for the connection to prepare.
MAX_INSERT_ROWS = 1000


def insert_rows(script: Script, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[int]:
    """Queue the INSERT of ``rows`` on ``script``: as many statements as it takes (at most :data:`MAX_INSERT_ROWS`
    rows and :data:`~celery_workflow._postgres.script.MAX_PARAMETERS` parameters each), all in the script's one
    transaction. The indexes of their results."""
    per = max(1, min(MAX_INSERT_ROWS, MAX_PARAMETERS // max(1, len(columns))))
    return [
        script.add(insert_sql(table, columns, rows=len(part)), [value for row in part for value in row])
        for part in (rows[i : i + per] for i in range(0, len(rows), per))
    ]


def update_sql(table: str, columns: Sequence[str], key: Sequence[str]) -> str:
    """UPDATE ``columns`` of the row whose ``key`` columns match; parameters: columns, then key."""
    return (
        f"UPDATE {table} SET {', '.join(f'{c} = %s' for c in columns)} WHERE {' AND '.join(f'{k} = %s' for k in key)}"
    )
