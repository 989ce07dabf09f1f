"""The World's side of child runs: the link a child run keeps to its parent, and the wake-up its end writes.

A child run's ``run_created`` carries ``parent`` (:class:`ParentLink`): the parent's run id, the correlation id of the
``child_started`` that started it (``child:<n>``), and ``wake``, the parent's workflow delivery as the parent's
runtime built it (a Celery message envelope, opaque here but for its ids). When an append ends the child, the append
template (:mod:`.template`) writes, in the same transaction as the child's end, the parent's ``child_ended`` (the
child's outcome, :func:`ended_event`) and a fresh copy of that delivery (:func:`wake_delivery`): a crash cannot keep
the child's end and lose the parent's wake-up. A parent that has ended takes no ``child_ended``; the child's end is
written alone then.

A child that hands over (``continue_as_new``) wakes nobody: its successor carries the same link and its end is the
one the parent waits for.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from celery_workflow.errors import EventInvalid, NotFound, RunTerminal
from celery_workflow.event_data import (
    ChildEndedData,
    ChildStartedData,
    RunCancelledData,
    RunCompletedData,
    RunCreatedData,
    RunFailedData,
)
from celery_workflow.events import RUN_END_STATUS, Event, EventType, NewEvent, RunView
from celery_workflow.ids import new_delivery_id
from celery_workflow.world import Delivery

__all__ = [
    "WAKE_KEY",
    "Child",
    "ParentLink",
    "children_of",
    "close_children",
    "ended_event",
    "link_of",
    "parent_data",
    "parsed",
    "wake_delivery",
]

#: The idempotency key of a parent's wake-up (the runtime's own wake-ups use it too: one pending wake-up per run).
WAKE_KEY = "wake"


@dataclass(frozen=True, slots=True)
class ParentLink:
    """Where a child run's end is reported: run ``run_id``'s ``child_ended`` with ``correlation_id``, woken by a copy
    of ``wake`` (the parent's workflow delivery, a UTF-8 JSON message envelope) on ``queue``."""

    run_id: str
    correlation_id: str
    queue: str
    wake: str

    def to_data(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "correlation_id": self.correlation_id, "queue": self.queue, "wake": self.wake}

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> ParentLink:
        """EventInvalid when ``data`` is not a link."""
        try:
            link = cls(str(data["run_id"]), str(data["correlation_id"]), str(data["queue"]), str(data["wake"]))
            json.loads(link.wake)
        except (KeyError, TypeError, ValueError) as exc:
            raise EventInvalid(f"a parent link needs run_id, correlation_id, queue and wake: {exc}") from None
        return link

    @classmethod
    def of(cls, run_id: str, correlation_id: str, wake: Delivery) -> ParentLink:
        """The link to parent ``run_id`` woken by ``wake`` (a delivery its runtime built)."""
        return cls(run_id, correlation_id, wake.queue, wake.payload.decode("utf-8"))


def link_of(first: Sequence[Event]) -> ParentLink | None:
    """The parent link of the run whose first events are ``first`` (its ``run_created`` first), if it has one."""
    if not first:
        return None
    body = first[0].body
    return parsed(body.parent) if isinstance(body, RunCreatedData) else None


def parent_data(first: Sequence[Event]) -> Mapping[str, Any] | None:
    """The ``parent`` field of the ``run_created`` among ``first`` (what a World keeps in ``Snapshot.parent``)."""
    body = first[0].body if first else None
    return body.parent if isinstance(body, RunCreatedData) else None


def parsed(data: Mapping[str, Any] | None) -> ParentLink | None:
    """The link ``data`` holds, None without one (a damaged link wakes nobody rather than failing the child's end)."""
    if data is None:
        return None
    try:
        return ParentLink.from_data(data)
    except EventInvalid:
        return None


def ended_event(link: ParentLink, run: RunView, ending: Sequence[Event]) -> NewEvent | None:
    """The parent's ``child_ended`` for child ``run`` ended by the events ``ending`` (the plan's); None when the
    child handed over to a successor (which carries the link on)."""
    for ev in ending:
        status = RUN_END_STATUS.get(ev.event_type)
        if status is None:
            continue
        body = ev.body
        if isinstance(body, RunCompletedData):
            if body.continued_as is not None:
                return None
            data = ChildEndedData(run.run_id, "completed", output=body.output)
        elif isinstance(body, RunFailedData):
            data = ChildEndedData(run.run_id, "failed", error=dict(body.error))
        else:
            data = ChildEndedData(run.run_id, "cancelled")
        return NewEvent.of(data, link.correlation_id)
    return None


def wake_delivery(link: ParentLink) -> Delivery:
    """A fresh copy of the parent's wake-up: the stored envelope with a new task id (and delivery tag), so each
    delivery the World stores is one Celery task of its own (a delivery id owns inline steps)."""
    envelope = json.loads(link.wake)
    task_id = new_delivery_id()
    headers = envelope.get("headers")
    if isinstance(headers, dict):
        headers["id"] = task_id
        if "root_id" in headers:
            headers["root_id"] = task_id
    properties = envelope.get("properties")
    if isinstance(properties, dict):
        properties["correlation_id"] = task_id
        if "delivery_tag" in properties:
            properties["delivery_tag"] = str(uuid.uuid4())
    payload = json.dumps(envelope, separators=(",", ":")).encode("utf-8")
    return Delivery(link.queue, payload, link.run_id, None, WAKE_KEY)


@dataclass(frozen=True, slots=True)
class Child:
    """A child run as its parent's log tells it: ``status`` is its end's (completed, failed, cancelled), or None
    while the parent has no ``child_ended`` of it (it runs on, or ended after its parent did)."""

    run_id: str
    workflow_name: str
    parent_close: str
    status: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "workflow_name": self.workflow_name,
            "parent_close": self.parent_close,
            "status": self.status,
        }


def children_of(events: Sequence[Event]) -> list[Child]:
    """The child runs a run's log started, in the order it started them."""
    started: dict[str, ChildStartedData] = {}
    ended: dict[str, str] = {}
    for ev in events:
        if ev.event_type is EventType.CHILD_STARTED:
            started[str(ev.correlation_id)] = ev.data_as(ChildStartedData)
        elif ev.event_type is EventType.CHILD_ENDED:
            ended[str(ev.correlation_id)] = ev.data_as(ChildEndedData).status
    return [Child(c.run_id, c.workflow_name, c.parent_close, ended.get(cid)) for cid, c in started.items()]


def close_children(world: Any, run_id: str, events: Sequence[Event] | None = None, *, depth: int = 0) -> list[str]:
    """Apply the ``parent_close`` policy of run ``run_id``'s children when it has ended: each child still running
    that was started with ``parent_close="cancel"`` is cancelled (and so, in turn, its own children); those started
    with ``"abandon"`` run on. ``events``: the parent's log, if the caller has read it. Returns the ids cancelled.

    Each cancellation is an append of the child's own (a parent's end and its children's are not one transaction:
    a fan-out of 1,000 children would not fit one); the child's end then finds its parent ended and wakes nobody."""
    log = list(events) if events is not None else world.list_events(run_id)
    cancelled: list[str] = []
    for child in children_of(log):
        if child.status is not None or child.parent_close != "cancel":
            continue
        reason = RunCancelledData(reason=f"its parent run {run_id} ended")
        try:
            world.append(child.run_id, [NewEvent.of(reason)])
        except (RunTerminal, NotFound):
            continue  # it ended meanwhile, or is gone
        cancelled.append(child.run_id)
        if depth < MAX_DEPTH:
            cancelled.extend(close_children(world, child.run_id, depth=depth + 1))
    return cancelled


#: How deep a parent's end cancels (children of children …): a bound, not a limit anyone should meet.
MAX_DEPTH = 32
