"""A run's recorded history: its event log as a World stored it, in a JSON file format meant to be checked into a
repository (``{"format": 1, "run": {...}, "events": [...]}``, see :meth:`History.to_json`).

:func:`celery_workflow.testing.replay_history` replays one against today's workflow code; the run inspector serves
a run's history for download in this format. Record one from a run in any World with
``History.from_world(world, run_id).dump(path)``.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from celery_workflow.errors import EventUnreadable
from celery_workflow.event_data import RunCompletedData, RunCreatedData, RunFailedData
from celery_workflow.events import RUN_END_STATUS, Event, EventType, RunStatus, RunView
from celery_workflow.ids import isoformat, parse_iso
from celery_workflow.world import World

__all__ = ["FORMAT", "History"]

#: The version of the JSON file format :meth:`History.to_json` writes and :meth:`History.from_json` reads.
FORMAT = 1

_EVENT_TYPES = frozenset(t.value for t in EventType)


@dataclass(frozen=True, slots=True)
class History:
    """The recorded event log of one run. Construction checks that the log is whole: slots 1..n, ``run_created``
    first, agreeing with the run fields."""

    run_id: str
    workflow_name: str
    input: Any  # JSON: {"args": [...], "kwargs": {...}}
    queue: str | None
    created_at: datetime
    events: list[Event]

    def __post_init__(self) -> None:
        if not self.events:
            raise ValueError(f"history of run {self.run_id}: no events")
        for i, ev in enumerate(self.events, start=1):
            if ev.slot != i:
                raise ValueError(f"history of run {self.run_id}: event {i} has slot {ev.slot}; slots must be 1, 2, 3 …")
            if ev.run_id != self.run_id:
                raise ValueError(f"history of run {self.run_id}: slot {i} belongs to run {ev.run_id}")
        first = self.events[0]
        if first.event_type is not EventType.RUN_CREATED:
            raise ValueError(f"history of run {self.run_id}: slot 1 is {first.event_type}, not run_created")
        created = first.data_as(RunCreatedData)
        recorded = (created.workflow_name, created.input, created.queue)
        if recorded != (self.workflow_name, self.input, self.queue):
            raise ValueError(
                f"history of run {self.run_id}: the run fields (workflow, input, queue) disagree with run_created"
            )

    @classmethod
    def from_world(cls, world: World, run_id: str) -> History:
        """The history of a run as ``world`` holds it now (RunNotFound if unknown)."""
        run, events = world.get_run_with_events(run_id)
        return cls(run.run_id, run.workflow_name, run.input, run.queue, run.created_at, list(events))

    # -- what the log says -----------------------------------------------------------------------------------------

    @property
    def terminal_event(self) -> Event | None:
        """The run's ``run_completed``, ``run_failed`` or ``run_cancelled`` event, if it ended."""
        return next((ev for ev in self.events if ev.event_type in RUN_END_STATUS), None)

    @property
    def status(self) -> RunStatus:
        """The run's status as the log records it."""
        end = self.terminal_event
        if end is not None:
            return RUN_END_STATUS[end.event_type]
        if any(ev.event_type is EventType.RUN_STARTED for ev in self.events):
            return RunStatus.RUNNING
        return RunStatus.PENDING

    def run_view(self) -> RunView:
        """The run's view as a World would show it after the last event of this history."""
        started = next((ev.created_at for ev in self.events if ev.event_type is EventType.RUN_STARTED), None)
        end = self.terminal_event
        last = self.events[-1]
        return RunView(
            run_id=self.run_id,
            workflow_name=self.workflow_name,
            status=self.status,
            input=self.input,
            queue=self.queue,
            created_at=self.created_at,
            updated_at=last.created_at,
            event_count=last.slot,
            output=end.body.output if end is not None and isinstance(end.body, RunCompletedData) else None,
            error=end.body.error if end is not None and isinstance(end.body, RunFailedData) else None,
            started_at=started,
            completed_at=end.created_at if end is not None else None,
        )

    # -- the file format -------------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """``{"format": 1, "run": {run_id, workflow_name, input, queue, created_at}, "events": [{slot, event_type,
        correlation_id, data, created_at}, ...]}``; times are ISO 8601 in UTC. Shares no object with the history."""
        return {
            "format": FORMAT,
            "run": {
                "run_id": self.run_id,
                "workflow_name": self.workflow_name,
                "input": copy.deepcopy(self.input),
                "queue": self.queue,
                "created_at": isoformat(self.created_at),
            },
            "events": [
                {
                    "slot": ev.slot,
                    "event_type": ev.event_type.value,
                    "correlation_id": ev.correlation_id,
                    "data": copy.deepcopy(dict(ev.data)),
                    "created_at": isoformat(ev.created_at),
                }
                for ev in self.events
            ],
        }

    @classmethod
    def from_json(cls, doc: Any) -> History:
        """Read what :meth:`to_json` wrote; ValueError for another format version or a malformed document."""
        obj = _mapping(doc, "the history")
        version = obj.get("format")
        if version != FORMAT:
            raise ValueError(f"unsupported history format {version!r}: this celery_workflow reads format {FORMAT}")
        run = _mapping(obj.get("run"), "history.run")
        run_id = _string(run, "run_id", "history.run")
        raw_events = obj.get("events")
        if not isinstance(raw_events, list):
            raise ValueError("history.events must be a list")
        events = []
        for i, raw in enumerate(raw_events):
            where = f"history.events[{i}]"
            item = _mapping(raw, where)
            slot = item.get("slot")
            if not isinstance(slot, int) or isinstance(slot, bool):
                raise ValueError(f"{where}.slot must be an integer")
            name = item.get("event_type")
            if name not in _EVENT_TYPES:
                raise ValueError(f"{where}.event_type: unknown event type {name!r}")
            kind = EventType(name)
            cid = item.get("correlation_id")
            if cid is not None and not isinstance(cid, str):
                raise ValueError(f"{where}.correlation_id must be a string or null")
            data = _mapping(item.get("data"), f"{where}.data")
            try:
                events.append(Event(run_id, slot, kind, cid, copy.deepcopy(dict(data)), _time(item, where)))
            except EventUnreadable as exc:
                raise ValueError(f"{where}: {exc}") from None
        if "input" not in run:
            raise ValueError("history.run needs 'input'")
        queue = run.get("queue")
        if queue is not None and not isinstance(queue, str):
            raise ValueError("history.run.queue must be a string or null")
        return cls(
            run_id=run_id,
            workflow_name=_string(run, "workflow_name", "history.run"),
            input=copy.deepcopy(run["input"]),
            queue=queue,
            created_at=_time(run, "history.run"),
            events=events,
        )

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> History:
        """Read a history file written by :meth:`dump`; ValueError (naming the file) if it is not one."""
        try:
            return cls.from_json(json.loads(Path(path).read_text(encoding="utf-8")))
        except ValueError as exc:  # json.JSONDecodeError included
            raise ValueError(f"{path}: {exc}") from exc

    def dump(self, path: str | os.PathLike[str]) -> None:
        """Write the history as JSON, indented and with sorted keys, so that diffs of checked-in files read well."""
        text = json.dumps(self.to_json(), indent=2, sort_keys=True, ensure_ascii=False)
        Path(path).write_text(text + "\n", encoding="utf-8")


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be a JSON object")
    return value


def _string(obj: Mapping[str, Any], key: str, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}.{key} must be a non-empty string")
    return value


def _time(obj: Mapping[str, Any], where: str) -> datetime:
    value = obj.get("created_at")
    if not isinstance(value, str):
        raise ValueError(f"{where}.created_at must be an ISO 8601 string")
    try:
        return parse_iso(value)
    except ValueError as exc:
        raise ValueError(f"{where}.created_at: {exc}") from None
