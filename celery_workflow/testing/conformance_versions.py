"""Conformance: versioned workflow code (``patched()``) on the World under test.

A run recorded by the old code of a workflow is continued by a worker running the new code, which guards its change
with ``patched("<change-id>")``: the old run keeps its old path (``patched`` is False for it, nothing is recorded),
a run started on the new code takes the new path and records ``patch_applied``, which every later delivery of that
run reads back. Both code versions run in this process (two :class:`~celery_workflow.Workflows` on the one World,
registering the same workflow and step names, as two deployments would), through
:class:`~celery_workflow.testing.LocalWorker`.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from celery import Celery

from celery_workflow.app import Workflow, Workflows
from celery_workflow.events import EventType
from celery_workflow.runtime.context import create_hook, patched
from celery_workflow.testing._conformance import DEADLINE, Conformance, unique
from celery_workflow.testing.driver import LocalWorker
from celery_workflow.world import World

CHANGE = "audit-first"


@dataclass
class Versions:
    old: Workflows
    new: Workflows
    old_order: Workflow[[str], list[str]]
    new_order: Workflow[[str], list[str]]


def _deploy(world: World, *, guarded: bool) -> tuple[Workflows, Workflow[[str], list[str]]]:
    wf = Workflows(Celery("versions-new" if guarded else "versions-old"), world=world, broker="app")

    @wf.step
    def audit(order_id: str) -> str:
        return f"audited {order_id}"

    @wf.step
    def ship(order_id: str) -> str:
        return f"shipped {order_id}"

    if guarded:

        @wf.workflow(name="versions.order")
        def order(order_id: str) -> list[str]:
            done = [audit(order_id)] if patched(CHANGE) else []  # the change: audit before anything else
            done.append(create_hook(token=f"go:{order_id}").wait())
            done.append(ship(order_id))
            assert patched(CHANGE) == (len(done) == 3)  # asked again, the same answer
            return done

        return wf, order

    @wf.workflow(name="versions.order")
    def old_order(order_id: str) -> list[str]:
        done = [create_hook(token=f"go:{order_id}").wait()]
        done.append(ship(order_id))
        return done

    return wf, old_order


class VersioningConformance(Conformance):
    """``patched()`` decides per run, durably, on the World under test."""

    @pytest.fixture
    def versions(self, world: World) -> Versions:
        old, old_order = _deploy(world, guarded=False)
        new, new_order = _deploy(world, guarded=True)
        return Versions(old, new, old_order, new_order)

    def test_a_run_recorded_by_the_old_code_keeps_the_old_path(self, world: World, versions: Versions) -> None:
        oid = unique("old")
        run = versions.old_order.start(oid)
        LocalWorker(versions.old).run_until(lambda: world.list_hooks(run.id) != [], DEADLINE)
        # the new code is deployed: it replays the old run (at rest on its hook) and carries it on
        versions.new.resume_hook(f"go:{oid}", "approved")
        view = LocalWorker(versions.new).run_until_complete(run, DEADLINE)
        assert view.status == "completed", view.error
        assert run.result(timeout=0) == ["approved", f"shipped {oid}"]
        kinds = [e.event_type for e in world.list_events(run.id)]
        assert EventType.PATCH_APPLIED not in kinds
        assert [s.step_name for s in world.list_steps(run.id)] == ["ship"]

    def test_a_run_started_on_the_new_code_takes_the_new_path_and_records_it(
        self, world: World, versions: Versions
    ) -> None:
        oid = unique("new")
        run = versions.new_order.start(oid)
        worker = LocalWorker(versions.new)
        worker.run_until(lambda: world.list_hooks(run.id) != [], DEADLINE)
        markers = [e for e in world.list_events(run.id) if e.event_type is EventType.PATCH_APPLIED]
        assert [(m.correlation_id, m.data) for m in markers] == [(f"patch:{CHANGE}", {"change_id": CHANGE})]
        versions.new.resume_hook(f"go:{oid}", "approved")
        view = worker.run_until_complete(run, DEADLINE)
        assert view.status == "completed", view.error
        assert run.result(timeout=0) == [f"audited {oid}", "approved", f"shipped {oid}"]
        kinds = [e.event_type for e in world.list_events(run.id)]
        assert kinds.count(EventType.PATCH_APPLIED) == 1  # read back by the later delivery, not recorded again
        assert [s.step_name for s in world.list_steps(run.id)] == ["audit", "ship"]
