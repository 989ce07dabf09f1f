"""The schedules of an in-memory World (:class:`~celery_workflow.testing.MemoryWorld`): a dict under a lock."""

from __future__ import annotations

import threading

from celery_workflow.errors import ScheduleNotFound
from celery_workflow.schedules.model import Schedule

__all__ = ["MemorySchedules"]


class MemorySchedules:
    """A :class:`~celery_workflow.schedules.model.ScheduleStore` in process memory, thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._schedules: dict[str, Schedule] = {}

    def add_schedule(self, schedule: Schedule) -> bool:
        with self._lock:
            if schedule.schedule_id in self._schedules:
                return False
            self._schedules[schedule.schedule_id] = schedule
            return True

    def get_schedule(self, schedule_id: str) -> Schedule:
        with self._lock:
            found = self._schedules.get(schedule_id)
        if found is None:
            raise ScheduleNotFound(f"no schedule {schedule_id!r}")
        return found

    def list_schedules(self) -> list[Schedule]:
        with self._lock:
            return [self._schedules[k] for k in sorted(self._schedules)]

    def replace_schedule(self, schedule: Schedule, expected_version: int) -> bool:
        with self._lock:
            found = self._schedules.get(schedule.schedule_id)
            if found is None or found.version != expected_version:
                return False
            self._schedules[schedule.schedule_id] = schedule
            return True

    def delete_schedule(self, schedule_id: str) -> bool:
        with self._lock:
            return self._schedules.pop(schedule_id, None) is not None
