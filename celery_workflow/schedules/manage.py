"""Defining and managing schedules: what ``wf.schedule(...)``, ``wf.schedules``, the CLI and the inspector call.

:meth:`Schedules.define` is idempotent: a schedule defined again alike (every worker importing the app module that
defines it) is left as it is, paused or not; one defined with another cron expression or time zone starts again from
the first tick after now; a change of its workflow, arguments, overlap or catch-up applies from its next tick.
Resuming a paused schedule starts from the first tick after now: ticks that came while it was paused are not
caught up.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from celery_workflow import codec
from celery_workflow.errors import ConfigurationError, InvalidSchedule, ScheduleNotFound
from celery_workflow.schedules.cron import parse_cron
from celery_workflow.schedules.model import Schedule, ScheduleStore, check_schedule_id, schedules_of
from celery_workflow.schedules.ticker import Clock, SystemClock

__all__ = ["Schedules"]

_TRIES = 20


def _seconds(catch_up: timedelta | float) -> float:
    if isinstance(catch_up, timedelta):
        return catch_up.total_seconds()
    if isinstance(catch_up, int | float) and not isinstance(catch_up, bool):
        return float(catch_up)
    raise InvalidSchedule(f"catch_up is a timedelta or a number of seconds, not {catch_up!r}")


class Schedules:
    """The schedules of a World (``world.schedule_store``), read and changed at ``clock``'s time."""

    def __init__(self, world: object, clock: Clock | None = None) -> None:
        store = schedules_of(world)
        if store is None:
            raise ConfigurationError(f"{type(world).__name__} keeps no schedules")
        self.store: ScheduleStore = store
        self.clock: Clock = clock or SystemClock()

    def define(
        self,
        schedule_id: str,
        workflow_name: str,
        cron: str,
        *,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        timezone: str = "UTC",
        overlap: str = "skip",
        catch_up: timedelta | float = timedelta(minutes=1),
    ) -> Schedule:
        """Store the schedule (see the module docstring); InvalidSchedule for a bad definition."""
        check_schedule_id(schedule_id)
        parsed = parse_cron(cron, timezone)
        data = {"args": list(args), "kwargs": dict(kwargs or {})}
        try:
            codec.dumps(data)
        except Exception as exc:
            raise InvalidSchedule(f"schedule {schedule_id}: its arguments are not JSON: {exc}") from exc
        now = self.clock.now()
        wanted = Schedule(
            schedule_id=schedule_id,
            workflow_name=workflow_name,
            cron=parsed.expression,
            timezone=timezone,
            input=codec.loads(codec.dumps(data)),
            overlap=overlap,
            catch_up=_seconds(catch_up),
            next_tick=parsed.next_after(now),
            created_at=now,
            updated_at=now,
        )
        for _ in range(_TRIES):
            if self.store.add_schedule(wanted):
                return wanted
            try:
                found = self.store.get_schedule(schedule_id)
            except ScheduleNotFound:
                continue  # deleted meanwhile: add it again
            if found.definition == wanted.definition:
                return found
            retimed = (found.cron, found.timezone) != (wanted.cron, wanted.timezone)
            changed = found.changed(
                now,
                workflow_name=wanted.workflow_name,
                cron=wanted.cron,
                timezone=wanted.timezone,
                input=wanted.input,
                overlap=wanted.overlap,
                catch_up=wanted.catch_up,
                next_tick=wanted.next_tick if retimed else found.next_tick,
            )
            if self.store.replace_schedule(changed, found.version):
                return changed
        raise ConfigurationError(f"schedule {schedule_id}: kept changing while it was defined")  # pragma: no cover

    def get(self, schedule_id: str) -> Schedule:
        return self.store.get_schedule(check_schedule_id(schedule_id))

    def list(self) -> list[Schedule]:
        return self.store.list_schedules()

    def _change(self, schedule_id: str, **changes: Any) -> Schedule:
        for _ in range(_TRIES):
            found = self.get(schedule_id)
            now = self.clock.now()
            values = dict(changes)
            if values.get("paused") is False and found.paused:  # resumed: from the first tick after now
                values["next_tick"] = parse_cron(found.cron, found.timezone).next_after(now)
            if all(getattr(found, k) == v for k, v in values.items()):
                return found
            changed = found.changed(now, **values)
            if self.store.replace_schedule(changed, found.version):
                return changed
        raise ConfigurationError(f"schedule {schedule_id}: kept changing")  # pragma: no cover

    def pause(self, schedule_id: str) -> Schedule:
        """Stop firing the schedule until :meth:`resume` (ScheduleNotFound for an unknown id)."""
        return self._change(schedule_id, paused=True)

    def resume(self, schedule_id: str) -> Schedule:
        """Fire the schedule again, from its first tick after now."""
        return self._change(schedule_id, paused=False)

    def delete(self, schedule_id: str) -> None:
        """Delete the schedule (its runs stay); ScheduleNotFound for an unknown id."""
        if not self.store.delete_schedule(check_schedule_id(schedule_id)):
            raise ScheduleNotFound(f"no schedule {schedule_id!r}")
