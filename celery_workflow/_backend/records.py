"""Views stored field by field: the one mapping between the views of :mod:`celery_workflow.events` and the flat
records (table rows, DynamoDB items) a backend stores them in.

:data:`VIEW_COLUMNS` lists, per view table, the stored fields in table order: a view's fields plus what the backend
keeps beside it (``created_slot``, the slot of the creation event, orders steps, hooks and waits by creation).
:data:`MUTABLE` says which of them an event may change after the record was created. A :class:`RecordCodec` turns a
view into a record and back with the backend's own representation of times, JSON values and flags:

* JSON values (``input``, ``output``, ``error``, ``metadata``, ``respond_with``, an event's ``data``) are
  codec-tagged bytes (:func:`celery_workflow.codec.dumps`), already size-checked when the event was validated;
* times are whatever the backend stores (microseconds as integers in SQLite, ``timestamptz`` in Postgres), converted
  by the two functions the codec is built with, and always come back as aware UTC datetimes;
* statuses are stored as their text values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from enum import StrEnum
from typing import Any, cast

from celery_workflow import codec
from celery_workflow._backend.migrations import Table
from celery_workflow.events import (
    CREATION_EVENTS,
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
from celery_workflow.rules import Snapshot

__all__ = [
    "EVENT_COLUMNS",
    "KEYS",
    "MUTABLE",
    "VIEW_COLUMNS",
    "RecordCodec",
    "add_views",
    "created_slots",
    "world_tables",
]

#: The stored fields of each view table, in table order.
VIEW_COLUMNS: dict[str, tuple[str, ...]] = {
    "runs": tuple(
        [
            "run_id",
            "workflow_name",
            "status",
            "queue",
            "input",
            "output",
            "error",
            "event_count",
            "created_at",
            "updated_at",
            "started_at",
            "completed_at",
        ]
    ),
    "steps": tuple(
        [
            "run_id",
            "step_id",
            "step_name",
            "status",
            "input",
            "output",
            "error",
            "attempt",
            "owner",
            "queue",
            "created_slot",
            "created_at",
            "updated_at",
            "started_at",
            "completed_at",
            "retry_after",
        ]
    ),
    "hooks": tuple(
        ["run_id", "hook_id", "token", "metadata", "is_webhook", "respond_with", "created_slot", "created_at"]
    ),
    "waits": tuple(["run_id", "wait_id", "status", "resume_at", "created_slot", "created_at", "completed_at"]),
}
#: The stored fields of an event (a backend may add its own, such as Postgres's ``write_id``).
EVENT_COLUMNS = ("run_id", "slot", "event_type", "correlation_id", "data", "created_at")
#: The key field of each per-run view table besides ``run_id``.
KEYS = {"steps": "step_id", "hooks": "hook_id", "waits": "wait_id"}

_FIXED = frozenset({"run_id", "step_id", "wait_id", "workflow_name", "step_name", "queue", "input", "created_slot"})
#: The fields an event may change after the record was created (hooks never change: they are created or deleted).
MUTABLE: dict[str, tuple[str, ...]] = {
    "runs": tuple(c for c in VIEW_COLUMNS["runs"] if c not in _FIXED | {"created_at"}),
    "steps": tuple(c for c in VIEW_COLUMNS["steps"] if c not in _FIXED | {"created_at"}),
    "waits": ("status", "completed_at"),
}

_VIEWS: dict[str, type[Any]] = {"runs": RunView, "steps": StepView, "hooks": HookView, "waits": WaitView}
_ENUMS: dict[str, type[StrEnum]] = {"runs": RunStatus, "steps": StepStatus, "waits": WaitStatus}
_FIELDS = {table: frozenset(f.name for f in dataclasses.fields(cls)) for table, cls in _VIEWS.items()}
_BLOBS = frozenset({"input", "output", "error", "metadata", "respond_with"})
_TIMES = frozenset({"created_at", "updated_at", "started_at", "completed_at", "retry_after", "resume_at"})
_NO_LIMIT = 1 << 62  # values stored here were size-checked by rules.validate already


def _same(value: Any) -> Any:
    return value


class RecordCodec:
    """Views ↔ records for one backend: ``time_out``/``time_in`` store and read a time, ``flag_out``/``flag_in`` a
    boolean (defaults: unchanged); JSON values are codec-tagged bytes."""

    def __init__(
        self,
        *,
        time_out: Callable[[datetime], Any] = _same,
        time_in: Callable[[Any], datetime],
        flag_out: Callable[[bool], Any] = _same,
        flag_in: Callable[[Any], bool] = bool,
    ) -> None:
        self._time_out = time_out
        self._time_in = time_in
        self._flag_out = flag_out
        self._flag_in = flag_in

    # -- single values ---------------------------------------------------------------------------------------------

    @staticmethod
    def blob(value: Any) -> bytes | None:
        return None if value is None else codec.dumps(value, limit=_NO_LIMIT)

    @staticmethod
    def value(stored: Any) -> Any:
        return None if stored is None else codec.loads(bytes(stored))

    def store_time(self, value: datetime | None) -> Any:
        return None if value is None else self._time_out(value)

    def read_time(self, stored: Any) -> datetime | None:
        return None if stored is None else self._time_in(stored)

    def flag(self, value: bool) -> Any:
        return self._flag_out(value)

    def read_flag(self, stored: Any) -> bool:
        return self._flag_in(stored)

    # -- views -----------------------------------------------------------------------------------------------------

    def record(self, table: str, view: Any, **extra: Any) -> dict[str, Any]:
        """The record of a view of ``table`` (``runs``/``steps``/``hooks``/``waits``), in :data:`VIEW_COLUMNS`
        order; ``extra`` gives the fields the view lacks (``created_slot``)."""
        out: dict[str, Any] = {}
        for column in VIEW_COLUMNS[table]:
            item = extra[column] if column in extra else getattr(view, column)
            if column in _BLOBS:
                item = self.blob(item)
            elif column in _TIMES:
                item = self.store_time(item)
            elif isinstance(item, StrEnum):
                item = item.value
            elif isinstance(item, bool):
                item = self._flag_out(item)
            out[column] = item
        return out

    def view(self, table: str, stored: Sequence[Any] | Mapping[str, Any]) -> Any:
        """The view of a record of ``table``: a sequence in :data:`VIEW_COLUMNS` order or a mapping by field."""
        values = stored if isinstance(stored, Mapping) else dict(zip(VIEW_COLUMNS[table], stored, strict=True))
        fields = {c: self._decode(table, c, values.get(c)) for c in VIEW_COLUMNS[table] if c in _FIELDS[table]}
        return _VIEWS[table](**fields)

    def _decode(self, table: str, column: str, stored: Any) -> Any:
        if column in _BLOBS:
            return self.value(stored)
        if column in _TIMES:
            return self.read_time(stored)
        if column == "status":
            return _ENUMS[table](stored)
        if column == "is_webhook":
            return self._flag_in(stored)
        return stored

    def run(self, stored: Sequence[Any] | Mapping[str, Any]) -> RunView:
        return cast(RunView, self.view("runs", stored))

    def step(self, stored: Sequence[Any] | Mapping[str, Any]) -> StepView:
        return cast(StepView, self.view("steps", stored))

    def hook(self, stored: Sequence[Any] | Mapping[str, Any]) -> HookView:
        return cast(HookView, self.view("hooks", stored))

    def wait(self, stored: Sequence[Any] | Mapping[str, Any]) -> WaitView:
        return cast(WaitView, self.view("waits", stored))

    # -- events ----------------------------------------------------------------------------------------------------

    def event_record(self, e: Event) -> tuple[Any, ...]:
        """The stored fields of an event, in :data:`EVENT_COLUMNS` order."""
        return (
            e.run_id,
            e.slot,
            e.event_type.value,
            e.correlation_id,
            self.blob(dict(e.data)),
            self.store_time(e.created_at),
        )

    def event(self, stored: Sequence[Any]) -> Event:
        """The event of a record in :data:`EVENT_COLUMNS` order (extra trailing fields are ignored)."""
        run_id, slot, kind, cid, data, created_at = stored[:6]
        created = self.read_time(created_at)
        assert created is not None
        return Event(run_id, int(slot), EventType(kind), cid, codec.loads(bytes(data)), created)


def world_tables(*, write_id: bool, indexes: Mapping[str, Mapping[str, bool]]) -> dict[str, Table]:
    """The tables of a SQL World as the code expects them (the migration test compares the migrated schema with
    this): the view tables, the event log, hook tokens and streams. ``write_id``: events and stream chunks carry the
    id of the write that stored them (lost-answer detection); ``indexes``: each table's secondary indexes (name:
    unique), which differ per dialect."""
    extra = ("write_id",) if write_id else ()
    keys = {
        "runs": ("run_id",),
        "events": ("run_id", "slot"),
        "steps": ("run_id", "step_id"),
        "hooks": ("run_id", "hook_id"),
        "hook_tokens": ("token",),
        "waits": ("run_id", "wait_id"),
        "streams": ("run_id", "name"),
        "stream_chunks": ("run_id", "name", "idx"),
    }
    columns = {
        **VIEW_COLUMNS,
        "events": (*EVENT_COLUMNS, *extra),
        "hook_tokens": ("token", "run_id", "hook_id", "created_at", "retain_until"),
        "streams": ("run_id", "name", "closed", "chunk_count", "created_at", "updated_at"),
        "stream_chunks": ("run_id", "name", "idx", "data", "created_at", *extra),
    }
    return {
        f"celery_workflow_{name}": Table(columns[name], key, dict(indexes.get(f"celery_workflow_{name}", {})))
        for name, key in keys.items()
    }


def created_slots(events: Iterable[Event]) -> dict[tuple[EventType, str | None], int]:
    """The slot of each creation event of a plan, by (event type, correlation id): the ``created_slot`` of the
    records those events create."""
    return {(e.event_type, e.correlation_id): e.slot for e in events if e.event_type in CREATION_EVENTS}


def add_views(snapshot: Snapshot, table: str, views: Iterable[Any]) -> None:
    """Put views of ``table`` (``steps``/``hooks``/``waits``) into the snapshot, keyed by their id."""
    tables: dict[str, dict[str, Any]] = {"steps": snapshot.steps, "hooks": snapshot.hooks, "waits": snapshot.waits}
    found = tables[table]
    key = KEYS[table]
    for item in views:
        found[getattr(item, key)] = item
