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

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from celery_workflow.app import Workflows
from celery_workflow.errors import ReplayDivergence
from celery_workflow.event_data import RunCompletedData, RunFailedData, StepCreatedData
from celery_workflow.events import Event, EventType, NewEvent, RunStatus
from celery_workflow.history import FORMAT, History
from celery_workflow.runtime.control import brief
from celery_workflow.runtime.registry import StepDef, WorkflowDef
from celery_workflow.runtime.replay import Replay
from celery_workflow.runtime.steps import StepOutcome
from celery_workflow.world import DEFAULT_QUEUE, Delivery

__all__ = ["FORMAT", "History", "ReplayResult", "replay_history"]


#: The delivery id the replay runs under: no recorded ``step_started`` has it, so no step is ever resumed.
_DELIVERY_ID = "replay-history"


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

    def may_batch_start(self, sdef: StepDef, unwritten: Sequence[NewEvent], oldest: datetime | None) -> bool:
        return False

    def start_child(self, wdef: WorkflowDef, run_id: str, data_input: Any, correlation_id: str) -> None:
        raise _WriteRefused([])  # a child the history has not recorded: the code would start it

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
    # a patch_applied marker the code records past where the history ends is what a worker's next delivery would
    # record for a run at rest there (patched() is True for it from then on): not a difference from the history
    unwritten = [*replay.deferred, *(ev for ev in replay.pending if ev.event_type is not EventType.PATCH_APPLIED)]
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
