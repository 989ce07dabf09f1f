"""Typed event data (issue #28, item 4): one data class per event type, checked at both edges of the log, and a
rule dispatcher that refuses an event type it has no rule for."""

from __future__ import annotations

import dataclasses
import json
import re
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from pathlib import Path
from typing import Any

import pytest

from celery_workflow import event_data as ed
from celery_workflow.errors import (
    EventInvalid,
    EventRejected,
    EventUnreadable,
    SchemaVersionError,
    UnknownEventType,
)
from celery_workflow.events import (
    CHILD_EVENTS,
    HOOK_EVENTS,
    PATCH_EVENTS,
    RUN_EVENTS,
    STEP_EVENTS,
    WAIT_EVENTS,
    Event,
    EventType,
    NewEvent,
    RunStatus,
    RunView,
)
from celery_workflow.rules import Snapshot, plan_append, validate
from celery_workflow.testing.memory import MemoryWorld
from celery_workflow.world import NewRun

T0 = datetime(2026, 12, 5, 8, 0, tzinfo=UTC)
HISTORIES = Path(__file__).resolve().parents[1] / "histories"
ERROR = {"type": "builtins.ValueError", "message": "boom", "traceback": "..."}

#: For each event type, the data a writer of this version writes: every optional field set, and the bare minimum.
SAMPLES: dict[EventType, list[dict[str, Any]]] = {
    EventType.RUN_CREATED: [
        {"workflow_name": "wf", "input": {"args": [1], "kwargs": {}}},
        {"workflow_name": "wf", "input": {"args": [], "kwargs": {}}, "queue": "q", "continues": "wrun_a"},
    ],
    EventType.RUN_STARTED: [{}],
    EventType.RUN_COMPLETED: [
        {"output": [1, 2]},
        {"output": None, "continued_as": "wrun_a~1", "continued_with": {"args": [2], "kwargs": {}}},
    ],
    EventType.RUN_FAILED: [{"error": ERROR}, {"error": ERROR, "code": "REPLAY_DIVERGENCE"}],
    EventType.RUN_CANCELLED: [{}, {"reason": "because"}],
    EventType.STEP_CREATED: [
        {"step_name": "s", "input": {"args": [], "kwargs": {}}},
        {"step_name": "s", "input": {"args": [], "kwargs": {}}, "mode": "queued", "queue": "slow"},
        {"step_name": "s", "input": {"args": [], "kwargs": {}}, "mode": "inline"},
    ],
    EventType.STEP_STARTED: [{}, {"owner": "dlv_1"}, {"owner": "dlv_1", "attempt": 2}],
    EventType.STEP_COMPLETED: [{"result": None}, {"result": {"a": [1, "b"]}}],
    EventType.STEP_FAILED: [{"error": ERROR}],
    EventType.STEP_RETRYING: [{"error": ERROR}, {"error": ERROR, "retry_after": "2026-12-05T08:00:01+00:00"}],
    EventType.HOOK_CREATED: [
        {"token": "t", "metadata": None, "is_webhook": False},
        {
            "token": "t",
            "metadata": {"k": 1},
            "is_webhook": True,
            "respond_with": {"status": 202},
            "many": False,
            "keep_credentials": True,
            "force": True,
            "token_retention_until": "2026-12-06T08:00:00+00:00",
        },
    ],
    EventType.HOOK_RECEIVED: [{"payload": None}, {"payload": {"ok": True}}],
    EventType.HOOK_DISPOSED: [{}, {"taken_by": "wrun_b"}, {"taken_by": "wrun_b", "token": "t"}],  # the last: before #26
    EventType.HOOK_CONFLICT: [{"token": "t", "conflicting_run_id": "wrun_b"}],
    EventType.WAIT_CREATED: [{"resume_at": "2026-12-05T08:00:05+00:00"}],
    EventType.WAIT_COMPLETED: [{}],
    EventType.PATCH_APPLIED: [{"change_id": "charge-first"}],
    EventType.CHILD_STARTED: [
        {"run_id": "wrun_a!1", "workflow_name": "child"},
        {"run_id": "c", "workflow_name": "w", "parent_close": "abandon"},
    ],
    EventType.CHILD_ENDED: [
        {"run_id": "wrun_a!1", "status": "completed", "output": {"n": 1}},
        {"run_id": "wrun_a!1", "status": "failed", "error": {"type": "E", "message": "m"}},
        {"run_id": "wrun_a!1", "status": "cancelled"},
    ],
}


class _Future(StrEnum):
    """Event types of a later version, which this one has no rule for."""

    STEP_CANCELLED = "step_cancelled"


def _snapshot() -> Snapshot:
    run = RunView("r", "wf", RunStatus.RUNNING, {}, None, T0, T0, 2, started_at=T0)
    return Snapshot(run)


# -- the dispatcher ------------------------------------------------------------------------------------------------


def test_every_event_type_has_one_family_and_a_data_class() -> None:
    families = [RUN_EVENTS, STEP_EVENTS, HOOK_EVENTS, WAIT_EVENTS, PATCH_EVENTS, CHILD_EVENTS]
    for kind in EventType:
        assert sum(kind in f for f in families) == 1, kind
        assert ed.DATA_TYPES[kind].TYPE is kind


def test_the_rules_refuse_an_event_type_they_have_no_rule_for() -> None:
    """It used to be planned as a wait event (and refused, if at all, as a missing wait)."""
    unknown = NewEvent(_Future.STEP_CANCELLED, "s")  # type: ignore[arg-type]
    with pytest.raises(EventInvalid, match="no transition rule for event type 'step_cancelled'"):
        plan_append(_snapshot(), [unknown], now=T0, validated=True)
    with pytest.raises(EventInvalid):
        plan_append(_snapshot(), [unknown], now=T0)


# -- round trips ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(EventType))
def test_every_event_type_round_trips_through_its_data_class(kind: EventType) -> None:
    cls = ed.DATA_TYPES[kind]
    for data in SAMPLES[kind]:
        body = cls.from_data(data)
        assert body.to_data() == data  # the stored shape is kept exactly
        assert cls.from_data(body.to_data()) == body
        new = NewEvent(kind, "c" if kind not in RUN_EVENTS else None, data)
        assert new.body == body and NewEvent.of(body, new.correlation_id) == new
        stored = Event("r", 3, kind, new.correlation_id, data, T0)
        assert stored.body == body and stored.data_as(cls) is stored.body


def test_times_are_datetimes_in_the_data_class_and_iso_strings_in_the_data() -> None:
    body = ed.WaitCreatedData.from_data({"resume_at": "2026-12-05T09:00:00+01:00"})
    assert body.resume_at == T0 and body.resume_at.tzinfo is not None
    assert ed.WaitCreatedData(resume_at=T0 + timedelta(seconds=1)).to_data() == {
        "resume_at": "2026-12-05T08:00:01+00:00"
    }


def test_every_recorded_history_event_reads_into_its_data_class_and_back() -> None:
    files = sorted(HISTORIES.glob("*.json"))
    assert files
    for path in files:
        for raw in json.loads(path.read_text())["events"]:
            kind = EventType(raw["event_type"])
            body = ed.DATA_TYPES[kind].from_data(raw["data"], writing=True)
            assert body.to_data() == raw["data"], (path.name, raw["slot"])


def test_data_as_of_another_type_is_a_callers_mistake() -> None:
    started = NewEvent.of(ed.StepStartedData(owner="d"), "s")
    assert started.data_as(ed.StepStartedData).owner == "d"
    with pytest.raises(TypeError, match="step_started event has no StepCompletedData"):
        started.data_as(ed.StepCompletedData)


# -- the append edge -----------------------------------------------------------------------------------------------

MALFORMED = [
    pytest.param(EventType.STEP_CREATED, {"input": {}}, "needs data field 'step_name'", id="missing-required"),
    pytest.param(EventType.STEP_CREATED, {"step_name": 5, "input": {}}, "'step_name' must be a string", id="type"),
    pytest.param(EventType.STEP_CREATED, {"step_name": "s", "input": {}, "mode": "later"}, "'mode'", id="literal"),
    pytest.param(EventType.STEP_STARTED, {"owner": "d", "ower": "d"}, "unknown data field 'ower'", id="unknown"),
    pytest.param(EventType.STEP_STARTED, {"attempt": True}, "'attempt' must be an integer", id="bool-not-int"),
    pytest.param(EventType.STEP_FAILED, {"error": "boom"}, "'error' must be a JSON object", id="error-object"),
    pytest.param(EventType.STEP_RETRYING, {"error": {}, "retry_after": "soon"}, "ISO 8601", id="time"),
    pytest.param(EventType.HOOK_CREATED, {"token": "t", "force": "yes"}, "'force' must be a boolean", id="flag"),
    pytest.param(EventType.HOOK_DISPOSED, {"taken_by": 7}, "'taken_by' must be a string", id="optional-type"),
    pytest.param(EventType.RUN_CANCELLED, {"reason": ["x"]}, "'reason' must be a string", id="reason"),
    pytest.param(EventType.RUN_COMPLETED, {"output": 1, "continued_as": 2}, "'continued_as'", id="continued"),
]


@pytest.mark.parametrize(("kind", "data", "message"), MALFORMED)
def test_malformed_data_is_refused_when_validated_for_an_append(kind: EventType, data: Any, message: str) -> None:
    cid = None if kind in RUN_EVENTS else "c"
    with pytest.raises(EventInvalid, match=message):
        validate(NewEvent(kind, cid, data))


@pytest.mark.parametrize(("kind", "data", "message"), MALFORMED)
def test_malformed_data_is_refused_by_a_world_and_nothing_is_written(kind: EventType, data: Any, message: str) -> None:
    world = MemoryWorld()
    run, _ = world.create_run(NewRun("wrun_t", "wf", {"args": [], "kwargs": {}}))
    world.append(
        run.run_id,
        [NewEvent(EventType.RUN_STARTED), NewEvent(EventType.STEP_CREATED, "c", SAMPLES[EventType.STEP_CREATED][0])],
    )
    before = world.list_events(run.run_id)
    cid = None if kind in RUN_EVENTS else "c"
    with pytest.raises(EventInvalid, match=message):
        world.append(run.run_id, [NewEvent(kind, cid, data)])
    assert world.list_events(run.run_id) == before


def test_a_typed_writer_cannot_build_a_hook_without_a_token() -> None:
    with pytest.raises(ValueError, match="non-empty string token"):
        ed.HookCreatedData(token="")


# -- the read edge -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "data", "message"), [p for p in MALFORMED if p.id != "unknown"])
def test_a_stored_event_that_does_not_fit_its_data_class_is_unreadable(
    kind: EventType, data: Any, message: str
) -> None:
    with pytest.raises(EventUnreadable, match=f"event 4 of run r \\({kind}\\) does not fit") as raised:
        Event("r", 4, kind, "c", data, T0)
    assert re.search(message, str(raised.value))  # and names what does not fit
    assert isinstance(raised.value, SchemaVersionError) and not isinstance(raised.value, EventRejected)


def test_a_stored_event_may_carry_fields_a_newer_version_added() -> None:
    """Forward compatible: unknown fields are kept in ``data`` and ignored by the typed view."""
    data = {"owner": "d", "attempt": 1, "host": "worker-7"}
    ev = Event("r", 4, EventType.STEP_STARTED, "s", data, T0)
    assert ev.body == ed.StepStartedData(owner="d", attempt=1) and ev.data == data


def test_a_stored_event_of_an_unknown_type_is_a_typed_error() -> None:
    with pytest.raises(UnknownEventType, match=r"'step_cancelled'.*newer celery_workflow") as raised:
        EventType("step_cancelled")
    assert isinstance(raised.value, EventUnreadable) and isinstance(raised.value, ValueError)
    with pytest.raises(UnknownEventType):
        Event("r", 4, "step_cancelled", "s", {}, T0)  # type: ignore[arg-type]


def test_dataclasses_replace_checks_again() -> None:
    ev = Event("r", 4, EventType.STEP_COMPLETED, "s", {"result": 1}, T0)
    assert dataclasses.replace(ev, data={"result": 2}).data_as(ed.StepCompletedData).result == 2
    with pytest.raises(EventUnreadable):
        dataclasses.replace(ev, data={})
