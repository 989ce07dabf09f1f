"""Rows of the Postgres World's tables and the views they hold (not part of the public API).

:data:`COLUMNS` is the one list of the columns the code reads and writes per table (the migration test compares the
catalog with it). Views are stored column by column: JSON values as codec-tagged ``bytea``, times as ``timestamptz``
(read back as UTC), enums as their text values. Every read converts a row of :data:`COLUMNS` order back to its view.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, cast

from celery_workflow import codec
from celery_workflow.events import (
    Event,
    EventType,
    HookView,
    RunStatus,
    RunView,
    StepStatus,
    StepView,
    WaitStatus,
    WaitView,
)

__all__ = ["COLUMNS", "INDEXES", "PRIMARY_KEYS"]

#: The columns the code reads and writes, per table, in table order.
COLUMNS: dict[str, tuple[str, ...]] = {
    f"celery_workflow_{table}": tuple(columns.split())
    for table, columns in {
        "runs": "run_id workflow_name status queue input output error event_count created_at updated_at started_at"
        " completed_at",
        "events": "run_id slot event_type correlation_id data created_at write_id",
        "steps": "run_id step_id step_name status input output error attempt owner queue created_slot created_at"
        " updated_at started_at completed_at retry_after",
        "hooks": "run_id hook_id token metadata is_webhook respond_with created_slot created_at",
        "hook_tokens": "token run_id hook_id created_at",
        "waits": "run_id wait_id status resume_at created_slot created_at completed_at",
        "streams": "run_id name closed chunk_count created_at updated_at",
        "stream_chunks": "run_id name idx data created_at write_id",
    }.items()
}

#: The primary key of each table.
PRIMARY_KEYS: dict[str, tuple[str, ...]] = {
    "celery_workflow_runs": ("run_id",),
    "celery_workflow_events": ("run_id", "slot"),
    "celery_workflow_steps": ("run_id", "step_id"),
    "celery_workflow_hooks": ("run_id", "hook_id"),
    "celery_workflow_hook_tokens": ("token",),
    "celery_workflow_waits": ("run_id", "wait_id"),
    "celery_workflow_streams": ("run_id", "name"),
    "celery_workflow_stream_chunks": ("run_id", "name", "idx"),
}

#: Secondary indexes of the World's migration (name: table), besides the primary keys.
INDEXES: dict[str, str] = {
    "celery_workflow_runs_workflow": "celery_workflow_runs",
    "celery_workflow_runs_status": "celery_workflow_runs",
    "celery_workflow_runs_completed": "celery_workflow_runs",
    "celery_workflow_events_created": "celery_workflow_events",
    "celery_workflow_events_hook_created": "celery_workflow_events",
    "celery_workflow_hook_tokens_hook": "celery_workflow_hook_tokens",
}

RUN = ", ".join(COLUMNS["celery_workflow_runs"])
EVENT = ", ".join(COLUMNS["celery_workflow_events"][:6])  # the columns of an Event (write_id is the World's)
STEP = ", ".join(COLUMNS["celery_workflow_steps"])
HOOK = ", ".join(COLUMNS["celery_workflow_hooks"])
WAIT = ", ".join(COLUMNS["celery_workflow_waits"])
HOOK_H = ", ".join(f"h.{c}" for c in COLUMNS["celery_workflow_hooks"])

#: Columns an event may change after the row was created.
_FIXED = frozenset({"run_id", "step_id", "wait_id", "workflow_name", "step_name", "queue", "input", "created_slot"})
RUN_MUTABLE = tuple(c for c in COLUMNS["celery_workflow_runs"] if c not in _FIXED | {"created_at"})
STEP_MUTABLE = tuple(c for c in COLUMNS["celery_workflow_steps"] if c not in _FIXED | {"created_at"})
WAIT_MUTABLE = ("status", "completed_at")

_NO_LIMIT = 1 << 62  # values written here were size-checked by events.validate already
_BLOBS = frozenset({"input", "output", "error", "metadata", "respond_with"})
_TIMES = frozenset({"created_at", "updated_at", "started_at", "completed_at", "retry_after", "resume_at"})
_ENUMS: dict[str, type[StrEnum]] = {"runs": RunStatus, "steps": StepStatus, "waits": WaitStatus}
_VIEWS: dict[str, type[Any]] = {"runs": RunView, "steps": StepView, "hooks": HookView, "waits": WaitView}
_FIELDS = {table: frozenset(f.name for f in dataclasses.fields(cls)) for table, cls in _VIEWS.items()}

#: First key of the two-key advisory locks that stand for hook tokens (a key space of its own: the one-key
#: ``bigint`` advisory locks, such as the migration lock, never collide with two-key ones).
TOKEN_LOCK_SPACE = 0x63770001


def token_lock_keys(tokens: Sequence[str] | frozenset[str]) -> list[int]:
    """The advisory lock keys of ``tokens``, ascending and distinct: the order every transaction takes them in."""
    return sorted(
        {int.from_bytes(hashlib.blake2b(t.encode(), digest_size=4).digest(), "big", signed=True) for t in tokens}
    )


def blob(value: Any) -> bytes | None:
    return None if value is None else codec.dumps(value, limit=_NO_LIMIT)


def value(stored: bytes | None) -> Any:
    return None if stored is None else codec.loads(bytes(stored))


def utc(stored: datetime | None) -> datetime | None:
    """A ``timestamptz`` as an aware UTC datetime (psycopg returns the session's time zone)."""
    return None if stored is None else stored.astimezone(UTC)


def row(table: str, view: Any, **extra: Any) -> dict[str, Any]:
    """The row of ``celery_workflow_<table>`` for a view: blobs, times, enum values; ``extra`` fills the rest."""
    out: dict[str, Any] = {}
    for column in COLUMNS[f"celery_workflow_{table}"]:
        item = extra[column] if column in extra else getattr(view, column)
        if column in _BLOBS:
            item = blob(item)
        elif isinstance(item, StrEnum):
            item = item.value
        out[column] = item
    return out


def _decode(table: str, column: str, stored: Any) -> Any:
    if column in _BLOBS:
        return value(stored)
    if column in _TIMES:
        return utc(stored)
    if column == "status":
        return _ENUMS[table](stored)
    return stored


def view(table: str, stored: Sequence[Any]) -> Any:
    """The view of a row of ``celery_workflow_<table>`` (columns in :data:`COLUMNS` order)."""
    columns = COLUMNS[f"celery_workflow_{table}"]
    fields = {c: _decode(table, c, v) for c, v in zip(columns, stored, strict=True) if c in _FIELDS[table]}
    return _VIEWS[table](**fields)


def run_view(stored: Sequence[Any]) -> RunView:
    return cast(RunView, view("runs", stored))


def step_view(stored: Sequence[Any]) -> StepView:
    return cast(StepView, view("steps", stored))


def hook_view(stored: Sequence[Any]) -> HookView:
    return cast(HookView, view("hooks", stored))


def wait_view(stored: Sequence[Any]) -> WaitView:
    return cast(WaitView, view("waits", stored))


def event(stored: Sequence[Any]) -> Event:
    run_id, slot, kind, cid, data, created_at = stored
    return Event(run_id, slot, EventType(kind), cid, codec.loads(bytes(data)), created_at.astimezone(UTC))


def event_row(e: Event, write_id: str) -> tuple[Any, ...]:
    """The row of an event (all of :data:`COLUMNS`), written by the write ``write_id``."""
    return (e.run_id, e.slot, e.event_type.value, e.correlation_id, blob(dict(e.data)), e.created_at, write_id)


def insert_sql(table: str, columns: Sequence[str], *, rows: int = 1) -> str:
    """INSERT of ``rows`` rows; parameters: the values of each row in turn."""
    one = f"({', '.join(['%s'] * len(columns))})"
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES {', '.join([one] * rows)}"


def update_sql(table: str, columns: Sequence[str], key: Sequence[str]) -> str:
    """UPDATE ``columns`` of the row whose ``key`` columns match; parameters: columns, then key."""
    return (
        f"UPDATE {table} SET {', '.join(f'{c} = %s' for c in columns)} WHERE {' AND '.join(f'{k} = %s' for k in key)}"
    )
