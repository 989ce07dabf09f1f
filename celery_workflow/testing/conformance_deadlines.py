"""Conformance: deadlines (``@wf.workflow(timeout=...)``, ``@wf.step(timeout=...)``) on the World under test.

A run's deadline is recorded in its ``run_created``; a workflow delivery due at the deadline is stored with the run,
so a run asleep or waiting on a hook is woken to fail with :class:`~celery_workflow.errors.RunTimedOut`; a step
delivery of a run past its deadline runs no step. A step attempt past its timeout is a failed attempt
(:class:`~celery_workflow.errors.StepTimedOut`), retried until ``max_retries``. Workflows run in this process through
:class:`~celery_workflow.testing.LocalWorker`; nothing waits a fixed time: the tests wait for conditions.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
from celery import Celery

from celery_workflow.app import Workflow, Workflows
from celery_workflow.errors import RunTimedOut, StepFailed, WorkflowFailed
from celery_workflow.event_data import RunCreatedData
from celery_workflow.events import EventType, RunStatus
from celery_workflow.ids import utcnow
from celery_workflow.runtime.context import create_hook, gather, sleep
from celery_workflow.testing._conformance import DEADLINE, Conformance, unique
from celery_workflow.testing.driver import LocalWorker
from celery_workflow.world import World

#: A run's timeout here: long enough for a first delivery on any World, short enough to wait for.
RUN_TIMEOUT = timedelta(seconds=1)


@dataclass
class Flows:
    wf: Workflows
    worker: LocalWorker
    flows: dict[str, Workflow[..., Any]]
    ran: list[str] = field(default_factory=list)  # the step bodies that ran


def _flows(world: World) -> Flows:
    wf = Workflows(Celery("deadlines"), world=world, broker="app")
    ran: list[str] = []

    @wf.step
    def note(what: str) -> str:
        ran.append(what)
        return what

    @wf.step(timeout=timedelta(milliseconds=50), max_retries=1, retry_backoff=0)
    def stuck(what: str) -> str:
        ran.append(what)
        threading.Event().wait(0.25)  # the body outlives its timeout: each attempt fails
        return what

    @wf.step(timeout=timedelta(seconds=30))
    def quick(what: str) -> str:
        ran.append(what)
        return what

    @wf.workflow(timeout=RUN_TIMEOUT)
    def sleeper() -> str:
        sleep(3600)
        return "woke"

    @wf.workflow(timeout=RUN_TIMEOUT)
    def waiter(token: str) -> Any:
        return create_hook(token=token).wait()

    @wf.workflow(timeout=RUN_TIMEOUT)
    def fan(what: str) -> list[str]:
        return gather(note.start(what))

    @wf.workflow(timeout=timedelta(hours=1))
    def brisk(what: str) -> str:
        return note(what)

    @wf.workflow
    def limited(what: str) -> dict[str, Any]:
        try:
            value = stuck(what)
        except StepFailed as exc:
            return {"failed": exc.error_type, "message": exc.error.get("message", "")}
        return {"value": value, "quick": quick(what)}

    @wf.workflow
    def in_time(what: str) -> str:
        return quick(what)

    worker = LocalWorker(wf, backoff=lambda attempts: 0.05)
    flows: dict[str, Workflow[..., Any]] = {
        "sleeper": sleeper,
        "waiter": waiter,
        "fan": fan,
        "brisk": brisk,
        "limited": limited,
        "in_time": in_time,
    }
    return Flows(wf, worker, flows, ran)


class DeadlineConformance(Conformance):
    """Run deadlines and step timeouts on the World under test."""

    @pytest.fixture
    def deadlines(self, world: World) -> Flows:
        return _flows(world)

    def _deadline(self, world: World, run_id: str) -> Any:
        created = world.list_events(run_id, limit=1)[0].body
        assert isinstance(created, RunCreatedData)
        return created.deadline

    def test_the_deadline_is_recorded_at_creation(self, world: World, deadlines: Flows) -> None:
        run = deadlines.flows["brisk"].start("x")
        deadline = self._deadline(world, run.id)
        assert deadline is not None  # an hour from when the run was started (the World's stamp comes a moment later)
        assert abs(deadline - run.view().created_at - timedelta(hours=1)) < timedelta(minutes=1)
        assert deadlines.worker.run_until_complete(run, DEADLINE).status is RunStatus.COMPLETED
        assert run.result(timeout=0) == "x"  # the deadline delivery, due in an hour, changes nothing
        untimed = deadlines.flows["in_time"].start("y")
        assert self._deadline(world, untimed.id) is None

    @pytest.mark.parametrize("flow", ["sleeper", "waiter"])
    def test_a_run_asleep_or_waiting_wakes_to_fail_at_its_deadline(
        self, world: World, deadlines: Flows, flow: str
    ) -> None:
        args = (unique("tok"),) if flow == "waiter" else ()
        run = deadlines.flows[flow].start(*args)
        worker = deadlines.worker
        worker.run_until(lambda: run.status is RunStatus.RUNNING, DEADLINE)
        worker.run_until_idle()
        assert run.status is RunStatus.RUNNING  # at rest, asleep for an hour or on its hook
        view = worker.run_until_complete(run, DEADLINE)
        assert view.status is RunStatus.FAILED
        assert view.error is not None and view.error["type"] == "celery_workflow.errors.RunTimedOut"
        with pytest.raises(RunTimedOut, match="passed its deadline") as info:
            run.result(timeout=0)
        assert isinstance(info.value, WorkflowFailed)
        ended = [e for e in world.list_events(run.id) if e.event_type is EventType.RUN_FAILED]
        assert ended[0].data["code"] == "RUN_TIMED_OUT"
        assert utcnow() >= self._deadline(world, run.id)

    def test_a_step_of_a_run_past_its_deadline_does_not_run(self, world: World, deadlines: Flows) -> None:
        run = deadlines.flows["fan"].start(unique("late"))
        worker = deadlines.worker
        worker.run_until(lambda: bool(world.list_steps(run.id)), DEADLINE)  # the step is queued, not yet run
        deadline = self._deadline(world, run.id)
        stop = time.monotonic() + DEADLINE
        while utcnow() < deadline and time.monotonic() < stop:  # the World's clock passes the deadline
            time.sleep(0.01)
        view = worker.run_until_complete(run, DEADLINE)
        assert view.status is RunStatus.FAILED, view
        assert view.error is not None and view.error["type"] == "celery_workflow.errors.RunTimedOut"
        assert deadlines.ran == []  # the step body never ran
        assert [s.status.value for s in world.list_steps(run.id)] == ["pending"]

    def test_a_step_attempt_past_its_timeout_is_a_failed_attempt(self, world: World, deadlines: Flows) -> None:
        what = unique("stuck")
        run = deadlines.flows["limited"].start(what)
        assert deadlines.worker.run_until_complete(run, DEADLINE).status is RunStatus.COMPLETED
        result = run.result(timeout=0)
        assert result["failed"] == "celery_workflow.errors.StepTimedOut"
        assert "past its timeout of 0.05 s" in result["message"]
        assert deadlines.ran == [what, what]  # max_retries=1: two attempts, each timed out
        kinds = [e.event_type for e in world.list_events(run.id)]
        assert kinds.count(EventType.STEP_RETRYING) == 1 and kinds.count(EventType.STEP_FAILED) == 1
        (step,) = world.list_steps(run.id)
        assert step.status.value == "failed"

    def test_a_step_with_a_timeout_runs_as_its_own_delivery(self, world: World, deadlines: Flows) -> None:
        run = deadlines.flows["in_time"].start("q")
        assert deadlines.worker.run_until_complete(run, DEADLINE).status is RunStatus.COMPLETED
        assert run.result(timeout=0) == "q"
        created = [e for e in world.list_events(run.id) if e.event_type is EventType.STEP_CREATED]
        assert created[0].data["mode"] == "queued"
