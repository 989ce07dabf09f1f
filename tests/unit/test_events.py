"""The transition rules of ``rules.plan_append``, tested directly (no World), with hypothesis for batches."""

from __future__ import annotations

import dataclasses
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_workflow import codec, events, rules
from celery_workflow.errors import (
    EntityExists,
    EntityTerminal,
    EventInvalid,
    EventRejected,
    HookNotFound,
    RunNotFound,
    RunTerminal,
    StaleLog,
    StepNotFound,
    TooEarly,
    WaitNotFound,
)
from celery_workflow.events import (
    EventType,
    HookView,
    NewEvent,
    RunStatus,
    StepStatus,
    WaitStatus,
)
from celery_workflow.ids import isoformat
from celery_workflow.rules import Plan, Snapshot, keys_of, new_run, plan_append, validate

T0 = datetime(2030, 1, 1, tzinfo=UTC)
ERR = {"type": "E", "message": "m"}


def ev(kind: EventType, cid: str | None = None, **data: Any) -> NewEvent:
    return NewEvent(kind, cid, data)


class Model:
    """A minimal World: applies plans to in-memory state exactly as a World must (views, hooks, tokens, run end)."""

    def __init__(self, *, status: RunStatus = RunStatus.RUNNING) -> None:
        run, first = new_run("r1", {"workflow_name": "wf", "input": {}}, T0)
        self.run = dataclasses.replace(run, status=status, started_at=T0 if status is not RunStatus.PENDING else None)
        self.log = [first]
        self.steps: dict[str, events.StepView] = {}
        self.hooks: dict[str, HookView] = {}
        self.waits: dict[str, events.WaitView] = {}
        # a live hook of another run owning "t_foreign"
        self.tokens: dict[str, HookView] = {"t_foreign": HookView("r0", "h0", "t_foreign", T0)}
        self.now = T0

    def snapshot(self, batch: list[NewEvent]) -> Snapshot:
        keys = keys_of(batch)
        return Snapshot(
            run=self.run,
            steps={k: v for k, v in self.steps.items() if k in keys.steps},
            hooks={k: v for k, v in self.hooks.items() if k in keys.hooks},
            waits={k: v for k, v in self.waits.items() if k in keys.waits},
            token_owners={k: v for k, v in self.tokens.items() if k in keys.tokens},
            created_hooks={
                str(e.correlation_id)
                for e in self.log
                if e.event_type in (EventType.HOOK_CREATED, EventType.HOOK_CONFLICT) and e.correlation_id in keys.hooks
            },
        )

    def append(self, batch: list[NewEvent], expected_count: int | None = None) -> Plan:
        self.now += timedelta(seconds=1)
        plan = plan_append(self.snapshot(batch), batch, now=self.now, expected_count=expected_count)
        self.log += plan.events
        self.run = plan.run
        self.steps.update(plan.steps)
        self.waits.update(plan.waits)
        for hook_id, hook in plan.hooks_deleted.items():
            self.hooks.pop(hook_id, None)
            if self.tokens.get(hook.token) == hook:
                del self.tokens[hook.token]
        for hook_id, hook in plan.hooks_inserted.items():
            assert hook.token not in self.tokens, "a plan must never give a live token a second owner"
            self.hooks[hook_id] = hook
            self.tokens[hook.token] = hook
        if plan.run_ended:
            for hook in self.hooks.values():
                del self.tokens[hook.token]
            self.hooks.clear()
            self.waits.clear()
        return plan

    def state(self) -> tuple[Any, ...]:
        log = [(e.slot, e.event_type, e.correlation_id, dict(e.data)) for e in self.log]
        return (
            log,
            self.run.status,
            self.run.event_count,
            sorted((k, v.status, v.attempt) for k, v in self.steps.items()),
            sorted(self.hooks),
            sorted(self.tokens),
            sorted((k, v.status) for k, v in self.waits.items()),
        )


# -- validation and creation ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        ev(EventType.STEP_CREATED, None, step_name="s", input={}),  # needs a correlation id
        ev(EventType.STEP_CREATED, "", step_name="s", input={}),
        ev(EventType.RUN_STARTED, "x"),  # takes none
        ev(EventType.STEP_CREATED, "x" * 513, step_name="s", input={}),
        ev(EventType.STEP_CREATED, "s", input={}),  # missing step_name
        ev(EventType.STEP_COMPLETED, "s"),
        ev(EventType.HOOK_CREATED, "h", token=""),
        ev(EventType.HOOK_CREATED, "h", token=5),
        ev(EventType.HOOK_RECEIVED, "h", payload={1, 2}),  # not JSON
        ev(EventType.STEP_COMPLETED, "s", result="x" * (codec.MAX_PAYLOAD_BYTES + 1)),
        ev(EventType.STEP_COMPLETED, "s", result=float("nan")),
        NewEvent("step_created", "s", {"step_name": "s", "input": {}}),  # type: ignore[arg-type]
    ],
)
def test_validate_rejects_malformed_events(bad: NewEvent) -> None:
    with pytest.raises(EventInvalid):
        validate(bad)


def test_validate_returns_the_stored_bytes() -> None:
    assert codec.loads(validate(ev(EventType.STEP_COMPLETED, "s", result=[1, "a"]))) == {"result": [1, "a"]}


def test_new_run_is_pending_at_slot_1() -> None:
    view, first = new_run("r", {"workflow_name": "wf", "input": {"args": [1]}, "queue": "q"}, T0)
    assert (view.status, view.event_count, view.queue, view.created_at) == (RunStatus.PENDING, 1, "q", T0)
    assert (first.slot, first.event_type, first.correlation_id) == (1, EventType.RUN_CREATED, None)
    with pytest.raises(EventInvalid):
        new_run("r", {"workflow_name": "wf"}, T0)


def test_keys_of_names_the_rows_the_rules_read() -> None:
    keys = keys_of(
        [
            ev(EventType.RUN_STARTED),
            ev(EventType.STEP_STARTED, "s1"),
            ev(EventType.STEP_COMPLETED, "s2", result=1),
            ev(EventType.HOOK_CREATED, "h1", token="t1"),
            ev(EventType.HOOK_RECEIVED, "h2", payload=1),
            ev(EventType.WAIT_COMPLETED, "w1"),
        ]
    )
    assert keys == rules.Keys(frozenset({"s1", "s2"}), frozenset({"h1", "h2"}), frozenset({"w1"}), frozenset({"t1"}))


def test_append_needs_the_run_and_the_expected_count() -> None:
    with pytest.raises(RunNotFound):
        plan_append(Snapshot(None), [ev(EventType.RUN_STARTED)], now=T0)
    model = Model()
    with pytest.raises(StaleLog):
        model.append([ev(EventType.RUN_CANCELLED)], expected_count=5)
    assert model.append([ev(EventType.RUN_CANCELLED)], expected_count=1).events[0].slot == 2


def test_world_only_events_are_invalid_in_append() -> None:
    model = Model()
    with pytest.raises(EventInvalid):
        model.append([ev(EventType.RUN_CREATED, workflow_name="wf", input={})])
    with pytest.raises(EventInvalid):
        model.append([ev(EventType.HOOK_CONFLICT, "h", token="t")])


# -- run rules -----------------------------------------------------------------------------------------------------


def test_run_started_once() -> None:
    model = Model(status=RunStatus.PENDING)
    plan = model.append([ev(EventType.RUN_STARTED), ev(EventType.RUN_STARTED)])
    assert [e.event_type for e in plan.events] == [EventType.RUN_STARTED]
    assert plan.run.started_at == model.now
    again = model.append([ev(EventType.RUN_STARTED)])
    assert again.events == [] and not again.run_changed and again.run.started_at == T0 + timedelta(seconds=1)


@pytest.mark.parametrize(
    ("end", "status"),
    [
        (ev(EventType.RUN_COMPLETED, output=3), RunStatus.COMPLETED),
        (ev(EventType.RUN_FAILED, error=ERR), RunStatus.FAILED),
        (ev(EventType.RUN_CANCELLED), RunStatus.CANCELLED),
    ],
)
def test_terminal_run_rules(end: NewEvent, status: RunStatus) -> None:
    model = Model()
    model.append([ev(EventType.STEP_CREATED, "s", step_name="s", input={}), ev(EventType.STEP_STARTED, "s")])
    model.append([ev(EventType.STEP_CREATED, "p", step_name="p", input={})])
    plan = model.append([end])
    assert plan.run.status is status and plan.run_ended and plan.run.completed_at == model.now
    assert plan.run.output == (3 if status is RunStatus.COMPLETED else None)
    assert plan.run.error == (ERR if status is RunStatus.FAILED else None)
    for kind in (EventType.RUN_STARTED, EventType.RUN_COMPLETED):
        with pytest.raises(RunTerminal):
            model.append([ev(kind)])
    if status is RunStatus.CANCELLED:
        assert model.append([ev(EventType.RUN_CANCELLED)]).events == []
    else:
        with pytest.raises(RunTerminal):
            model.append([ev(EventType.RUN_CANCELLED)])
    for new in (
        ev(EventType.STEP_CREATED, "n", step_name="n", input={}),
        ev(EventType.HOOK_CREATED, "h", token="t"),
        ev(EventType.WAIT_CREATED, "w", resume_at=isoformat(T0)),
        ev(EventType.STEP_STARTED, "p"),
        ev(EventType.STEP_RETRYING, "s", error=ERR),
    ):
        with pytest.raises(RunTerminal):
            model.append([new])
    assert model.append([ev(EventType.STEP_COMPLETED, "s", result=1)]).steps["s"].status is StepStatus.COMPLETED


def test_run_end_deletes_hooks_and_waits_even_those_of_the_same_batch() -> None:
    model = Model()
    model.append([ev(EventType.HOOK_CREATED, "old", token="t1")])
    plan = model.append(
        [
            ev(EventType.HOOK_CREATED, "new", token="t2"),
            ev(EventType.WAIT_CREATED, "w", resume_at=isoformat(T0)),
            ev(EventType.HOOK_RECEIVED, "old", payload=1),
            ev(EventType.RUN_COMPLETED, output=None),
        ]
    )
    assert plan.run_ended and plan.hooks_inserted == {} and plan.waits == {}
    assert set(plan.hooks_deleted) == {"old", "new"}
    assert model.hooks == {} and model.waits == {} and set(model.tokens) == {"t_foreign"}


# -- step rules ----------------------------------------------------------------------------------------------------


def test_step_lifecycle() -> None:
    model = Model()
    plan = model.append([ev(EventType.STEP_CREATED, "s", step_name="charge", input={"args": [1]}, queue="q")])
    step = plan.steps["s"]
    assert (step.status, step.attempt, step.queue, step.created_at) == (StepStatus.PENDING, 0, "q", model.now)
    first = model.append([ev(EventType.STEP_STARTED, "s", owner="w1")])
    assert first.events[0].data == {"owner": "w1", "attempt": 1}
    assert first.steps["s"].owner == "w1" and first.steps["s"].started_at == model.now
    retry_at = model.now + timedelta(seconds=10)
    model.append([ev(EventType.STEP_RETRYING, "s", error=ERR, retry_after=isoformat(retry_at))])
    assert model.steps["s"].status is StepStatus.PENDING and model.steps["s"].retry_after == retry_at
    assert model.steps["s"].owner is None
    with pytest.raises(TooEarly) as info:
        model.append([ev(EventType.STEP_STARTED, "s")])
    assert info.value.retry_after == retry_at and info.value.status == 425
    model.now = retry_at
    second = model.append([ev(EventType.STEP_STARTED, "s"), ev(EventType.STEP_STARTED, "s")])
    assert [e.data["attempt"] for e in second.events] == [2, 3]
    assert second.steps["s"].started_at == first.steps["s"].started_at and second.steps["s"].retry_after is None
    done = model.append([ev(EventType.STEP_FAILED, "s", error=ERR)])
    assert done.steps["s"].status is StepStatus.FAILED and done.steps["s"].completed_at == model.now
    for late in (ev(EventType.STEP_COMPLETED, "s", result=1), ev(EventType.STEP_STARTED, "s")):
        with pytest.raises(EntityTerminal):
            model.append([late])


def test_step_creation_is_unique_and_other_events_need_the_step() -> None:
    model = Model()
    with pytest.raises(EntityExists):
        model.append([ev(EventType.STEP_CREATED, "s", step_name="s", input={})] * 2)
    assert model.steps == {}
    with pytest.raises(StepNotFound):
        model.append([ev(EventType.STEP_COMPLETED, "s", result=1)])


# -- hooks ---------------------------------------------------------------------------------------------------------


def test_token_owned_by_another_run_becomes_hook_conflict() -> None:
    model = Model()
    plan = model.append([ev(EventType.HOOK_CREATED, "h", token="t_foreign", metadata={"m": 1})])
    (conflict,) = plan.events
    assert conflict.event_type is EventType.HOOK_CONFLICT and conflict.correlation_id == "h"
    assert conflict.data == {"token": "t_foreign", "conflicting_run_id": "r0"}
    assert plan.hooks_inserted == {} and model.hooks == {}
    with pytest.raises(HookNotFound):
        model.append([ev(EventType.HOOK_RECEIVED, "h", payload=1)])


def test_tokens_within_one_batch() -> None:
    model = Model()
    plan = model.append([ev(EventType.HOOK_CREATED, "a", token="t"), ev(EventType.HOOK_CREATED, "b", token="t")])
    assert [e.event_type for e in plan.events] == [EventType.HOOK_CREATED, EventType.HOOK_CONFLICT]
    assert plan.events[1].data["conflicting_run_id"] == "r1"
    moved = model.append([ev(EventType.HOOK_DISPOSED, "a"), ev(EventType.HOOK_CREATED, "c", token="t")])
    assert set(moved.hooks_deleted) == {"a"} and set(moved.hooks_inserted) == {"c"}
    transient = model.append([ev(EventType.HOOK_CREATED, "d", token="u"), ev(EventType.HOOK_DISPOSED, "d")])
    assert transient.hooks_inserted == {} and transient.hooks_deleted == {}
    assert model.tokens["t"].hook_id == "c" and "u" not in model.tokens


def test_hook_events_need_a_live_hook() -> None:
    model = Model()
    for kind, data in ((EventType.HOOK_RECEIVED, {"payload": 1}), (EventType.HOOK_DISPOSED, {})):
        with pytest.raises(HookNotFound):
            model.append([ev(kind, "h", **data)])
    model.append([ev(EventType.HOOK_CREATED, "h", token="t")])
    with pytest.raises(EntityExists):
        model.append([ev(EventType.HOOK_CREATED, "h", token="t2")])


# -- waits ---------------------------------------------------------------------------------------------------------


def test_wait_rules() -> None:
    model = Model()
    with pytest.raises(EventInvalid):
        model.append([ev(EventType.WAIT_CREATED, "w", resume_at="soon")])
    plan = model.append([ev(EventType.WAIT_CREATED, "w", resume_at="2030-01-01T00:05:00+00:00")])
    assert plan.waits["w"].resume_at == T0 + timedelta(minutes=5) and plan.waits["w"].status is WaitStatus.WAITING
    with pytest.raises(EntityExists):
        model.append([ev(EventType.WAIT_CREATED, "w", resume_at=isoformat(T0))])
    assert model.append([ev(EventType.WAIT_COMPLETED, "w")]).waits["w"].status is WaitStatus.COMPLETED
    with pytest.raises(EntityTerminal):
        model.append([ev(EventType.WAIT_COMPLETED, "w")])
    with pytest.raises(WaitNotFound):
        model.append([ev(EventType.WAIT_COMPLETED, "other")])


def test_plan_append_never_mutates_the_snapshot() -> None:
    model = Model()
    model.append([ev(EventType.STEP_CREATED, "s", step_name="s", input={}), ev(EventType.HOOK_CREATED, "h", token="t")])
    batch = [ev(EventType.STEP_STARTED, "s"), ev(EventType.HOOK_DISPOSED, "h"), ev(EventType.RUN_COMPLETED, output=1)]
    snapshot = model.snapshot(batch)
    before = (dict(snapshot.steps), dict(snapshot.hooks), dict(snapshot.token_owners), snapshot.run)
    plan_append(snapshot, batch, now=T0)
    with pytest.raises(StepNotFound):
        plan_append(snapshot, [*batch[:1], ev(EventType.STEP_STARTED, "missing")], now=T0)
    assert (dict(snapshot.steps), dict(snapshot.hooks), dict(snapshot.token_owners), snapshot.run) == before


# -- properties ----------------------------------------------------------------------------------------------------

_IDS = {"step": ["s1", "s2"], "hook": ["h1", "h2"], "wait": ["w1", "w2"], "child": ["child:1", "child:2"]}


@st.composite
def _events(draw: st.DrawFn) -> NewEvent:
    kind = draw(st.sampled_from(list(EventType)))
    run_level = kind in events.RUN_EVENTS
    family = (
        "step"
        if kind in events.STEP_EVENTS
        else "hook"
        if kind in events.HOOK_EVENTS
        else "child"
        if kind in events.CHILD_EVENTS
        else "wait"
    )
    change = draw(st.sampled_from(["c1", "c2"]))
    cid = (
        None if run_level else f"patch:{change}" if kind in events.PATCH_EVENTS else draw(st.sampled_from(_IDS[family]))
    )
    table: dict[EventType, dict[str, Any]] = {
        EventType.RUN_CREATED: {"workflow_name": "wf", "input": {}},
        EventType.RUN_COMPLETED: {"output": 1},
        EventType.RUN_FAILED: {"error": ERR},
        EventType.STEP_CREATED: {"step_name": "s", "input": {}},
        EventType.STEP_COMPLETED: {"result": 1},
        EventType.STEP_FAILED: {"error": ERR},
        EventType.STEP_RETRYING: {
            "error": ERR,
            "retry_after": isoformat(T0 + timedelta(seconds=draw(st.sampled_from([-5, 3])))),
        },
        EventType.HOOK_CREATED: {"token": draw(st.sampled_from(["t1", "t2", "t_foreign"]))},
        EventType.HOOK_CONFLICT: {"token": "t1"},
        EventType.HOOK_RECEIVED: {"payload": 1},
        EventType.WAIT_CREATED: {"resume_at": isoformat(T0)},
        EventType.PATCH_APPLIED: {"change_id": change},
        EventType.CHILD_STARTED: {"run_id": "r1!1", "workflow_name": "child"},
        EventType.CHILD_ENDED: {"run_id": "r1!1", "status": "completed", "output": 1},
    }
    return NewEvent(kind, cid, table.get(kind, {}))


_HISTORIES = st.lists(st.lists(_events(), min_size=1, max_size=4), max_size=25)


@settings(max_examples=300, deadline=None)
@given(_HISTORIES)
def test_histories_keep_the_invariants(batches: list[list[NewEvent]]) -> None:
    model = Model(status=RunStatus.PENDING)
    started_at: dict[str, datetime] = {}
    for batch in batches:
        before = model.state()
        try:
            model.append(batch)
        except EventRejected:
            assert model.state() == before
            continue
        for step_id, step in model.steps.items():
            if step.started_at is not None:
                assert started_at.setdefault(step_id, step.started_at) == step.started_at  # set once (P7)
    log = model.log
    assert [e.slot for e in log] == list(range(1, len(log) + 1)) and model.run.event_count == len(log)
    terminal_runs = [
        e for e in log if e.event_type in (EventType.RUN_COMPLETED, EventType.RUN_FAILED, EventType.RUN_CANCELLED)
    ]
    assert len(terminal_runs) <= 1
    assert sum(e.event_type is EventType.RUN_STARTED for e in log) <= 1
    per_step = Counter(
        e.correlation_id for e in log if e.event_type in (EventType.STEP_COMPLETED, EventType.STEP_FAILED)
    )
    assert all(n == 1 for n in per_step.values())
    for step_id, step in model.steps.items():
        starts = sum(e.event_type is EventType.STEP_STARTED and e.correlation_id == step_id for e in log)
        assert step.attempt == starts
        assert step.status.terminal == (step_id in per_step)
    per_wait = Counter(e.correlation_id for e in log if e.event_type is EventType.WAIT_COMPLETED)
    assert all(n == 1 for n in per_wait.values())
    if model.run.status.terminal:
        assert model.hooks == {} and model.waits == {}
    assert {h.token for h in model.hooks.values()} <= set(model.tokens)
    assert len({(h.run_id, h.hook_id) for h in model.tokens.values()}) == len(model.tokens)


@settings(max_examples=300, deadline=None)
@given(st.lists(_events(), min_size=1, max_size=8))
def test_a_batch_equals_its_events_appended_one_by_one(batch: list[NewEvent]) -> None:
    together, apart = Model(), Model()
    untouched = together.state()
    try:
        together.append(batch)
        error: type[Exception] | None = None
    except EventRejected as exc:
        error = type(exc)
    if any(e.event_type in (EventType.RUN_CREATED, EventType.HOOK_CONFLICT) for e in batch):
        assert error is EventInvalid  # shapes are checked before any rule
        assert together.state() == untouched
        return
    apart.now = together.now - timedelta(seconds=1)
    failed: type[Exception] | None = None
    for event in batch:
        try:
            apart.append([event])
            apart.now -= timedelta(seconds=1)  # the batch happens at one instant
        except EventRejected as exc:
            failed = type(exc)
            break
    assert failed is error
    if error is None:
        assert apart.state() == together.state()
    else:
        assert together.state() == untouched  # all or nothing


def _whole(model: Model) -> Snapshot:
    """Everything a World knows of the run (what the Postgres World keeps between appends)."""
    return Snapshot(
        run=model.run,
        steps=dict(model.steps),
        hooks=dict(model.hooks),
        waits=dict(model.waits),
        created_hooks={
            str(e.correlation_id)
            for e in model.log
            if e.event_type in (EventType.HOOK_CREATED, EventType.HOOK_CONFLICT)
        },
    )


@settings(max_examples=300, deadline=None)
@given(_HISTORIES)
def test_a_kept_snapshot_advanced_by_each_plan_plans_like_fresh_reads(batches: list[list[NewEvent]]) -> None:
    model = Model(status=RunStatus.PENDING)
    kept = _whole(model)
    for batch in batches:
        owners = {k: v for k, v in model.tokens.items() if k in keys_of(batch).tokens}  # always read afresh
        on_kept: Plan | type[Exception]
        try:
            on_kept = plan_append(
                dataclasses.replace(kept, token_owners=owners), batch, now=model.now + timedelta(seconds=1)
            )
        except EventRejected as exc:
            on_kept = type(exc)
        try:
            plan = model.append(batch)
        except EventRejected as exc:
            assert on_kept is type(exc)
            continue
        assert isinstance(on_kept, Plan)
        if plan.run_ended:  # every hook of the run goes; which ones the plan names depends on what was read
            assert dataclasses.replace(on_kept, hooks_deleted={}) == dataclasses.replace(plan, hooks_deleted={})
        else:
            assert on_kept == plan
        kept = rules.advance(kept, plan)
        assert kept == _whole(model)
