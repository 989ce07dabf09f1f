"""Conformance: a World's errors are never a workflow's outcome, and a write it refuses as malformed is not retried.

Real workflows run on the World under test (in this process, through :class:`~celery_workflow.testing.LocalWorker`)
while :class:`~celery_workflow.testing.faults.Faults` makes one chosen call fail: a read, an inline step's append,
a queued step's start or result, the run's terminal append. Each workflow catches every ``Exception`` around its
steps, so a World error that leaked into the workflow's code would show in its result. Every run completes with the
result it has without faults; the delivery that met the error was retried. A write refused as malformed
(:class:`~celery_workflow.errors.EventInvalid`) fails its run, or its step, at once, with that cause.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from celery import Celery

from celery_workflow.app import Workflows
from celery_workflow.errors import EventInvalid, StepFailed, WorldError
from celery_workflow.events import EventType, RunStatus, RunView
from celery_workflow.runtime.context import gather
from celery_workflow.testing._conformance import DEADLINE, Conformance
from celery_workflow.testing.driver import LocalWorker
from celery_workflow.testing.faults import Faults, Match, ending
from celery_workflow.world import World

#: The result of ``tally(3)`` (three inline steps, then two parallel ones), with or without faults.
TALLY_3 = {"total": 3, "fan": [4, 5]}


@dataclass
class Harness:
    wf: Workflows
    worker: LocalWorker
    faults: Faults
    flows: dict[str, Any]

    def settle(self, run_id: str, timeout: float = DEADLINE) -> RunView:
        """Handle deliveries until the run has ended (its own looks at the World count towards no fault)."""
        deadline = time.monotonic() + timeout
        while True:
            with self.faults.off():
                view = self.wf.world.get_run(run_id)
            if view.status.terminal:
                return view
            if time.monotonic() > deadline:
                raise AssertionError(f"run {run_id} still {view.status.value} after {timeout} s")
            if not self.worker.run_once():
                time.sleep(0.01)

    def events(self, run_id: str) -> list[EventType]:
        with self.faults.off():
            return [e.event_type for e in self.wf.world.list_events(run_id)]


def _flows(wf: Workflows) -> dict[str, Any]:
    @wf.step
    def add(a: int, b: int) -> int:
        return a + b

    @wf.workflow
    def tally(n: int) -> dict[str, Any]:
        total = 0
        for i in range(n):
            try:
                total = add(total, i)
            except Exception as exc:  # a World error must never reach the workflow's code
                return {"caught": f"{type(exc).__name__}: {exc}"}
        try:
            fan = gather(add.start(total, 1), add.start(total, 2))
        except Exception as exc:
            return {"caught": f"{type(exc).__name__}: {exc}"}
        return {"total": total, "fan": fan}

    @wf.workflow
    def queued(a: int) -> dict[str, Any]:
        try:
            (value,) = gather(add.start(a, 1))
        except StepFailed as exc:
            return {"step_failed": exc.error_type}
        return {"value": value}

    return {"tally": tally, "queued": queued}


class FaultConformance(Conformance):
    """Workflows on the World under test meet one failing World call each."""

    @pytest.fixture
    def harness(self, world: World) -> Iterator[Harness]:
        wf = Workflows(Celery("faults"), world=world, broker="app")
        faults = Faults(world)
        worker = LocalWorker(wf, backoff=lambda attempts: 0.05)
        try:
            yield Harness(wf, worker, faults, _flows(wf))
        finally:
            faults.restore()

    @pytest.mark.parametrize(
        ("method", "call", "when"),
        [
            ("get_run_with_events", 1, None),  # the first delivery's read
            ("get_run_with_events", 2, None),  # a later delivery's read
            ("append", 1, None),  # the first inline step's start
            ("append", 2, None),  # an inline step's result with the next step's start
            ("append", 4, None),  # the parallel steps' creation with their deliveries
            ("append", 1, ending(EventType.STEP_COMPLETED)),  # a queued step's result
            ("append", 1, ending(EventType.RUN_COMPLETED)),  # the run's terminal append
            ("get_step", 1, None),  # a queued step's read
        ],
        ids=["read", "later-read", "step-start", "step-result", "fan-out", "queued-result", "terminal", "get-step"],
    )
    def test_a_world_error_is_never_the_runs_outcome(
        self, harness: Harness, method: str, call: int, when: Match | None
    ) -> None:
        harness.faults.fail(method, call=call, when=when)
        run = harness.flows["tally"].start(3)
        view = harness.settle(run.id)
        assert harness.faults.fired == [(method, call)], "the fault never fired: the test would prove nothing"
        assert view.status is RunStatus.COMPLETED, harness.events(run.id)
        assert view.output is not None
        with harness.faults.off():
            assert run.result(timeout=0) == TALLY_3
        assert EventType.RUN_FAILED not in harness.events(run.id)
        assert any(isinstance(exc, WorldError) for _, exc in harness.worker.failures)

    def test_a_refused_write_fails_the_run_at_once(self, harness: Harness) -> None:
        harness.faults.fail("append", call=2, error=lambda: EventInvalid("injected: a malformed batch"))
        run = harness.flows["tally"].start(3)
        view = harness.settle(run.id)
        assert harness.faults.fired == [("append", 2)]
        assert view.status is RunStatus.FAILED
        assert view.error is not None and "EventInvalid" in str(view.error.get("type"))
        assert "injected: a malformed batch" in str(view.error.get("message"))
        assert harness.worker.failures == []  # failed at once, not retried into the dead letters

    def test_a_refused_step_result_fails_the_step_at_once(self, harness: Harness) -> None:
        harness.faults.fail(
            "append", when=ending(EventType.STEP_COMPLETED), error=lambda: EventInvalid("injected: a bad result")
        )
        run = harness.flows["queued"].start(1)
        view = harness.settle(run.id)
        assert harness.faults.fired == [("append", 1)]
        assert view.status is RunStatus.COMPLETED
        with harness.faults.off():
            assert run.result(timeout=0) == {"step_failed": "celery_workflow.errors.EventInvalid"}
        assert harness.worker.failures == []
