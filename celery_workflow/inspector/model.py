"""What the inspector's pages show, computed from the World's reads alone (no Flask here).

* :func:`timeline`: the steps, sleeps and hooks of a run in the order they first appear in its event log, each step
  with its attempts (``step_started`` to the ``step_completed`` / ``step_failed`` / ``step_retrying`` that ended it);
* :func:`status_counts`: runs per status among the newest :data:`COUNT_WINDOW` runs (the World protocol has no count,
  so this is one bounded listing, not a count of every run);
* :func:`event_data`: an event's data as the event log shows it, hook tokens hidden;
* formatting of times, durations, JSON values and stream chunks.

Times are those the World recorded with the events: a step's duration is the time between the appends that recorded
its start and its end, which is what the log knows.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from celery_workflow import codec
from celery_workflow.errors import PayloadError
from celery_workflow.events import Event, EventType, RunStatus, RunView, StepView
from celery_workflow.world import Page, World

#: How many of the newest runs the status counts look at.
COUNT_WINDOW = 500
#: What a hidden hook token is shown as.
HIDDEN = "•••••• (hidden)"
#: The longest JSON text shown for one value (a longer one is cut with a marker).
MAX_SHOWN = 64 * 1024
#: The most events the timeline reads (in pages of :data:`EVENT_BATCH`).
MAX_TIMELINE_EVENTS = 10_000
EVENT_BATCH = 1000
#: The event data fields that carry a hook token.
TOKEN_FIELDS = frozenset({"token"})


# -- formatting --------------------------------------------------------------------------------------------------------


def show_time(value: datetime | None) -> str:
    """``2026-12-02 08:40:47.726 UTC`` (empty for None)."""
    if value is None:
        return ""
    if value.tzinfo is not None:
        value = value.astimezone(UTC)
    return value.strftime("%Y-%m-%d %H:%M:%S.") + f"{value.microsecond // 1000:03d} UTC"


def show_duration(value: timedelta | None) -> str:
    """``12 ms``, ``1.25 s``, ``3 min 4 s``, ``2 h 5 min``, ``3 d 4 h`` (negative values read as their size)."""
    if value is None:
        return ""
    seconds = abs(value.total_seconds())
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.2f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes} min"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h"


def show_relative(value: datetime | None, now: datetime) -> str:
    """``in 59 min 58 s`` or ``2 s ago``."""
    if value is None:
        return ""
    delta = value - now
    return f"in {show_duration(delta)}" if delta.total_seconds() >= 0 else f"{show_duration(delta)} ago"


def show_json(value: Any, *, limit: int = MAX_SHOWN, compact: bool = False) -> str:
    """Indented (or, ``compact``, one-line) JSON of a stored value, cut at ``limit`` bytes."""
    try:
        text = json.dumps(value, indent=None if compact else 2, ensure_ascii=False, default=str)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return codec.cut(text, limit)


def show_chunk(data: bytes) -> str:
    """A stream chunk as text: its JSON value, or ``bytes (N): <base64>`` for raw bytes."""
    try:
        value = codec.loads(data)
    except (ValueError, PayloadError):
        return f"undecodable chunk of {len(data)} bytes"
    if isinstance(value, bytes):
        return codec.cut(f"bytes ({len(value)}): {base64.b64encode(value).decode()}", MAX_SHOWN)
    return show_json(value)


def error_text(error: Mapping[str, Any] | None) -> str:
    """``Type: message`` of a recorded error."""
    if not error:
        return ""
    kind, message = error.get("type"), error.get("message")
    return f"{kind}: {message}" if kind else str(message or "")


# -- the runs list -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Counts:
    """Runs per status among the newest ``seen`` runs; ``more``: there are older runs beyond the window."""

    by_status: dict[str, int]
    seen: int
    more: bool
    workflows: list[str]


def status_counts(world: World, *, workflow: str | None = None, window: int = COUNT_WINDOW) -> Counts:
    """One listing of the newest ``window`` runs (of ``workflow``), counted by status."""
    page: Page[RunView] = world.list_runs(workflow=workflow, limit=window)
    by_status = {status.value: 0 for status in RunStatus}
    for run in page.items:
        by_status[run.status.value] += 1
    names = sorted({run.workflow_name for run in page.items})
    return Counts(by_status, len(page.items), page.cursor is not None, names)


# -- the run page ------------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Attempt:
    number: int
    started_at: datetime
    ended_at: datetime | None = None
    outcome: str = "running"  # completed | failed | retrying | running
    error: Mapping[str, Any] | None = None
    retry_after: datetime | None = None
    owner: str | None = None

    @property
    def duration(self) -> timedelta | None:
        return None if self.ended_at is None else self.ended_at - self.started_at


@dataclass(slots=True)
class Item:
    """One line of the timeline: a step (with attempts), a sleep or a hook."""

    kind: str  # step | sleep | hook
    correlation_id: str
    title: str
    status: str
    slot: int
    created_at: datetime
    ended_at: datetime | None = None
    attempts: list[Attempt] = field(default_factory=list)
    mode: str | None = None
    queue: str | None = None
    due_at: datetime | None = None
    received: int = 0
    error: Mapping[str, Any] | None = None
    output: Any = None
    has_output: bool = False

    @property
    def duration(self) -> timedelta | None:
        return None if self.ended_at is None else self.ended_at - self.created_at


def read_events(world: World, run_id: str, *, limit: int = MAX_TIMELINE_EVENTS) -> tuple[list[Event], bool]:
    """The run's first ``limit`` events, read in pages; True when the log goes on beyond them."""
    events: list[Event] = []
    while len(events) < limit:
        batch = world.list_events(run_id, after_slot=events[-1].slot if events else 0, limit=EVENT_BATCH)
        events.extend(batch)
        if len(batch) < EVENT_BATCH:
            return events[:limit], False
    more = bool(world.list_events(run_id, after_slot=events[limit - 1].slot, limit=1))
    return events[:limit], more


def timeline(run: RunView, events: Iterable[Event], steps: Sequence[StepView]) -> list[Item]:
    """Steps, sleeps and hooks in the order of their first event; step status, queue and result from the views."""
    items: dict[str, Item] = {}
    views = {step.step_id: step for step in steps}
    for ev in events:
        cid = ev.correlation_id
        if cid is None:
            continue
        kind = ev.event_type
        item = items.get(cid)
        if kind is EventType.STEP_CREATED:
            view = views.get(cid)
            items[cid] = Item(
                "step",
                cid,
                str(ev.data.get("step_name", cid)),
                view.status.value if view else "pending",
                ev.slot,
                ev.created_at,
                mode=str(ev.data.get("mode")) if ev.data.get("mode") else None,
                queue=(view.queue if view else None) or ev.data.get("queue") or run.queue,
            )
        elif kind is EventType.STEP_STARTED and item is not None:
            number = int(ev.data.get("attempt", len(item.attempts) + 1))
            item.attempts.append(Attempt(number, ev.created_at, owner=ev.data.get("owner")))
        elif kind in (EventType.STEP_COMPLETED, EventType.STEP_FAILED, EventType.STEP_RETRYING) and item is not None:
            _end_attempt(item, ev)
        elif kind is EventType.WAIT_CREATED:
            due = ev.data.get("resume_at")
            items[cid] = Item(
                "sleep", cid, "sleep", "waiting", ev.slot, ev.created_at, due_at=_parse(due) if due else None
            )
        elif kind is EventType.WAIT_COMPLETED and item is not None:
            item.status, item.ended_at = "completed", ev.created_at
        elif kind in (EventType.HOOK_CREATED, EventType.HOOK_CONFLICT):
            webhook = bool(ev.data.get("is_webhook"))
            status = "conflict" if kind is EventType.HOOK_CONFLICT else "waiting"
            items[cid] = Item("hook", cid, "webhook" if webhook else "hook", status, ev.slot, ev.created_at)
        elif kind is EventType.HOOK_RECEIVED and item is not None:
            item.received += 1
            item.status, item.ended_at = "received", ev.created_at
        elif kind is EventType.HOOK_DISPOSED and item is not None:
            item.status, item.ended_at = "disposed", ev.created_at
    for item in items.values():
        view = views.get(item.correlation_id)
        if item.kind == "step" and view is not None:
            item.status = view.status.value
            item.error = view.error
            item.has_output = view.status.value == "completed"
            item.output = view.output
            item.ended_at = view.completed_at
        elif item.kind != "step" and item.status in ("waiting", "received") and run.status.terminal:
            item.status = "ended with the run" if item.status == "waiting" else item.status
    return sorted(items.values(), key=lambda i: i.slot)


def _end_attempt(item: Item, ev: Event) -> None:
    if not item.attempts:  # an end without a recorded start (a log read from its middle)
        item.attempts.append(Attempt(0, ev.created_at))
    attempt = item.attempts[-1]
    attempt.ended_at = ev.created_at
    attempt.outcome = {
        EventType.STEP_COMPLETED: "completed",
        EventType.STEP_FAILED: "failed",
        EventType.STEP_RETRYING: "retrying",
    }[ev.event_type]
    attempt.error = ev.data.get("error")
    retry_after = ev.data.get("retry_after")
    attempt.retry_after = _parse(retry_after) if retry_after else None


def _parse(value: Any) -> datetime | None:
    try:
        return datetime.fromisoformat(str(value))
    except ValueError:
        return None


def event_data(ev: Event) -> dict[str, Any]:
    """An event's data for the event log: the token of a hook's creation (or conflict) hidden."""
    data = dict(ev.data)
    if ev.event_type in (EventType.HOOK_CREATED, EventType.HOOK_CONFLICT):
        for key in TOKEN_FIELDS & set(data):
            data[key] = HIDDEN
    return data
