"""What a schedule is, as every World stores it, and the store protocol a World offers for it.

A schedule is one row (item) per id in the World: its definition (workflow, cron expression, time zone, arguments,
overlap policy, catch-up window), whether it is paused, its ``next_tick`` (the next instant it fires), what it last
did (``last_tick``, ``last_run_id``), a short lease (``lease_holder``, ``lease_until``: the ticker that is firing
``next_tick`` now) and a ``version`` that every change moves. Every change after the first write is a
compare-and-set on ``version`` (:meth:`ScheduleStore.replace_schedule`): of the tickers of several workers that see
the same tick due, one takes the lease, fires it and moves ``next_tick`` on; the others' writes find another version
and change nothing. A run a tick starts has the id :func:`tick_run_id` (``<schedule id>@<tick, UTC ISO>``), so even
a ticker whose lease ran out while it fired starts nothing twice: the World's ``create_run`` is idempotent by run id.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Protocol, runtime_checkable

from celery_workflow import ids
from celery_workflow.errors import InvalidSchedule
from celery_workflow.schedules.cron import parse_cron

__all__ = [
    "OVERLAPS",
    "Schedule",
    "ScheduleStore",
    "check_schedule_id",
    "schedules_of",
    "tick_run_id",
]

#: What a tick does while the schedule's previous run is still running: ``skip`` the tick (the default), ``allow``
#: both, or ``cancel_previous`` and start the new one.
OVERLAPS = ("skip", "allow", "cancel_previous")
#: A schedule id: what a run id may hold (the tick's part added), up to 100 characters.
_ID = re.compile(r"^[A-Za-z0-9_\-.:]{1,100}$")


def check_schedule_id(schedule_id: str) -> str:
    """``schedule_id`` if a schedule may have it; InvalidSchedule otherwise."""
    if not isinstance(schedule_id, str) or not _ID.match(schedule_id):
        raise InvalidSchedule(
            f"a schedule id is 1 to 100 letters, digits, '_', '-', '.' or ':' (it starts the ids of its runs), "
            f"not {schedule_id!r}"
        )
    return schedule_id


def tick_run_id(schedule_id: str, tick: datetime) -> str:
    """The id of the run that ``tick`` of schedule ``schedule_id`` starts: ``nightly@2026-12-06T02:15:00Z``."""
    return f"{schedule_id}@{ids.to_utc(tick).strftime('%Y-%m-%dT%H:%M:%SZ')}"


@dataclass(frozen=True)
class Schedule:
    """A schedule as the World stores it (see the module docstring). Times are aware UTC datetimes."""

    schedule_id: str
    workflow_name: str
    cron: str
    timezone: str = "UTC"
    #: the run's arguments: ``{"args": [...], "kwargs": {...}}`` (JSON)
    input: Mapping[str, Any] = field(default_factory=lambda: {"args": [], "kwargs": {}})
    overlap: str = "skip"
    #: how late a tick may still be started (seconds); a tick missed by more is skipped
    catch_up: float = 60.0
    paused: bool = False
    next_tick: datetime | None = None
    last_tick: datetime | None = None
    last_run_id: str | None = None
    lease_holder: str | None = None
    lease_until: datetime | None = None
    version: int = 1
    created_at: datetime | None = None
    updated_at: datetime | None = None

    def __post_init__(self) -> None:
        check_schedule_id(self.schedule_id)
        if not isinstance(self.workflow_name, str) or not self.workflow_name:
            raise InvalidSchedule(f"schedule {self.schedule_id}: a workflow name is needed")
        if self.overlap not in OVERLAPS:
            raise InvalidSchedule(
                f"schedule {self.schedule_id}: overlap is one of {', '.join(OVERLAPS)}, not {self.overlap!r}"
            )
        if not isinstance(self.catch_up, int | float) or isinstance(self.catch_up, bool) or self.catch_up < 0:
            raise InvalidSchedule(f"schedule {self.schedule_id}: catch_up must be >= 0 seconds, not {self.catch_up!r}")

    @property
    def definition(self) -> tuple[Any, ...]:
        """What the schedule's owner defined (two definitions alike leave a stored schedule as it is)."""
        return (self.workflow_name, self.cron, self.timezone, dict(self.input), self.overlap, float(self.catch_up))

    def leased(self, now: datetime) -> bool:
        """Whether a ticker holds the lease at ``now``."""
        return self.lease_until is not None and self.lease_until > now

    def due(self, now: datetime) -> bool:
        """Whether the next tick is due at ``now`` and no ticker is firing it."""
        return not self.paused and self.next_tick is not None and self.next_tick <= now and not self.leased(now)

    def first_tick(self, after: datetime) -> datetime:
        return parse_cron(self.cron, self.timezone).next_after(after)

    def changed(self, now: datetime, **changes: Any) -> Schedule:
        """This schedule with ``changes``, the next version, updated at ``now``."""
        return replace(self, **changes, version=self.version + 1, updated_at=now)

    def to_data(self) -> dict[str, Any]:
        """JSON data (times as ISO strings): how the DynamoDB and in-memory stores keep it, and what the CLI and the
        RPC show."""
        data = asdict(self)
        data["input"] = dict(self.input)
        for key, value in data.items():
            if isinstance(value, datetime):
                data[key] = ids.isoformat(value)
        return data

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> Schedule:
        values = dict(data)
        for key in ("next_tick", "last_tick", "lease_until", "created_at", "updated_at"):
            if values.get(key) is not None:
                values[key] = ids.parse_iso(str(values[key]))
        return cls(**values)


@runtime_checkable
class ScheduleStore(Protocol):
    """Where a World keeps its schedules (``world.schedule_store``: SQLite and Postgres tables, DynamoDB items under
    ``pk=SCHEDULES``, a dict in memory). Every method is thread-safe and touches one schedule atomically."""

    def add_schedule(self, schedule: Schedule) -> bool:
        """Store ``schedule`` if no schedule has its id: True; False (nothing written) when one has."""
        ...

    def get_schedule(self, schedule_id: str) -> Schedule:
        """The schedule; ScheduleNotFound when there is none."""
        ...

    def list_schedules(self) -> list[Schedule]:
        """Every schedule, by id."""
        ...

    def replace_schedule(self, schedule: Schedule, expected_version: int) -> bool:
        """Store ``schedule`` in place of the one with its id if that one's version is still ``expected_version``:
        True; False (nothing written) when it is not, or there is no such schedule any more."""
        ...

    def delete_schedule(self, schedule_id: str) -> bool:
        """Delete the schedule: True, or False when there was none."""
        ...


def schedules_of(world: object) -> ScheduleStore | None:
    """Where ``world`` keeps its schedules (its ``schedule_store`` attribute), or None when it keeps none."""
    store = getattr(world, "schedule_store", None)
    return store if isinstance(store, ScheduleStore) else None


def later(now: datetime, seconds: float) -> datetime:
    return now + timedelta(seconds=seconds)
