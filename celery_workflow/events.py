"""Event types, statuses and the records of the event log: events, their typed data and the entity views (run,
step, hook, wait).

A run's state is its event log. Each run's events are numbered 1, 2, 3 … (*slots*) with no gaps, in commit order.
Views (run, step, hook, wait) are derived from the log and kept by the World in the same atomic write. How a batch of
events is checked and turned into the writes that keep them is :mod:`celery_workflow.rules`.

An event's ``data`` is a JSON object whose shape its type fixes: one frozen dataclass per event type
(:mod:`celery_workflow.event_data`, which also holds :class:`EventType`) declares its fields, required and optional,
and their types.
``Event.body`` / ``NewEvent.body`` are that typed view of ``data``; ``data`` itself is what is stored, unchanged.
The view is checked at the log's edges: an event to append when the World validates it
(:class:`~celery_workflow.errors.EventInvalid`), a stored event when a World reads it back (building the
:class:`Event` checks it: :class:`~celery_workflow.errors.EventUnreadable`, also for an unknown event type).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any, TypeVar

from celery_workflow.errors import EventInvalid, EventUnreadable, UnknownEventType
from celery_workflow.event_data import EventData, EventType, data_of

__all__ = [
    "CHILD_EVENTS",
    "CREATION_EVENTS",
    "HOOK_EVENTS",
    "PATCH_EVENTS",
    "RUN_END_STATUS",
    "RUN_EVENTS",
    "STEP_EVENTS",
    "WAIT_EVENTS",
    "Event",
    "EventData",
    "EventType",
    "HookView",
    "NewEvent",
    "RunStatus",
    "RunView",
    "StepStatus",
    "StepView",
    "WaitStatus",
    "WaitView",
]

D = TypeVar("D", bound=EventData)


class RunStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL_RUN


#: The events that end a run, and the status each leaves it in.
RUN_END_STATUS: dict[EventType, RunStatus] = {
    EventType.RUN_COMPLETED: RunStatus.COMPLETED,
    EventType.RUN_FAILED: RunStatus.FAILED,
    EventType.RUN_CANCELLED: RunStatus.CANCELLED,
}


class StepStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (StepStatus.COMPLETED, StepStatus.FAILED)


class WaitStatus(StrEnum):
    WAITING = "waiting"
    COMPLETED = "completed"


_TERMINAL_RUN = frozenset({RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED})
RUN_EVENTS = frozenset(
    {
        EventType.RUN_CREATED,
        EventType.RUN_STARTED,
        EventType.RUN_COMPLETED,
        EventType.RUN_FAILED,
        EventType.RUN_CANCELLED,
    }
)
STEP_EVENTS = frozenset(
    {
        EventType.STEP_CREATED,
        EventType.STEP_STARTED,
        EventType.STEP_COMPLETED,
        EventType.STEP_FAILED,
        EventType.STEP_RETRYING,
    }
)
HOOK_EVENTS = frozenset(
    {EventType.HOOK_CREATED, EventType.HOOK_RECEIVED, EventType.HOOK_DISPOSED, EventType.HOOK_CONFLICT}
)
WAIT_EVENTS = frozenset({EventType.WAIT_CREATED, EventType.WAIT_COMPLETED})
#: Markers of versioned code (``patched()``): they change no view, only what a replay of the run decides.
PATCH_EVENTS = frozenset({EventType.PATCH_APPLIED})
#: A run's child runs (:mod:`celery_workflow.runtime.children`): they keep no view; the parent's log is the record.
CHILD_EVENTS = frozenset({EventType.CHILD_STARTED, EventType.CHILD_ENDED})
CREATION_EVENTS = frozenset(
    {
        EventType.STEP_CREATED,
        EventType.HOOK_CREATED,
        EventType.HOOK_CONFLICT,
        EventType.WAIT_CREATED,
        EventType.CHILD_STARTED,
    }
)


# -- records ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NewEvent:
    """An event to append. ``data`` holds JSON values only (payloads already passed through ``codec.to_json``).

    Build one from its typed data with :meth:`of`. One built from a dict is checked when it is appended (the World's
    validation reads :attr:`body`, EventInvalid when ``data`` does not fit its type)."""

    event_type: EventType
    correlation_id: str | None = None
    data: Mapping[str, Any] = field(default_factory=dict)
    _body: EventData | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def of(cls, body: EventData, correlation_id: str | None = None) -> NewEvent:
        """The event of typed data ``body`` (its type is ``body.TYPE``)."""
        new = cls(body.TYPE, correlation_id, body.to_data())
        object.__setattr__(new, "_body", body)
        return new

    @property
    def body(self) -> EventData:
        """The typed view of ``data``; EventInvalid when it does not fit the event type's data."""
        body = self._body
        if body is None:
            if not isinstance(self.event_type, EventType):
                raise EventInvalid(f"unknown event type {self.event_type!r}")
            try:
                body = data_of(self.event_type, self.data, writing=True)
            except ValueError as exc:
                raise EventInvalid(f"{self.event_type}: {exc}") from None
            object.__setattr__(self, "_body", body)
        return body

    def data_as(self, kind: type[D]) -> D:
        """:attr:`body` as ``kind``; TypeError when the event is of another type (a caller's mistake)."""
        return _as(self.body, kind, self.event_type)


@dataclass(frozen=True, slots=True)
class Event:
    """A stored event. ``data`` is the stored JSON object; :attr:`body` its typed view, checked when the event is
    built (EventUnreadable: a World read an event that does not fit its type's data)."""

    run_id: str
    slot: int
    event_type: EventType
    correlation_id: str | None
    data: Mapping[str, Any]
    created_at: datetime
    body: EventData = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.event_type, EventType):
            raise UnknownEventType(f"event {self.slot} of run {self.run_id}: unknown event type {self.event_type!r}")
        try:
            body = data_of(self.event_type, self.data, writing=False)
        except ValueError as exc:
            raise EventUnreadable(
                f"event {self.slot} of run {self.run_id} ({self.event_type}) does not fit this version's"
                f" {self.event_type} data: {exc} (written by a newer celery_workflow, or damaged)"
            ) from None
        object.__setattr__(self, "body", body)

    def data_as(self, kind: type[D]) -> D:
        """:attr:`body` as ``kind``; TypeError when the event is of another type (a caller's mistake)."""
        return _as(self.body, kind, self.event_type)


def _as(body: EventData, kind: type[D], event_type: EventType) -> D:
    if not isinstance(body, kind):
        raise TypeError(f"a {event_type} event has no {kind.__name__} data")
    return body


@dataclass(frozen=True, slots=True)
class RunView:
    run_id: str
    workflow_name: str
    status: RunStatus
    input: Any
    queue: str | None
    created_at: datetime
    updated_at: datetime
    event_count: int
    output: Any = None
    error: Mapping[str, Any] | None = None
    started_at: datetime | None = None
    completed_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class StepView:
    run_id: str
    step_id: str
    step_name: str
    status: StepStatus
    input: Any
    created_at: datetime
    updated_at: datetime
    attempt: int = 0
    output: Any = None
    error: Mapping[str, Any] | None = None
    owner: str | None = None
    queue: str | None = None
    started_at: datetime | None = None
    completed_at: datetime | None = None
    retry_after: datetime | None = None


@dataclass(frozen=True, slots=True)
class HookView:
    run_id: str
    hook_id: str
    token: str
    created_at: datetime
    metadata: Any = None
    is_webhook: bool = False
    respond_with: Any = None


@dataclass(frozen=True, slots=True)
class WaitView:
    run_id: str
    wait_id: str
    status: WaitStatus
    resume_at: datetime
    created_at: datetime
    completed_at: datetime | None = None
