"""What a run in progress waits for (issue #30, item 5): ``Run.waiting_on``, RPC ``get_run``, ``runs list --waiting``,
``runs show``, ``runs watch`` and the inspector's runs list.

Derived from the run's event log alone (:func:`waiting_on`), plus, where the World's queue store records its
consumers (SQLite, Postgres), which queues nobody consumes (:func:`~celery_workflow.worker_setup.queue_consumers`).
A run that has ended waits for nothing. Otherwise each of these is one item, in the order they began:

* :class:`Sleep`: a ``sleep()`` until ``until`` (``wait_created`` without its ``wait_completed``);
* :class:`HookWait`: a live hook or webhook (``hook_created`` without ``hook_disposed``), with the payloads it has
  received; its ``token`` is None (hidden) unless the caller may see it (``reveal=True``);
* :class:`StepRetry`: a step that failed an attempt and is retried at ``retry_at`` (``step_retrying``), with that
  attempt's error;
* :class:`StepWait`: a step queued or running (``step_created``/``step_started`` without an outcome);
* :class:`QueueWait`: a delivery due on a queue no worker consumes: the run's own queue while it has not started, or
  when it waits for nothing else (its wake-up is due there); a step's queue while the step is queued there;
* :class:`ChildWait`: a child run it started that has not ended (``child_started`` without ``child_ended``), with
  its run id and workflow: look there for what the child itself waits for.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any, Literal

from celery_workflow import ids
from celery_workflow.errors import PayloadError
from celery_workflow.event_data import EventType
from celery_workflow.events import Event, RunStatus

__all__ = [
    "ChildWait",
    "HookWait",
    "QueueWait",
    "Sleep",
    "StepRetry",
    "StepWait",
    "Waiting",
    "describe",
    "run_waiting_on",
    "waiting_json",
    "waiting_of_json",
    "waiting_on",
]


@dataclass(frozen=True, slots=True)
class Sleep:
    wait_id: str
    until: datetime
    kind: Literal["sleep"] = "sleep"


@dataclass(frozen=True, slots=True)
class HookWait:
    hook_id: str
    token: str | None  # None: hidden
    is_webhook: bool
    metadata: Any
    since: datetime
    received: int = 0
    kind: Literal["hook"] = "hook"


@dataclass(frozen=True, slots=True)
class StepRetry:
    step_id: str
    step_name: str
    attempt: int
    retry_at: datetime | None
    error: Mapping[str, Any] = field(default_factory=dict)
    kind: Literal["retry"] = "retry"


@dataclass(frozen=True, slots=True)
class StepWait:
    step_id: str
    step_name: str
    status: Literal["queued", "running"]
    attempt: int = 0
    kind: Literal["step"] = "step"


@dataclass(frozen=True, slots=True)
class QueueWait:
    queue: str
    what: str  # "run" (its start or wake-up) or a step id
    kind: Literal["queue"] = "queue"


@dataclass(frozen=True, slots=True)
class ChildWait:
    child_id: str  # the child's correlation id (child:<n>)
    run_id: str
    workflow_name: str
    kind: Literal["child"] = "child"


Waiting = Sleep | HookWait | StepRetry | StepWait | QueueWait | ChildWait


@dataclass
class _Step:
    name: str
    queue: str | None
    mode: str | None
    status: str = "queued"
    attempt: int = 0
    retry_at: datetime | None = None
    error: Mapping[str, Any] = field(default_factory=dict)
    since: int = 0


def waiting_on(
    events: Sequence[Event],
    *,
    reveal: bool = False,
    consumers: Mapping[str, int] | None = None,
    status: RunStatus | None = None,
) -> list[Waiting]:
    """What the run of ``events`` (its whole log, in slot order) waits for; ``consumers``: live consumers per queue
    (None: unknown, no :class:`QueueWait` is said); ``status``: the run's status when known (else read from the log)."""
    run_queue: str | None = None
    started = False
    ended = status is not None and status.terminal
    sleeps: dict[str, tuple[int, Sleep]] = {}
    hooks: dict[str, tuple[int, HookWait]] = {}
    steps: dict[str, _Step] = {}
    children: dict[str, tuple[int, ChildWait]] = {}
    for ev in events:
        kind, cid, data = ev.event_type, ev.correlation_id or "", ev.data
        if kind is EventType.RUN_CREATED:
            run_queue = data.get("queue")
        elif kind is EventType.RUN_STARTED:
            started = True
        elif kind in (EventType.RUN_COMPLETED, EventType.RUN_FAILED, EventType.RUN_CANCELLED):
            ended = True
        elif kind is EventType.WAIT_CREATED:
            sleeps[cid] = (ev.slot, Sleep(cid, ids.parse_iso(str(data["resume_at"]))))
        elif kind is EventType.WAIT_COMPLETED:
            sleeps.pop(cid, None)
        elif kind is EventType.HOOK_CREATED:
            token = str(data.get("token")) if reveal else None
            hooks[cid] = (
                ev.slot,
                HookWait(cid, token, bool(data.get("is_webhook")), data.get("metadata"), ev.created_at),
            )
        elif kind is EventType.HOOK_RECEIVED and cid in hooks:
            slot, hook = hooks[cid]
            hooks[cid] = (
                slot,
                HookWait(hook.hook_id, hook.token, hook.is_webhook, hook.metadata, hook.since, hook.received + 1),
            )
        elif kind is EventType.HOOK_DISPOSED:
            hooks.pop(cid, None)
        elif kind is EventType.STEP_CREATED:
            steps[cid] = _Step(str(data.get("step_name")), data.get("queue"), data.get("mode"), since=ev.slot)
        elif kind is EventType.STEP_STARTED and cid in steps:
            steps[cid].status = "running"
            steps[cid].attempt = int(data.get("attempt") or steps[cid].attempt + 1)
            steps[cid].retry_at = None
        elif kind is EventType.STEP_RETRYING and cid in steps:
            step = steps[cid]
            step.status = "retrying"
            step.error = dict(data.get("error") or {})
            retry = data.get("retry_after")
            step.retry_at = ids.parse_iso(str(retry)) if retry else None
        elif kind in (EventType.STEP_COMPLETED, EventType.STEP_FAILED):
            steps.pop(cid, None)
        elif kind is EventType.CHILD_STARTED:
            children[cid] = (ev.slot, ChildWait(cid, str(data["run_id"]), str(data.get("workflow_name") or "")))
        elif kind is EventType.CHILD_ENDED:
            children.pop(cid, None)
    if ended:
        return []
    found: list[tuple[int, Waiting]] = [*sleeps.values(), *hooks.values(), *children.values()]
    idle = {q for q, n in (consumers or {}).items() if not n} if consumers is not None else set()

    def unconsumed(queue: str | None) -> bool:
        return consumers is not None and bool(queue) and (queue in idle or queue not in consumers)

    for step_id, step in steps.items():
        if step.status == "retrying":
            found.append((step.since, StepRetry(step_id, step.name, step.attempt, step.retry_at, step.error)))
            continue
        queue = step.queue or run_queue
        if step.status == "queued" and step.mode != "inline" and unconsumed(queue):
            found.append((step.since, QueueWait(str(queue), step_id)))
            continue
        found.append(
            (
                step.since,
                StepWait(step_id, step.name, "running" if step.status == "running" else "queued", step.attempt),
            )
        )
    if (not started or not found) and unconsumed(run_queue):
        found.insert(0, (0, QueueWait(str(run_queue), "run")))  # its start, or a wake-up due with nothing else pending
    return [item for _, item in sorted(found, key=lambda pair: pair[0])]


def describe(item: Waiting) -> str:
    """One line saying what ``item`` is (the CLI's and the inspector's wording)."""
    if isinstance(item, Sleep):
        return f"sleep until {ids.isoformat(item.until)}"
    if isinstance(item, HookWait):
        what = "webhook" if item.is_webhook else "hook"
        token = f" {item.token}" if item.token is not None else " (token hidden)"
        return f"{what} {item.hook_id}{token}" + (f", {item.received} received" if item.received else "")
    if isinstance(item, StepRetry):
        when = ids.isoformat(item.retry_at) if item.retry_at else "now"
        error = item.error.get("message") or item.error.get("type") or "an error"
        return f"step {item.step_name} ({item.step_id}) retry {item.attempt + 1} at {when} after: {error}"
    if isinstance(item, StepWait):
        return f"step {item.step_name} ({item.step_id}) {item.status}"
    if isinstance(item, ChildWait):
        return f"child run {item.run_id} ({item.workflow_name})"
    what = "its start" if item.what == "run" else f"step {item.what}"
    return f"queue {item.queue}: no worker consumes it ({what} is due there)"


def waiting_json(items: Iterable[Waiting]) -> list[dict[str, Any]]:
    """The items as JSON objects (``kind`` first, times as ISO strings, a hidden token as None)."""
    out: list[dict[str, Any]] = []
    for item in items:
        data: dict[str, Any] = {"kind": item.kind}
        for spec in fields(item):
            value = getattr(item, spec.name)
            data[spec.name] = ids.isoformat(value) if isinstance(value, datetime) else value
        data["text"] = describe(item)
        out.append(data)
    return out


#: Each item class by its ``kind``.
KINDS: dict[str, type[Waiting]] = {
    str(next(spec.default for spec in fields(cls) if spec.name == "kind")): cls
    for cls in (Sleep, HookWait, StepRetry, StepWait, QueueWait, ChildWait)
}


def waiting_of_json(data: Mapping[str, Any]) -> Waiting | None:
    """The item :func:`waiting_json` wrote (its ``text`` dropped: :func:`describe` gives it again); None for a kind
    this version does not know (a newer server's), PayloadError for one of a known kind whose fields do not fit."""
    if not isinstance(data, Mapping):
        raise PayloadError(f"an item of waiting_on is a JSON object, not {type(data).__name__}")
    cls = KINDS.get(str(data.get("kind")))
    if cls is None:
        return None
    values: dict[str, Any] = {}
    try:
        for spec in fields(cls):
            if spec.name == "kind" or spec.name not in data:
                continue
            value = data[spec.name]
            if spec.type in ("datetime", "datetime | None") and value is not None:
                value = ids.parse_iso(value)
            values[spec.name] = value
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise PayloadError(f"not a {cls.__name__} of waiting_on: {exc}") from exc


def run_waiting_on(world: Any, run_id: str, *, reveal: bool = False) -> list[Waiting]:
    """What run ``run_id`` of ``world`` waits for (RunNotFound for an unknown run): its log read at one point in time,
    and the consumers the World's queue store records."""
    from celery_workflow.worker_setup import queue_consumers

    view, events = world.get_run_with_events(run_id)
    if view.status.terminal:
        return []
    return waiting_on(events, reveal=reveal, consumers=queue_consumers(world), status=view.status)
