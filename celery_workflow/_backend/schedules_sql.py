"""The schedules table of the SQL Worlds (``celery_workflow_schedules``; SQLite and Postgres migrations), shared by
both dialects: they differ in how a statement is run and how times, flags and JSON are stored (a
:class:`~celery_workflow._backend.records.RecordCodec`). See :mod:`celery_workflow.schedules.model` for what a row
is and how it changes (every change after the insert is a compare-and-set on ``version``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from celery_workflow._backend.migrations import Table, columns
from celery_workflow._backend.records import RecordCodec
from celery_workflow.errors import ScheduleNotFound
from celery_workflow.schedules.model import Schedule, check_schedule_id

__all__ = ["SCHEDULES", "SCHEDULE_COLUMNS", "SQLSchedules", "schedule_table"]

SCHEDULES = "celery_workflow_schedules"
SCHEDULE_COLUMNS = columns(
    "schedule_id workflow_name cron timezone input overlap catch_up paused next_tick last_tick last_run_id"
    " lease_holder lease_until version created_at updated_at"
)
_TIMES = frozenset({"next_tick", "last_tick", "lease_until", "created_at", "updated_at"})

#: Runs ``body(connection)`` in one transaction and returns what it returns (``write``: a write transaction).
Runner = Callable[[Callable[[Any], Any], bool], Any]
#: Runs one statement on a connection: its rows (for a SELECT) and the number of rows it changed.
Execute = Callable[[Any, str, Sequence[Any]], tuple[list[Any], int]]


def schedule_table() -> dict[str, Table]:
    """The table as the code expects it (the migration test compares the migrated schema with it)."""
    return {SCHEDULES: Table(SCHEDULE_COLUMNS, ("schedule_id",))}


class SQLSchedules:
    """The :class:`~celery_workflow.schedules.model.ScheduleStore` of a SQL World."""

    def __init__(self, run: Runner, execute: Execute, codec: RecordCodec, placeholder: str) -> None:
        self._run = run
        self._execute = execute
        self._codec = codec
        self._p = placeholder

    def _row(self, schedule: Schedule) -> list[Any]:
        data = {name: getattr(schedule, name) for name in SCHEDULE_COLUMNS}
        out: list[Any] = []
        for name in SCHEDULE_COLUMNS:
            value = data[name]
            if name in _TIMES:
                value = self._codec.store_time(value)
            elif name == "input":
                value = self._codec.blob(dict(value))
            elif name == "paused":
                value = self._codec.flag(value)
            out.append(value)
        return out

    def _schedule(self, row: Sequence[Any]) -> Schedule:
        data: dict[str, Any] = {}
        for name, stored in zip(SCHEDULE_COLUMNS, row, strict=True):
            value = stored
            if name in _TIMES:
                value = self._codec.read_time(stored)
            elif name == "input":
                value = self._codec.value(stored)
            elif name == "paused":
                value = self._codec.read_flag(stored)
            elif name == "catch_up":
                value = float(stored)
            elif name == "version":
                value = int(stored)
            data[name] = value
        return Schedule(**data)

    def add_schedule(self, schedule: Schedule) -> bool:
        marks = ", ".join([self._p] * len(SCHEDULE_COLUMNS))
        sql = (
            f"INSERT INTO {SCHEDULES} ({', '.join(SCHEDULE_COLUMNS)}) VALUES ({marks})"
            " ON CONFLICT (schedule_id) DO NOTHING"
        )
        row = self._row(schedule)
        return bool(self._run(lambda conn: self._execute(conn, sql, row)[1], True))

    def get_schedule(self, schedule_id: str) -> Schedule:
        sql = f"SELECT {', '.join(SCHEDULE_COLUMNS)} FROM {SCHEDULES} WHERE schedule_id = {self._p}"
        rows = self._run(lambda conn: self._execute(conn, sql, (schedule_id,))[0], False)
        if not rows:
            raise ScheduleNotFound(f"no schedule {schedule_id!r}")
        return self._schedule(rows[0])

    def list_schedules(self) -> list[Schedule]:
        sql = f"SELECT {', '.join(SCHEDULE_COLUMNS)} FROM {SCHEDULES} ORDER BY schedule_id"
        rows = self._run(lambda conn: self._execute(conn, sql, ())[0], False)
        return [self._schedule(r) for r in rows]

    def replace_schedule(self, schedule: Schedule, expected_version: int) -> bool:
        settable = [c for c in SCHEDULE_COLUMNS if c != "schedule_id"]
        sql = (
            f"UPDATE {SCHEDULES} SET {', '.join(f'{c} = {self._p}' for c in settable)}"
            f" WHERE schedule_id = {self._p} AND version = {self._p}"
        )
        row = self._row(schedule)
        params = [*row[1:], schedule.schedule_id, expected_version]
        return bool(self._run(lambda conn: self._execute(conn, sql, params)[1], True))

    def delete_schedule(self, schedule_id: str) -> bool:
        check_schedule_id(schedule_id)
        sql = f"DELETE FROM {SCHEDULES} WHERE schedule_id = {self._p}"
        return bool(self._run(lambda conn: self._execute(conn, sql, (schedule_id,))[1], True))
