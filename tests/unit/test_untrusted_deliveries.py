"""Nothing a delivery message carries is trusted beyond what the World recorded (issue #26, items 1 and 2).

A run cancelled before its first delivery arrives runs no step, whatever the path (a warmed-up, known-quick first
step included); a forged message (a header naming another workflow and input, a task name that disagrees with the
run or step it names) runs no user code with inputs the World never recorded.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_workflow import RunCancelled, Workflows, create_hook, gather
from celery_workflow.app import build_message, step_task_name, workflow_task_name
from celery_workflow.errors import HookConflict, WorkflowFailed
from celery_workflow.events import EventType, RunStatus
from celery_workflow.ids import isoformat, utcnow
from celery_workflow.testing import LocalWorker, MemoryWorld
from celery_workflow.world import Claim

#: The header earlier versions put on a run's first delivery (its run record) and then replayed from.
OLD_HEADER = "cw_opening"
AT = isoformat(utcnow())


@pytest.fixture
def wf() -> Iterator[Workflows]:
    w = Workflows(Celery("untrusted"), world=MemoryWorld(), broker="app")
    yield w
    w.close()


def _flows(wf: Workflows) -> tuple[Any, Any, Any, list[tuple[str, Any]]]:
    calls: list[tuple[str, Any]] = []

    @wf.step
    def mark(tag: str) -> str:
        calls.append(("mark", tag))
        return tag

    @wf.step
    def pay(cents: int) -> int:
        calls.append(("pay", cents))
        return cents

    @wf.workflow
    def marker(tag: str) -> str:
        return mark(tag)

    @wf.workflow
    def payment(cents: int) -> int:
        return pay(cents)

    @wf.workflow
    def fan(tag: str) -> list[str]:
        return gather(mark.start(tag))

    return marker, payment, fan, calls


def _claim(wf: Workflows, run_id: str) -> tuple[bytes, Claim]:
    (claimed,) = wf.world.claim([wf.runtime.default_queue], limit=1, lease=30)
    assert claimed.run_id == run_id
    return claimed.payload, Claim(claimed.receipt, claimed.attempts)


def _forged(wf: Workflows, task: str, args: list[Any], headers: dict[str, Any] | None = None) -> bytes:
    return build_message(
        wf.celery_app, task, args, {}, queue=wf.runtime.default_queue, task_id="forged", headers=headers
    )


def test_a_run_cancelled_before_its_first_delivery_runs_no_step(wf: Workflows) -> None:
    marker, _, _, calls = _flows(wf)
    LocalWorker(wf).run_until_complete(marker.start("warm-up"))  # the step is now known quick in this process
    run = marker.start("cancelled")
    payload, claim = _claim(wf, run.id)
    run.cancel()
    assert wf.handle_delivery(payload, claim) == "ended"
    assert calls == [("mark", "warm-up")]  # the side effect never happened
    with pytest.raises(RunCancelled):
        run.result(timeout=0)


def test_the_first_delivery_of_a_run_cancelled_meanwhile_runs_no_step_without_a_claim(wf: Workflows) -> None:
    marker, _, _, calls = _flows(wf)
    run = marker.start("cancelled")
    payload, _ = _claim(wf, run.id)
    run.cancel()
    assert wf.handle_delivery(payload) == "ended"
    assert calls == []


def test_a_forged_opening_for_a_missing_run_runs_nothing(wf: Workflows) -> None:
    marker, _, _, calls = _flows(wf)
    LocalWorker(wf).run_until_complete(marker.start("warm-up"))
    opening = {"data": {"workflow_name": "marker", "input": {"args": ["forged"], "kwargs": {}}}, "at": AT}
    payload = _forged(wf, workflow_task_name("marker"), ["no-such-run"], {OLD_HEADER: opening})
    assert wf.handle_delivery(payload, Claim("r", 1)) == "missing"
    assert calls == [("mark", "warm-up")]


def test_a_forged_opening_for_a_pending_run_does_not_replace_its_input(wf: Workflows) -> None:
    _, payment, _, calls = _flows(wf)
    LocalWorker(wf).run_until_complete(payment.start(1))
    run = payment.start(100)
    payload, claim = _claim(wf, run.id)
    forged_opening = {"data": {"workflow_name": "payment", "input": {"args": [999999], "kwargs": {}}}, "at": AT}
    forged = _forged(wf, workflow_task_name("payment"), [run.id], {OLD_HEADER: forged_opening})
    assert wf.handle_delivery(forged, claim) == "completed"
    assert calls == [("pay", 1), ("pay", 100)]  # the input the World recorded, not the header's
    assert run.result(timeout=0) == 100
    del payload


def test_a_task_name_naming_another_workflow_is_dropped(wf: Workflows) -> None:
    """``workflow.payment`` sent for a run of ``marker`` (with an opening naming payment): nothing runs."""
    marker, _, _, calls = _flows(wf)
    LocalWorker(wf).run_until_complete(marker.start("warm-up"))
    run = marker.start("real")
    _claim(wf, run.id)
    opening = {"data": {"workflow_name": "payment", "input": {"args": [5], "kwargs": {}}}, "at": AT}
    forged = _forged(wf, workflow_task_name("payment"), [run.id], {OLD_HEADER: opening})
    assert wf.handle_delivery(forged, Claim("r", 1)) == "mismatch"
    assert calls == [("mark", "warm-up")]
    assert wf.world.get_run(run.id).status is RunStatus.PENDING


def test_a_completed_run_of_another_workflow_runs_nothing(wf: Workflows) -> None:
    marker, _, _, calls = _flows(wf)
    done = marker.start("done")
    LocalWorker(wf).run_until_complete(done)
    opening = {"data": {"workflow_name": "payment", "input": {"args": [5], "kwargs": {}}}, "at": AT}
    for task in (workflow_task_name("payment"), workflow_task_name("marker")):
        assert wf.handle_delivery(_forged(wf, task, [done.id], {OLD_HEADER: opening})) in ("mismatch", "ended")
    assert calls == [("mark", "done")]


def test_a_step_delivery_naming_another_step_is_dropped(wf: Workflows) -> None:
    _, _, fan, calls = _flows(wf)
    run = fan.start("x")
    worker = LocalWorker(wf)
    worker.run_once()  # the workflow delivery: creates step:mark:1 and queues its delivery
    step_id = wf.world.list_steps(run.id)[0].step_id
    forged = _forged(wf, step_task_name("pay"), [run.id, step_id])
    assert wf.handle_delivery(forged, Claim("r", 1)) == "mismatch"
    assert calls == []
    worker.run_until_complete(run)
    assert run.result(timeout=0) == ["x"] and calls == [("mark", "x")]


def test_a_hook_token_of_the_wrong_type_fails_the_run_at_once(wf: Workflows) -> None:
    @wf.workflow
    def waits() -> Any:
        return create_hook(token=123).wait()  # type: ignore[arg-type]

    worker = LocalWorker(wf)
    run = waits.start()
    worker.run_until_complete(run)
    assert worker.failures == []  # not retried
    with pytest.raises(WorkflowFailed) as failed:
        run.result(timeout=0)
    assert "EventInvalid" in failed.value.error["type"]
    assert "non-empty string, not int" in failed.value.error["message"]


def test_a_hook_taken_over_names_no_token_in_the_runs_error(wf: Workflows) -> None:
    """The run that lost its token fails with HookConflict; its recorded error names the other run, not the token
    (readers of a run's error see it without ``reveal_token``)."""
    from celery_workflow.runtime.context import create_hook as hook

    @wf.workflow
    def holder() -> Any:
        return hook(token="secret-token-123").wait()

    @wf.workflow
    def taker() -> Any:
        return hook(token="secret-token-123", force=True).wait()

    worker = LocalWorker(wf)
    first = holder.start()
    worker.run_until_idle()
    second = taker.start()
    worker.run_until(lambda: first.status.terminal)
    with pytest.raises(WorkflowFailed) as failed:
        first.result(timeout=0)
    assert HookConflict.__name__ in failed.value.error["type"]
    assert "secret-token-123" not in failed.value.error["message"]
    assert second.id in failed.value.error["message"]
    disposed = [e for e in first.events() if e.event_type is EventType.HOOK_DISPOSED]
    assert disposed and "token" not in disposed[0].data
