"""Event types, statuses and the records of the event log: events and the entity views (run, step, hook, wait).

A run's state is its event log. Each run's events are numbered 1, 2, 3 … (*slots*) with no gaps, in commit order.
Views (run, step, hook, wait) are derived from the log and kept by the World in the same atomic write. How a batch of
events is checked and turned into the writes that keep them is :mod:`celery_workflow.rules`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any


class EventType(StrEnum):
    RUN_CREATED = "run_created"
    RUN_STARTED = "run_started"
    RUN_COMPLETED = "run_completed"
    RUN_FAILED = "run_failed"
    RUN_CANCELLED = "run_cancelled"
    STEP_CREATED = "step_created"
    STEP_STARTED = "step_started"
    STEP_COMPLETED = "step_completed"
    STEP_FAILED = "step_failed"
    STEP_RETRYING = "step_retrying"
    HOOK_CREATED = "hook_created"
    HOOK_RECEIVED = "hook_received"
    HOOK_DISPOSED = "hook_disposed"
    HOOK_CONFLICT = "hook_conflict"
    WAIT_CREATED = "wait_created"
    WAIT_COMPLETED = "wait_completed"


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
CREATION_EVENTS = frozenset(
    {EventType.STEP_CREATED, EventType.HOOK_CREATED, EventType.HOOK_CONFLICT, EventType.WAIT_CREATED}
)


# -- records ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NewEvent:
    """An event to append. ``data`` holds JSON values only (payloads already passed through ``codec.to_json``)."""

    event_type: EventType
    correlation_id: str | None = None
    data: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Event:
    """A stored event."""

    run_id: str
    slot: int
    event_type: EventType
    correlation_id: str | None
    data: Mapping[str, Any]
    created_at: datetime


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
