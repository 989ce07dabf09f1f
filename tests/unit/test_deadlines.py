"""Deadlines on the in-memory World with a manual clock (no waiting): where a run meets its deadline, what a
timed-out run's history replays to, continue_as_new chains, options and errors. The same behaviour on every World in
real time is in the conformance suite (:class:`celery_workflow.testing.conformance_deadlines.DeadlineConformance`).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import Celery

from celery_workflow import (
    ConfigurationError,
    RunTimedOut,
    StepTimedOut,
    WorkflowFailed,
    Workflows,
    continue_as_new,
    sleep,
)
from celery_workflow.errors import run_failure
from celery_workflow.event_data import RunCreatedData
from celery_workflow.events import EventType, RunStatus
from celery_workflow.runtime.steps import error_info
from celery_workflow.testing import History, LocalWorker, MemoryWorld, ReplayResult, replay_history
from tests.histories.workflows import ManualClock

START = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)


def setup() -> tuple[Workflows, MemoryWorld, ManualClock]:
    clock = ManualClock(START)
    world = MemoryWorld(clock=clock)
    wf = Workflows(Celery("deadlines-unit"), world=world, broker="app")
    wf.runtime.clock = clock
    return wf, world, clock


def test_a_run_asleep_past_its_deadline_fails_and_its_history_replays_to_that() -> None:
    wf, world, clock = setup()
    ran: list[int] = []

    @wf.step
    def count(n: int) -> int:
        ran.append(n)
        return n

    @wf.workflow(timeout=timedelta(minutes=10))
    def napper() -> str:
        count(1)
        sleep(timedelta(hours=1))
        count(2)
        return "done"

    run = napper.start()
    worker = LocalWorker(wf)
    worker.run_until_idle()
    assert run.status is RunStatus.RUNNING and ran == [1]
    due = sorted(d.not_before for d in world.pending() if d.not_before is not None)
    created = world.list_events(run.id)[0].data_as(RunCreatedData)
    assert created.deadline is not None and due[0] == created.deadline  # the deadline delivery, before the sleep's
    clock.advance_to(due[0])
    view = worker.run_until_complete(run)
    assert view.status is RunStatus.FAILED and ran == [1]
    with pytest.raises(RunTimedOut, match=r"run .* of workflow napper passed its deadline 2026-01-05T09:10"):
        run.result(timeout=0)
    assert world.list_events(run.id)[-1].data["code"] == "RUN_TIMED_OUT"
    # the recorded failure is what the code gives a replay of the history
    history = History.from_world(world, run.id)
    assert replay_history(wf, history) == ReplayResult("failed", None, view.error)


def test_the_workflow_cannot_catch_its_own_timeout() -> None:
    wf, _, clock = setup()
    ran: list[str] = []

    @wf.step
    def slow() -> None:
        ran.append("slow")
        clock.advance_to(START + timedelta(hours=1))  # the step takes past the run's deadline

    @wf.step
    def after() -> None:
        ran.append("after")

    @wf.workflow(timeout=timedelta(minutes=5))
    def stubborn() -> str:
        slow()
        try:
            after()
        except Exception:  # the timeout is no Exception: it cannot keep the run going
            return "caught"
        return "finished"

    run = stubborn.start()
    view = LocalWorker(wf).run_until_complete(run)
    assert view.status is RunStatus.FAILED
    assert view.error is not None and view.error["type"] == "celery_workflow.errors.RunTimedOut"
    assert ran == ["slow"]  # the next step was never started
    assert [e.correlation_id for e in run.events() if e.event_type is EventType.STEP_CREATED] == ["step:slow:1"]


def test_a_continue_as_new_chain_keeps_its_first_deadline() -> None:
    wf, world, _ = setup()

    @wf.workflow(timeout=timedelta(hours=2))
    def looping(n: int) -> int:
        if n < 2:
            continue_as_new(n + 1)
        return n

    run = looping.start(0)
    LocalWorker(wf).run_until_idle()
    assert world.get_run(f"{run.id}~2").status is RunStatus.COMPLETED
    deadlines = {
        world.list_events(r)[0].data_as(RunCreatedData).deadline for r in (run.id, f"{run.id}~1", f"{run.id}~2")
    }
    assert len(deadlines) == 1 and None not in deadlines
    assert run.result(timeout=0) == 2


@pytest.mark.parametrize("timeout", [0, -1, timedelta(0), float("nan"), "10", True])
def test_a_timeout_that_is_not_a_positive_duration_is_refused(timeout: Any) -> None:
    wf, _, _ = setup()
    with pytest.raises(ConfigurationError, match="timeout"):
        wf.workflow(timeout=timeout)(lambda: None)
    with pytest.raises(ConfigurationError, match="timeout"):
        wf.step(timeout=timeout)(lambda: None)


def test_a_number_of_seconds_is_a_timeout() -> None:
    wf, _, _ = setup()

    @wf.step(timeout=2.5)
    def quick() -> None:
        return None

    assert wf.registry.step("quick").timeout == timedelta(seconds=2.5)


def test_a_step_timeout_sets_celerys_time_limits_on_its_task() -> None:
    wf, _, _ = setup()

    @wf.step(timeout=timedelta(seconds=30))
    def limited() -> None:
        return None

    @wf.step
    def unlimited() -> None:
        return None

    tasks = wf.celery_app.tasks
    assert (tasks["step.limited"].soft_time_limit, tasks["step.limited"].time_limit) == (30.0, 40.0)
    assert (tasks["step.unlimited"].soft_time_limit, tasks["step.unlimited"].time_limit) == (None, None)


def test_result_raises_run_timed_out_only_for_a_run_that_timed_out() -> None:
    timed_out = run_failure("r1", error_info(RunTimedOut("late")))
    assert type(timed_out) is RunTimedOut and isinstance(timed_out, WorkflowFailed)
    other = run_failure("r2", error_info(StepTimedOut("slow")))
    assert type(other) is WorkflowFailed
