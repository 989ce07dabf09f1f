"""What the inspector's pages show, computed from the World's reads alone (no Flask here).

* :func:`timeline`: the steps, sleeps and hooks of a run in the order they first appear in its event log, each step
  with its attempts (``step_started`` to the ``step_completed`` / ``step_failed`` / ``step_retrying`` that ended it);
* :func:`status_counts`: runs per status among the newest :data:`COUNT_WINDOW` runs (the World protocol has no count,
  so this is one bounded listing, not a count of every run);
* :func:`event_data`: an event's data as the event log shows it, hook tokens hidden;
* formatting of times, durations, JSON values and stream chunks: a value in a list (a step's result, an event's data,
  a stream chunk) is cut at :data:`MAX_LISTED` bytes with a marker, and the page links to where it is shown whole.

The run page reads its log in batches of :data:`EVENT_BATCH` and keeps of each event only what the timeline shows
(:func:`slim`): a run of large values costs the server a batch of them at a time, not the whole log.

Times are those the World recorded with the events: a step's duration is the time between the appends that recorded
its start and its end, which is what the log knows.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from celery_workflow import codec
from celery_workflow.errors import PayloadError
from celery_workflow.event_data import (
    ChildEndedData,
    ChildStartedData,
    HookCreatedData,
    PatchAppliedData,
    StepCompletedData,
    StepCreatedData,
    StepFailedData,
    StepRetryingData,
    StepStartedData,
    WaitCreatedData,
)
from celery_workflow.events import Event, EventType, RunStatus, RunView
from celery_workflow.rpc import TOKEN_EVENTS, TOKEN_FIELDS
from celery_workflow.world import Page, World

#: How many of the newest runs the status counts look at.
COUNT_WINDOW = 500
#: What a hidden hook token is shown as.
HIDDEN = "•••••• (hidden)"
#: The longest JSON text shown for one value on its own (a run's input or output; a longer one is cut with a marker).
MAX_SHOWN = 64 * 1024
#: The longest JSON text shown for a value in a list (a step's result or error in the timeline, an event's data, a
#: stream chunk, a hook's metadata); a longer one is cut with a marker and a link to it whole.
MAX_LISTED = 2 * 1024
#: The longest text of a value on a page of its own (a step, an event, a run's input): any stored value fits.
MAX_WHOLE = 4 * 1_048_576
#: The most events the timeline reads (in pages of :data:`EVENT_BATCH`).
MAX_TIMELINE_EVENTS = 10_000
EVENT_BATCH = 100
#: The event data fields holding values of any size, which the run page drops (:func:`slim`); a step's result is
#: kept as a cut preview.
PAYLOAD_FIELDS = frozenset({"input", "output", "result", "payload", "metadata", "respond_with", "continued_with"})


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


@dataclass(frozen=True, slots=True)
class Shown:
    """A value's text on a page and whether it was cut (the page then links to it whole)."""

    text: str
    cut: bool


def preview(value: Any, *, limit: int = MAX_LISTED, compact: bool = False) -> Shown:
    """:func:`show_json` at ``limit`` bytes, saying whether it was cut."""
    whole = show_json(value, limit=MAX_WHOLE, compact=compact)
    text = codec.cut(whole, limit)
    return Shown(text, text != whole)


def show_chunk(data: bytes, limit: int = MAX_SHOWN) -> str:
    """A stream chunk as text: its JSON value, or ``bytes (N): <base64>`` for raw bytes, cut at ``limit`` bytes."""
    return chunk_preview(data, limit).text


def chunk_preview(data: bytes, limit: int = MAX_LISTED) -> Shown:
    """A stream chunk's text (see :func:`show_chunk`) at ``limit`` bytes, saying whether it was cut."""
    try:
        value = codec.loads(data)
    except (ValueError, PayloadError):
        return Shown(f"undecodable chunk of {len(data)} bytes", False)
    if isinstance(value, bytes):
        text = f"bytes ({len(value)}): {base64.b64encode(value).decode()}"
        shown = codec.cut(text, limit)
        return Shown(shown, shown != text)
    return preview(value, limit=limit)


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
    """One line of the timeline: a step (with attempts), a sleep, a hook, a change the run took (``patched``), or a
    child run (``child_run_id``: the child's run id)."""

    kind: str  # step | sleep | hook | patch | child
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
    output: Shown | None = None  # a step's result, cut at MAX_LISTED
    child_run_id: str | None = None

    @property
    def has_output(self) -> bool:
        return self.output is not None

    @property
    def duration(self) -> timedelta | None:
        return None if self.ended_at is None else self.ended_at - self.created_at


def _cut_error(error: Any) -> Any:
    """A recorded error with its message and traceback cut for a list (:data:`MAX_LISTED` each)."""
    if not isinstance(error, Mapping):
        return error
    out = dict(error)
    for key in ("message", "traceback"):
        if isinstance(out.get(key), str):
            out[key] = codec.cut(out[key], MAX_LISTED)
    return out


def slim(ev: Event) -> Event:
    """``ev`` with only the data the timeline shows: the fields of its type but :data:`PAYLOAD_FIELDS` (None), an
    error cut for a list and, for a completed step, its result as a cut preview (a :class:`Shown`)."""
    known = ev.body.NAMES
    data: dict[str, Any] = {k: None if k in PAYLOAD_FIELDS else v for k, v in ev.data.items() if k in known}
    if "error" in data:
        data["error"] = _cut_error(data["error"])
    if isinstance(ev.body, StepCompletedData):
        data["result"] = preview(ev.body.result)
    return dataclasses.replace(ev, data=data)


def read_events(world: World, run_id: str, *, limit: int = MAX_TIMELINE_EVENTS) -> tuple[list[Event], bool]:
    """The run's first ``limit`` events, read in batches and :func:`slim`; True when the log goes on beyond them."""
    events: list[Event] = []
    while len(events) < limit:
        batch = world.list_events(run_id, after_slot=events[-1].slot if events else 0, limit=EVENT_BATCH)
        events.extend(slim(ev) for ev in batch)
        if len(batch) < EVENT_BATCH:
            return events[:limit], False
    more = bool(world.list_events(run_id, after_slot=events[limit - 1].slot, limit=1))
    return events[:limit], more


#: ``queue_of(step_name)``: the queue a step is routed to (None: the run's), or :data:`UNKNOWN` for a step the
#: inspector's Workflows does not know (served on a World alone).
QueueOf = Callable[[str], "str | None"]
UNKNOWN = "?"


def timeline(run: RunView, events: Iterable[Event], queue_of: QueueOf | None = None) -> list[Item]:
    """Steps, sleeps, hooks and child runs in the order of their first event, each step's status, result and error as its
    events record them. A step's queue: the one its ``step_created`` records, else the one ``queue_of`` says it is
    routed to (the run's when it is not routed; none shown when the step is unknown). A step run inline ran in the
    run's own delivery, on the run's queue."""
    items: dict[str, Item] = {}
    for ev in events:
        cid = ev.correlation_id
        if cid is None:
            continue
        kind = ev.event_type
        body = ev.body
        item = items.get(cid)
        if isinstance(body, StepCreatedData):
            queue = _step_queue(run, body, queue_of)
            items[cid] = Item(
                "step", cid, body.step_name, "pending", ev.slot, ev.created_at, mode=body.mode, queue=queue
            )
        elif isinstance(body, StepStartedData) and item is not None:
            number = body.attempt or len(item.attempts) + 1
            item.attempts.append(Attempt(number, ev.created_at, owner=body.owner))
            item.status = "running"
        elif kind in (EventType.STEP_COMPLETED, EventType.STEP_FAILED, EventType.STEP_RETRYING) and item is not None:
            _end_attempt(item, ev)
        elif isinstance(body, WaitCreatedData):
            items[cid] = Item("sleep", cid, "sleep", "waiting", ev.slot, ev.created_at, due_at=body.resume_at)
        elif kind is EventType.WAIT_COMPLETED and item is not None:
            item.status, item.ended_at = "completed", ev.created_at
        elif kind in (EventType.HOOK_CREATED, EventType.HOOK_CONFLICT):
            webhook = isinstance(body, HookCreatedData) and body.is_webhook
            status = "conflict" if kind is EventType.HOOK_CONFLICT else "waiting"
            items[cid] = Item("hook", cid, "webhook" if webhook else "hook", status, ev.slot, ev.created_at)
        elif kind is EventType.HOOK_RECEIVED and item is not None:
            item.received += 1
            item.status, item.ended_at = "received", ev.created_at
        elif kind is EventType.HOOK_DISPOSED and item is not None:
            item.status, item.ended_at = "disposed", ev.created_at
        elif isinstance(body, PatchAppliedData) and item is None:
            items[cid] = Item("patch", cid, body.change_id, "applied", ev.slot, ev.created_at)
        elif isinstance(body, ChildStartedData):
            if item is None:
                items[cid] = Item("child", cid, body.workflow_name, "running", ev.slot, ev.created_at)
            else:  # its end was recorded first (the child ended before the parent's start of it was written)
                item.title, item.slot = body.workflow_name, ev.slot
            items[cid].child_run_id = body.run_id
        elif isinstance(body, ChildEndedData):
            if item is None:
                item = items[cid] = Item("child", cid, "child run", body.status, ev.slot, ev.created_at)
            item.status, item.ended_at, item.child_run_id = body.status, ev.created_at, body.run_id
            item.error = body.error
    for item in items.values():
        if item.kind != "step" and item.status in ("waiting", "received") and run.status.terminal:
            item.status = "ended with the run" if item.status == "waiting" else item.status
    return sorted(items.values(), key=lambda i: i.slot)


def _step_queue(run: RunView, created: StepCreatedData, queue_of: QueueOf | None) -> str | None:
    if created.queue:
        return created.queue
    if created.mode == "inline":
        return run.queue
    routed = queue_of(created.step_name) if queue_of is not None else UNKNOWN
    if routed == UNKNOWN:
        return None
    return routed or run.queue


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
    body = ev.body
    if isinstance(body, StepCompletedData):
        item.status, item.ended_at = "completed", ev.created_at
        shown = body.result
        item.output = shown if isinstance(shown, Shown) else preview(shown)
    elif isinstance(body, StepFailedData):
        attempt.error = body.error
        item.status, item.ended_at, item.error = "failed", ev.created_at, body.error
    elif isinstance(body, StepRetryingData):  # pending again until its next attempt
        attempt.error, attempt.retry_after = body.error, body.retry_after
        item.status, item.error = "pending", body.error


def event_data(ev: Event) -> dict[str, Any]:
    """An event's data for the event log: a hook token in it hidden (``hook_created``, ``hook_conflict``, and
    ``hook_disposed``, which once recorded the token another run took over)."""
    data = dict(ev.data)
    if ev.event_type in TOKEN_EVENTS:
        for key in TOKEN_FIELDS & set(data):
            data[key] = HIDDEN
    return data
