"""What a delivery reports to Celery (issue #29, item 3), without a worker: the runtime's :class:`Handled`, the
exception :func:`celery_tasks.report` raises for it, and the task events of inline step attempts."""

from __future__ import annotations

import pickle
from datetime import UTC, datetime
from typing import Any

import pytest
from celery.exceptions import Retry
from celery.worker.request import Request

from celery_workflow import FatalError, Workflows, step_metadata
from celery_workflow.celery_tasks import DeliveryRequest, report, task_events_on
from celery_workflow.errors import RunFailedReport, StepAttemptFailed, StepFailedReport
from celery_workflow.runtime.handled import Handled
from celery_workflow.runtime.task_events import InlineStepEvents

ERROR = {"type": "celery_workflow.errors.FatalError", "message": "card declined", "traceback": "Traceback …"}


def test_handled_is_the_str_of_what_happened_and_carries_its_error() -> None:
    failed = Handled("failed", failure=ERROR)
    assert failed == "failed" and failed.kind == "failed" and failed.error == ERROR
    assert pickle.loads(pickle.dumps(failed)).failure == ERROR
    assert Handled("completed").failure is None and Handled("completed").retry_at is None


def test_a_failed_run_or_step_is_reported_as_a_failure_with_its_error() -> None:
    with pytest.raises(RunFailedReport) as raised:
        report(Handled("failed", failure=ERROR), step=False)
    assert str(raised.value) == "celery_workflow.errors.FatalError: card declined"
    with pytest.raises(StepFailedReport, match="card declined"):
        report(Handled("failed", failure=ERROR), step=True)
    exc = pickle.loads(pickle.dumps(RunFailedReport("x: y")))  # it crosses from a prefork child to its parent
    assert isinstance(exc, RunFailedReport) and str(exc) == "x: y"


def test_an_attempt_that_will_run_again_is_reported_as_a_retry_at_its_due_time() -> None:
    when = datetime(2030, 1, 1, tzinfo=UTC)
    with pytest.raises(Retry) as raised:
        report(Handled("retrying", error=ERROR, retry_at=when), step=True)
    assert raised.value.when == when and isinstance(raised.value.exc, StepAttemptFailed)
    assert "card declined" in str(raised.value.exc)
    again = pickle.loads(pickle.dumps(raised.value))
    assert again.when == when and isinstance(again.exc, StepAttemptFailed)


@pytest.mark.parametrize("kind", ["completed", "suspended", "ended", "missing", "done", "continued"])
def test_any_other_outcome_is_a_success(kind: str) -> None:
    report(Handled(kind), step=False)


class Dispatcher:
    def __init__(self, enabled: bool, groups: set[str]) -> None:
        self.enabled, self.groups, self.hostname = enabled, groups, "w1@host"


def test_task_events_are_on_when_the_dispatcher_sends_the_task_group() -> None:
    assert task_events_on(Dispatcher(True, set()))  # -E: no groups, all of them
    assert task_events_on(Dispatcher(True, {"worker", "task"}))  # enable_events added the task group
    assert not task_events_on(Dispatcher(True, {"worker"}))  # heartbeats and gossip only
    assert not task_events_on(Dispatcher(False, set()))
    assert not task_events_on(None)


def test_a_report_is_acked_by_the_request_before_celery_handles_the_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    class Info:
        exception = RunFailedReport("E: m")
        traceback = ""

    class Probe(DeliveryRequest):  # type: ignore[misc]
        def __init__(self) -> None:  # no message: only what on_failure touches
            self.acknowledged = False

        def acknowledge(self) -> None:
            calls.append("ack")
            self.acknowledged = True

    # Celery's own handling comes after (its reject then changes nothing: the request is acknowledged)
    monkeypatch.setattr(Request, "on_failure", lambda self, *args, **kwargs: calls.append("celery"))
    Probe().on_failure(Info(), return_ok=True)
    assert calls == ["ack", "celery"]
    Info.exception = ValueError("an error of the worker")  # type: ignore[assignment]
    Probe().on_failure(Info(), return_ok=True)
    assert calls == ["ack", "celery", "celery"]  # left to Celery: rejected, then put back by our transports


class Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, type: str, **fields: Any) -> None:
        self.sent.append((type, fields))


def test_inline_attempts_are_reported_as_tasks_of_their_own(wf: Workflows) -> None:
    @wf.step(max_retries=1, retry_backoff=0.01)
    def flaky(n: int) -> int:
        if step_metadata().attempt == 1:
            raise RuntimeError("first attempt fails")
        return n

    @wf.step(max_retries=3)
    def fatal() -> None:
        raise FatalError("no")

    @wf.step
    def add(a: int, b: int) -> int:
        return a + b

    @wf.workflow
    def flow() -> int:
        total = add(1, 2)
        try:
            fatal()
        except Exception:
            total += 1
        return total + flaky(0)

    run = flow.start()
    sent = Recorder()
    ids = iter(["a1", "a2", "a3"])
    events = InlineStepEvents(sent, parent_id="dlv-1", new_id=lambda: next(ids))
    assert wf.runtime.handle_workflow(run.id, delivery_id="dlv-1", task_events=events) == "suspended"
    kinds = [(kind, fields["uuid"]) for kind, fields in sent.sent]
    assert kinds == [
        ("task-received", "a1"), ("task-started", "a1"), ("task-succeeded", "a1"),
        ("task-received", "a2"), ("task-started", "a2"), ("task-failed", "a2"),
        ("task-received", "a3"), ("task-started", "a3"), ("task-retried", "a3"),
    ]  # fmt: skip
    received = sent.sent[0][1]
    assert received["name"] == "step.add" and received["parent_id"] == received["root_id"] == "dlv-1"
    assert received["args"] == repr([run.id, "step:add:1"]) and received["retries"] == 0
    assert sent.sent[2][1]["result"] == "3"
    assert sent.sent[5][1]["exception"] == "celery_workflow.errors.FatalError('no')"
    assert sent.sent[8][1]["exception"] == "RuntimeError('first attempt fails')"


def test_a_sender_that_fails_never_fails_the_step(wf: Workflows) -> None:
    @wf.step
    def add(a: int, b: int) -> int:
        return a + b

    @wf.workflow
    def flow() -> int:
        return add(1, 2)

    def broken(type: str, **fields: Any) -> None:
        raise ConnectionError("broker down")

    run = flow.start()
    events = InlineStepEvents(broken, parent_id="dlv-1")
    assert wf.runtime.handle_workflow(run.id, delivery_id="dlv-1", task_events=events) == "completed"
    assert run.result(timeout=0) == 3
