"""Child runs on the in-memory World: ``other.start(...)`` inside a workflow, ``ChildRun.result()`` and ``gather``,
failures and cancellations reaching the parent, the ``parent_close`` policy, replay, and a fan-out of 1,000 children
(split into appends within the World's limits).

The World's part (the child's end and the parent's wake-up in one transaction) on every World is
:class:`celery_workflow.testing.conformance_children.ChildRunConformance`.
"""

from __future__ import annotations

import time

import pytest
from celery import Celery

from celery_workflow import (
    ChildRun,
    EventType,
    FatalError,
    RunCancelled,
    RunStatus,
    WorkflowFailed,
    Workflows,
    gather,
)
from celery_workflow.errors import ConfigurationError, HookNotFound
from celery_workflow.event_data import ChildEndedData, ChildStartedData, RunCreatedData
from celery_workflow.runtime.children import child_id
from celery_workflow.testing import LocalWorker, MemoryWorld


def _workflows() -> tuple[Workflows, MemoryWorld]:
    world = MemoryWorld()
    return Workflows(Celery("children"), world=world, broker="app"), world


def test_a_parent_waits_for_its_child_and_gets_its_result() -> None:
    wf, world = _workflows()

    @wf.step
    def double(n: int) -> int:
        return n * 2

    @wf.workflow
    def child(n: int) -> int:
        return double(n)

    @wf.workflow
    def parent(n: int) -> dict[str, object]:
        run = child.start(n)
        assert isinstance(run, ChildRun)
        return {"id": run.id, "value": run.result()}

    run = parent.start(21, run_id="p-1")
    LocalWorker(wf).run_until_complete(run)
    assert run.result() == {"id": "p-1!1", "value": 42}
    kinds = [(e.event_type, e.correlation_id) for e in run.events()]
    assert (EventType.CHILD_STARTED, "child:1") in kinds
    ended = [e for e in run.events() if e.event_type is EventType.CHILD_ENDED]
    assert [e.data_as(ChildEndedData) for e in ended] == [ChildEndedData("p-1!1", "completed", output=42)]
    created = world.list_events("p-1!1", limit=1)[0].data_as(RunCreatedData)
    assert created.parent is not None and created.parent["run_id"] == "p-1"
    assert world.get_run("p-1!1").status is RunStatus.COMPLETED


def test_gather_takes_child_runs_beside_step_futures_and_a_failed_child_raises_workflow_failed() -> None:
    wf, _ = _workflows()

    @wf.step
    def one() -> int:
        return 1

    @wf.workflow
    def child(n: int) -> int:
        if n < 0:
            raise FatalError("negative")
        return n

    @wf.workflow
    def parent() -> dict[str, object]:
        values = gather(child.start(2), one.start(), child.start(3))
        try:
            child.start(-1).result()
        except WorkflowFailed as exc:
            return {"values": values, "failed": exc.run_id, "type": exc.error.get("type", "")}
        return {"values": values}

    run = parent.start(run_id="g")
    LocalWorker(wf).run_until_complete(run)
    out = run.result()
    assert out["values"] == [2, 1, 3]
    assert out["failed"] == "g!3"
    assert "FatalError" in str(out["type"])


def test_a_child_cancelled_from_outside_raises_run_cancelled_in_its_parent() -> None:
    wf, world = _workflows()
    from celery_workflow import create_hook

    @wf.workflow
    def child() -> None:
        create_hook(token="never").wait()

    @wf.workflow
    def parent() -> str:
        try:
            child.start().result()
        except RunCancelled as exc:
            return f"cancelled {exc.run_id}"
        return "done"

    run = parent.start(run_id="c")
    worker = LocalWorker(wf)
    worker.run_until(lambda: _has_hook(world))
    wf.get_run("c!1").cancel()  # as the CLI or a client does: a plain append to the child
    worker.run_until_complete(run)
    assert run.result() == "cancelled c!1"


def _has_hook(world: MemoryWorld, token: str = "never") -> bool:
    try:
        world.get_hook_by_token(token)
    except HookNotFound:
        return False
    return True


def test_cancelling_a_parent_cancels_its_children_but_not_abandoned_ones() -> None:
    wf, world = _workflows()
    from celery_workflow import create_hook

    @wf.workflow
    def child(token: str) -> str:
        return str(create_hook(token=token).wait())

    @wf.workflow
    def parent() -> None:
        kept = child.start("a")
        left = child.start("b", parent_close="abandon")
        gather(kept, left)

    run = parent.start(run_id="pc")
    worker = LocalWorker(wf)
    worker.run_until(lambda: len(world.list_runs().items) == 3 and _live(world, "pc!1") and _live(world, "pc!2"))
    run.cancel()
    assert world.get_run("pc!1").status is RunStatus.CANCELLED
    assert world.get_run("pc!2").status is RunStatus.RUNNING
    wf.resume_hook("b", "fine")
    worker.run_until(lambda: world.get_run("pc!2").status.terminal)
    assert world.get_run("pc!2").status is RunStatus.COMPLETED
    assert world.get_run("pc").status is RunStatus.CANCELLED
    # the cancelled parent took no child_ended: it had ended
    assert EventType.CHILD_ENDED not in [e.event_type for e in run.events()]


def _live(world: MemoryWorld, run_id: str) -> bool:
    return bool(world.list_hooks(run_id))


def test_a_parent_that_completes_cancels_children_still_running() -> None:
    wf, world = _workflows()
    from celery_workflow import create_hook

    @wf.workflow
    def child() -> None:
        create_hook(token="forever").wait()

    @wf.workflow
    def parent() -> str:
        return child.start().id

    run = parent.start(run_id="done")
    LocalWorker(wf).run_until(lambda: world.get_run("done").status.terminal and world.get_run("done!1").status.terminal)
    assert run.result() == "done!1"
    assert world.get_run("done!1").status is RunStatus.CANCELLED


def test_a_replayed_parent_meets_the_same_child_and_parent_close_is_only_for_child_runs() -> None:
    wf, world = _workflows()

    @wf.workflow
    def child() -> int:
        return 7

    @wf.workflow
    def parent() -> list[int]:
        a = child.start()
        b = child.start(run_id="named-child")
        return [a.result(), b.result()]

    run = parent.start(run_id="r")
    LocalWorker(wf).run_until_complete(run)
    assert run.result() == [7, 7]
    started = [e.data_as(ChildStartedData) for e in run.events() if e.event_type is EventType.CHILD_STARTED]
    assert [s.run_id for s in started] == ["r!1", "named-child"]
    assert len(world.list_runs(workflow=child.name).items) == 2  # each child created once, however often replayed
    with pytest.raises(ConfigurationError, match="parent_close"):
        child.start(parent_close="abandon")


def test_child_ids_stay_bounded() -> None:
    assert child_id("p", 3) == "p!3"
    long = child_id("x" * 200, 12)
    assert len(long) <= 200 and long.endswith("!12")


def test_a_fan_out_of_1000_children_completes_in_appends_within_the_limits() -> None:
    wf, _ = _workflows()

    @wf.workflow
    def child(n: int) -> int:
        return n

    @wf.workflow
    def parent(n: int) -> int:
        return sum(gather(*[child.start(i) for i in range(n)]))

    began = time.monotonic()
    run = parent.start(1000, run_id="fan")
    LocalWorker(wf).run_until_complete(run, timeout=60)
    assert run.result() == sum(range(1000))
    elapsed = time.monotonic() - began
    kinds = [e.event_type for e in run.events()]
    assert kinds.count(EventType.CHILD_STARTED) == 1000
    assert kinds.count(EventType.CHILD_ENDED) == 1000
    assert elapsed < 15, elapsed


def test_1000_child_starts_split_into_dynamodb_transactions_of_at_most_100_actions() -> None:
    """What one delivery of a parent starting 1,000 children writes, split by the AWS World's declared limits: each
    append within DynamoDB's 100 actions (a child's end and its parent's child_ended are small appends of their
    own, within them too)."""
    from celery_workflow._aws.append import APPEND_LIMITS
    from celery_workflow.events import NewEvent
    from celery_workflow.runtime import batches

    started = [NewEvent.of(ChildStartedData(f"p!{n}", "child"), f"child:{n}") for n in range(1, 1001)]
    chunks = batches.split(started, [], APPEND_LIMITS)
    assert sum(len(c.events) for c in chunks) == 1000 and len(chunks) > 1
    assert all(APPEND_LIMITS.fits(*APPEND_LIMITS.cost(c.events, c.deliveries)) for c in chunks)
    assert APPEND_LIMITS.max_actions is not None and APPEND_LIMITS.max_actions <= 100
    ended = NewEvent.of(ChildEndedData("p!1", "completed", output=1), "child:1")
    assert APPEND_LIMITS.fits(*APPEND_LIMITS.cost([ended], []))


def test_a_child_run_records_the_trace_context_of_the_delivery_that_started_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wf, world = _workflows()

    @wf.workflow
    def child() -> int:
        return 1

    @wf.workflow
    def parent() -> int:
        return int(child.start().result())

    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    monkeypatch.setattr(wf.runtime.telemetry, "traceparent", lambda: tp)
    run = parent.start(run_id="traced")
    LocalWorker(wf).run_until_complete(run)
    assert world.list_events("traced!1", limit=1)[0].data_as(RunCreatedData).traceparent == tp


def test_a_dead_lettered_child_fails_and_its_parent_sees_workflow_failed() -> None:
    from datetime import UTC, datetime

    from celery_workflow import create_hook
    from celery_workflow.dead_letters import DeadLetter, fail_run

    wf, world = _workflows()

    @wf.workflow
    def child() -> None:
        create_hook(token="letter").wait()

    @wf.workflow
    def parent() -> str:
        try:
            child.start().result()
        except WorkflowFailed as exc:
            return str(exc.error.get("type", ""))
        return "done"

    run = parent.start(run_id="dl")
    worker = LocalWorker(wf)
    worker.run_until(lambda: _has_hook(world, "letter"))
    now = datetime.now(UTC)
    letter = DeadLetter(1, 1, "celery", "dl!1", 10, "max deliveries", "Boom: it broke", now, now, now, now, b"")
    assert fail_run(world, letter)  # what a transport does with a run's dead-lettered delivery
    worker.run_until_complete(run)
    assert "DeadLettered" in run.result()
