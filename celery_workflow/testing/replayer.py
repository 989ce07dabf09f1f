"""Replaying recorded runs: does today's workflow code still reproduce the runs recorded by yesterday's?

A :class:`History` is one run's event log as a World stored it, in a JSON file format meant to be checked into a
repository (``{"format": 1, "run": {...}, "events": [...]}``, see :meth:`History.to_json`). :func:`replay_history`
runs the workflow function of a history from the top against that log with the runtime's own
:class:`~celery_workflow.runtime.replay.Replay`, as a worker does after an upgrade, and guarantees:

* nothing is written and no step body runs: step results come from the log, and the replay's effects refuse every
  append (the World of the ``Workflows`` passed in is never read or written);
* time stands still at the history's last event: ``now()`` is replayed from the log, and a run recorded asleep stays
  asleep;
* the code reproduces the recorded result, or :class:`~celery_workflow.errors.ReplayDivergence` is raised saying
  what differs (slot, correlation id, what the history has and what the code does now). A run that completed must
  complete with an equal output (compared as canonical JSON); a run that failed must fail with the same error type
  and message; a cancelled run or a run at rest (sleeping, waiting on a hook or on queued steps) must suspend. In
  every case the code must meet every creation of the log (step, hook, wait) in order, with the same step arguments,
  and want to write nothing the log lacks.

In a test, for every checked-in history::

    @pytest.mark.parametrize("path", sorted(HERE.glob("*.json")), ids=lambda p: p.stem)
    def test_history_replays(path: Path) -> None:
        replay_history(wf, History.load(path))

Record one from a run in any World with ``History.from_world(wf.world, run_id).dump(path)``.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from celery_workflow.app import Workflows
from celery_workflow.errors import EventUnreadable, ReplayDivergence
from celery_workflow.event_data import RunCompletedData, RunCreatedData, RunFailedData, StepCreatedData
from celery_workflow.events import RUN_END_STATUS, Event, EventType, NewEvent, RunStatus, RunView
from celery_workflow.ids import isoformat, parse_iso
from celery_workflow.runtime.registry import StepDef
from celery_workflow.runtime.replay import Replay, brief
from celery_workflow.runtime.steps import StepOutcome
from celery_workflow.world import DEFAULT_QUEUE, Delivery, World

__all__ = ["FORMAT", "History", "ReplayResult", "replay_history"]

#: The version of the JSON file format :meth:`History.to_json` writes and :meth:`History.from_json` reads.
FORMAT = 1

_EVENT_TYPES = frozenset(t.value for t in EventType)
#: The delivery id the replay runs under: no recorded ``step_started`` has it, so no step is ever resumed.
_DELIVERY_ID = "replay-history"


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


# -- replaying ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """What the code produced against the history (equal to what the history records, or replay_history raised).

    ``output``: the JSON output of a completed run, or the JSON input a run that continued as new hands to its
    successor; ``error``: ``{"type", "message", "traceback"}`` of a failed one.
    """

    status: Literal["completed", "failed", "suspended", "continued"]
    output: Any = None
    error: Mapping[str, Any] | None = None


class _WriteRefused(BaseException):
    """The code wants to append events: unwinds the replay (a BaseException, past user ``except Exception``)."""

    def __init__(self, events: Sequence[NewEvent]) -> None:
        super().__init__()
        self.events = list(events)


class _HistoryEffects:
    """The replay's I/O against a history: reads come from the log; every write is refused."""

    def __init__(self, history: History) -> None:
        self.history = history
        self.delivery_id = _DELIVERY_ID
        self.defer_writes = False
        self.now = history.events[-1].created_at

    def append(
        self, events: Sequence[NewEvent], deliveries: Sequence[Delivery], *, conditional: bool, final: bool = False
    ) -> list[Event]:
        raise _WriteRefused(events)

    def wall_now(self) -> datetime:
        return self.now

    def inline_allowed(self) -> bool:
        return True

    def take_token(self, token: str) -> None:
        raise _WriteRefused([])  # a forced claim the history has not recorded: the code would write

    def step_delivery(self, sdef: StepDef, step_id: str, not_before: datetime | None) -> Delivery:
        queue = sdef.queue or self.history.queue or DEFAULT_QUEUE  # never stored: only counted as a write
        return Delivery(queue, b"", self.history.run_id, not_before, f"step:{step_id}")

    def may_hold_start(self, sdef: StepDef) -> bool:
        return False

    def execute_step(self, sdef: StepDef, step_id: str, input: Any, attempt: int, started_at: datetime) -> StepOutcome:
        # unreachable (a step runs only after its step_started was written), but never run a step body
        raise _WriteRefused([NewEvent(EventType.STEP_STARTED, step_id)])


def replay_history(workflows: Workflows, history: History) -> ReplayResult:
    """Replay ``history`` with the workflow code registered on ``workflows``; ReplayDivergence if it differs.

    ``workflows`` is the application's :class:`~celery_workflow.Workflows` (its registry and ``base_url``, which
    webhook URLs are built from); its World is not used. WorkflowNotFound if no workflow has the history's name;
    ValueError for a run that never started (its log records nothing of the code).
    """
    wdef = workflows.registry.workflow(history.workflow_name)
    if history.status is RunStatus.PENDING:
        raise ValueError(f"run {history.run_id} never started: its history records nothing of the workflow code")
    replay = Replay(
        run=history.run_view(),
        wdef=wdef,
        registry=workflows.registry,
        effects=_HistoryEffects(history),
        events=list(history.events),
        base_url=workflows.base_url,
    )
    where = f"history of run {history.run_id} ({history.workflow_name})"
    last = history.events[-1]
    try:
        outcome = replay.execute()
    except _WriteRefused as refused:
        raise ReplayDivergence(
            f"{where}: the workflow code now writes {_describe(refused.events)}, which the history does not have"
            f" (it ends at slot {last.slot} with {_event(last)})"
        ) from None
    if outcome.kind == "diverged":
        message = str((outcome.error or {}).get("message", "replay divergence"))
        raise ReplayDivergence(f"{where}: {message}")
    unwritten = [*replay.deferred, *replay.pending]
    if unwritten or replay.pending_deliveries:
        raise ReplayDivergence(
            f"{where}: the workflow code now {_got(outcome.kind, outcome.output, outcome.error)} and writes"
            f" {_describe(unwritten) or 'new deliveries'}, which the history does not have"
            f" (it ends at slot {last.slot} with {_event(last)})"
        )
    result = ReplayResult(outcome.kind, outcome.output, outcome.error)
    _compare(where, history, result)
    return result


def _compare(where: str, history: History, result: ReplayResult) -> None:
    end = history.terminal_event
    last = history.events[-1]
    if end is None:
        recorded = f"a run at rest after slot {last.slot} ({_event(last)})"
        same = result.status == "suspended"
    elif end.event_type is EventType.RUN_CANCELLED:
        recorded = f"run_cancelled at slot {end.slot}"
        same = result.status == "suspended"
    elif isinstance(end.body, RunCompletedData) and end.body.continued_as is not None:
        handed = end.body.continued_with
        recorded = f"run_completed at slot {end.slot} handing over to {end.body.continued_as} with {_json(handed)}"
        same = result.status == "continued" and _canonical(result.output) == _canonical(handed)
    elif isinstance(end.body, RunCompletedData):
        output = end.body.output
        recorded = f"run_completed at slot {end.slot} with output {_json(output)}"
        same = result.status == "completed" and _canonical(result.output) == _canonical(output)
    else:
        err = end.data_as(RunFailedData).error
        recorded = f"run_failed at slot {end.slot} with {err.get('type')}: {err.get('message')}"
        mine = result.error or {}
        same = result.status == "failed" and (mine.get("type"), mine.get("message")) == (
            err.get("type"),
            err.get("message"),
        )
    if not same:
        got = _got(result.status, result.output, result.error)
        raise ReplayDivergence(f"{where}: the history records {recorded}, but the workflow code now {got}")


def _canonical(value: Any) -> str:
    """JSON with sorted keys: ``true`` and ``1``, ``1`` and ``1.0`` differ, key order does not."""
    return json.dumps(value, sort_keys=True)


def _got(kind: str, output: Any, error: Mapping[str, Any] | None) -> str:
    if kind == "completed":
        return f"completes with output {_json(output)}"
    if kind == "failed":
        err = error or {}
        return f"fails with {err.get('type')}: {err.get('message')}"
    if kind == "continued":
        return f"continues as new with {_json(output)}"
    return "suspends"


def _json(value: Any, limit: int = 300) -> str:
    return brief(value, limit)


def _event(ev: Event | NewEvent) -> str:
    return f"{ev.event_type.value} {ev.correlation_id!r}" if ev.correlation_id else ev.event_type.value


def _describe(events: Sequence[NewEvent]) -> str:
    parts = []
    for ev in events:
        text = _event(ev)
        if isinstance(ev.body, StepCreatedData):
            text += f" with input {_json(ev.body.input, 120)}"
        parts.append(text)
    return ", ".join(parts)
