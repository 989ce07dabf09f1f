"""Versioned workflow code: ``patched(change_id)`` with recorded histories (old history + new code), a new run on
the new code, the rules for ``patch_applied``, and divergence messages that name the change to guard.

The same behaviour on every World, with two code versions running one after the other, is in the conformance suite
(:class:`celery_workflow.testing.conformance_versions.VersioningConformance`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from celery import Celery

from celery_workflow import EventType, ReplayDivergence, RunStatus, Workflows, patched
from celery_workflow.errors import EventInvalid, RunTerminal
from celery_workflow.event_data import PatchAppliedData, RunCompletedData
from celery_workflow.events import NewEvent
from celery_workflow.runtime.context import NotInWorkflow
from celery_workflow.testing import History, LocalWorker, MemoryWorld, ReplayResult, replay_history
from tests.histories import workflows
from tests.histories.changed import changed
from tests.histories.guarded import guarded

HERE = Path(__file__).resolve().parent.parent / "histories"


def load(name: str) -> History:
    return History.load(HERE / f"{name}.json")


def recorded_output(history: History) -> object:
    end = history.terminal_event
    assert end is not None
    return end.data_as(RunCompletedData).output


# -- old histories, new code -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sequential", "fan_out"])
def test_a_run_recorded_before_a_guarded_change_replays_its_old_path(name: str) -> None:
    history = load(name)
    result = replay_history(guarded, history)
    assert result == ReplayResult("completed", recorded_output(history))


def test_a_run_at_rest_before_a_guarded_change_still_replays() -> None:
    # fan_out_waiting waits on its parallel steps: the guard comes after them, so it has not been reached yet
    assert replay_history(guarded, load("fan_out_waiting")) == ReplayResult("suspended")


def test_the_same_change_unguarded_diverges_naming_the_change_to_guard() -> None:
    with pytest.raises(ReplayDivergence) as info:
        replay_history(changed, load("sequential"))
    message = info.value.message
    assert "the workflow code now calls 'step:charge:1' there" in message
    assert (
        "guard the change ('step:charge:1') with `if patched(\"<change-id>\"): <new code> else: <old code>`" in message
    )
    assert "docs/workflow-changes.md" in message


def test_a_removed_call_names_its_removal_as_the_change() -> None:
    with pytest.raises(
        ReplayDivergence, match=r"no longer reaches; .*guard the change \(the removal of 'step:fallback:1'\)"
    ):
        replay_history(changed, load("step_failed_caught"))


# -- new runs on the new code ------------------------------------------------------------------------------------------


def _world_with_guarded_sequential() -> tuple[Workflows, MemoryWorld]:
    world = MemoryWorld()
    wf = Workflows(Celery("patched-new"), world=world, broker="app")

    @wf.step(name="reserve")
    def reserve(order_id: str, items: list[workflows.Item]) -> int:
        return sum(item.qty for item in items)

    @wf.step(name="charge")
    def charge(order_id: str, amount: int) -> str:
        return f"rcpt:{order_id[:8]}:{amount}"

    @wf.workflow(name="sequential")
    def sequential(items: list[workflows.Item]) -> dict[str, object]:
        order_id = "o-1"
        total = sum(item.qty * item.price for item in items)
        if patched("charge-first"):
            receipt = charge(order_id, total)
            count = reserve(order_id, items)
        else:
            count = reserve(order_id, items)
            receipt = charge(order_id, total)
        return {"count": count, "receipt": receipt, "first": patched("charge-first")}

    return wf, world


def test_a_new_run_takes_the_new_path_and_its_history_replays() -> None:
    wf, world = _world_with_guarded_sequential()
    run = wf.start("sequential", [workflows.Item("pen", 2, 100)])
    assert LocalWorker(wf).run_until_complete(run).status is RunStatus.COMPLETED
    assert run.result(timeout=0) == {"count": 2, "receipt": "rcpt:o-1:200", "first": True}
    events = world.list_events(run.id)
    kinds = [(e.event_type, e.correlation_id) for e in events if e.correlation_id]
    assert kinds[0] == (EventType.PATCH_APPLIED, "patch:charge-first")  # written before the step it decided
    assert [cid for kind, cid in kinds if kind is EventType.STEP_CREATED] == ["step:charge:1", "step:reserve:1"]
    history = History.from_world(world, run.id)
    assert replay_history(wf, history) == ReplayResult("completed", run.view().output)


def test_patched_outside_a_workflow_is_refused() -> None:
    with pytest.raises(NotInWorkflow, match="patched"):
        patched("x")


def test_an_empty_change_id_fails_the_run_with_a_clear_error() -> None:
    world = MemoryWorld()
    wf = Workflows(Celery("patched-bad"), world=world, broker="app")

    @wf.workflow
    def bad() -> bool:
        return patched("")

    run = bad.start()
    view = LocalWorker(wf).run_until_complete(run)
    assert view.status is RunStatus.FAILED
    assert view.error is not None and "non-empty string change id" in view.error["message"]


# -- the rules ---------------------------------------------------------------------------------------------------------


def test_patch_applied_needs_its_correlation_id_and_a_live_run() -> None:
    world = MemoryWorld()
    wf = Workflows(Celery("patched-rules"), world=world, broker="app")

    @wf.workflow
    def noop() -> None:
        return None

    run = noop.start()
    marker = PatchAppliedData(change_id="c1")
    with pytest.raises(EventInvalid, match="patch:c1"):
        world.append(run.id, [NewEvent.of(marker, "patch:other")])
    world.append(run.id, [NewEvent.of(marker, "patch:c1")])
    LocalWorker(wf).run_until_complete(run)
    with pytest.raises(RunTerminal):
        world.append(run.id, [NewEvent.of(marker, "patch:c1")])
    with pytest.raises(EventInvalid, match="change_id"):
        world.append(run.id, [NewEvent(EventType.PATCH_APPLIED, "patch:", {"change_id": ""})])


def test_the_inspector_timeline_shows_the_change_a_run_took() -> None:
    from celery_workflow.inspector.model import timeline

    wf, world = _world_with_guarded_sequential()
    run = wf.start("sequential", [workflows.Item("pen", 1, 100)])
    LocalWorker(wf).run_until_complete(run)
    items = timeline(run.view(), world.list_events(run.id))
    assert [(i.kind, i.title, i.status) for i in items][:2] == [
        ("patch", "charge-first", "applied"),
        ("step", "charge", "completed"),
    ]
