"""Conformance: child runs on the World under test.

The World's part (:mod:`celery_workflow._backend.children`): an append that ends a run whose ``run_created`` links it
to a parent also writes the parent's ``child_ended`` (the child's outcome) and a wake-up delivery for the parent, a
fresh copy of the one the link holds; on a World with ``linked_appends`` all of it is one transaction. A parent that
has ended takes nothing and the child's end is written all the same; a child that hands over (``continue_as_new``)
wakes nobody. Then the runtime's part end to end, through :class:`~celery_workflow.testing.LocalWorker`: a parent
gathers its children's results, and a parent's cancellation cancels its children.
"""

from __future__ import annotations

import json

from celery import Celery

from celery_workflow.app import Workflows
from celery_workflow.errors import NotFound, RunTerminal
from celery_workflow.event_data import ChildEndedData
from celery_workflow.events import EventType, RunStatus
from celery_workflow.runtime.context import create_hook, gather
from celery_workflow.testing._conformance import DEADLINE, Conformance, create, drain, ev, unique
from celery_workflow.testing.driver import LocalWorker
from celery_workflow.world import DEFAULT_QUEUE, NewRun, World

_ERR = {"type": "Boom", "message": "it broke"}


def _envelope(task_id: str) -> str:
    """A message envelope with the ids a wake-up's copy renews (the World treats the rest as opaque)."""
    return json.dumps(
        {"body": "", "headers": {"id": task_id, "root_id": task_id}, "properties": {"correlation_id": task_id}}
    )


def _child(world: World, parent: str, n: int = 1) -> str:
    """A child of ``parent`` (started), linked as the runtime links one."""
    child_id = f"{parent}!{n}"
    link = {"run_id": parent, "correlation_id": f"child:{n}", "queue": DEFAULT_QUEUE, "wake": _envelope("orig")}
    world.create_run(NewRun(child_id, "child", {"args": [], "kwargs": {}}, parent=link))
    world.append(child_id, [ev(EventType.RUN_STARTED)])
    world.append(parent, [ev(EventType.CHILD_STARTED, f"child:{n}", run_id=child_id, workflow_name="child")])
    return child_id


def _has_hooks(world: World, run_id: str) -> bool:
    try:
        return bool(world.list_hooks(run_id))
    except NotFound:
        return False


class ChildRunConformance(Conformance):
    """A child run's end reaches its parent, durably, on the World under test."""

    def test_a_child_end_writes_the_parent_child_ended_and_a_wake_up(self, world: World) -> None:
        parent = create(world, run_id=unique("parent"), started=True).run_id
        child = _child(world, parent)
        drain(world, DEFAULT_QUEUE)
        world.append(child, [ev(EventType.RUN_COMPLETED, output={"n": 1})])
        ended = [e for e in world.list_events(parent) if e.event_type is EventType.CHILD_ENDED]
        assert [(e.correlation_id, e.data_as(ChildEndedData)) for e in ended] == [
            ("child:1", ChildEndedData(child, "completed", output={"n": 1}))
        ]
        woken = [d for d in drain(world, DEFAULT_QUEUE) if d.run_id == parent]
        assert len(woken) == 1
        envelope = json.loads(woken[0].payload)
        assert envelope["headers"]["id"] != "orig"  # a task of its own, not the link's copy
        assert envelope["headers"]["id"] == envelope["properties"]["correlation_id"]

    def test_a_failed_or_cancelled_child_reports_it(self, world: World) -> None:
        parent = create(world, run_id=unique("parent"), started=True).run_id
        failed, cancelled = _child(world, parent, 1), _child(world, parent, 2)
        world.append(failed, [ev(EventType.RUN_FAILED, error=_ERR)])
        world.append(cancelled, [ev(EventType.RUN_CANCELLED)])
        ended = {
            str(e.correlation_id): e.data_as(ChildEndedData)
            for e in world.list_events(parent)
            if e.event_type is EventType.CHILD_ENDED
        }
        assert ended == {
            "child:1": ChildEndedData(failed, "failed", error=_ERR),
            "child:2": ChildEndedData(cancelled, "cancelled"),
        }

    def test_a_parent_that_ended_takes_nothing_and_the_child_still_ends(self, world: World) -> None:
        parent = create(world, run_id=unique("parent"), started=True).run_id
        child = _child(world, parent)
        world.append(parent, [ev(EventType.RUN_CANCELLED)])
        drain(world, DEFAULT_QUEUE)
        count = world.get_run(parent).event_count
        assert world.append(child, [ev(EventType.RUN_FAILED, error=_ERR)]).run.status is RunStatus.FAILED
        assert world.get_run(parent).event_count == count
        assert [d for d in drain(world, DEFAULT_QUEUE) if d.run_id == parent] == []

    def test_a_child_that_hands_over_wakes_nobody(self, world: World) -> None:
        parent = create(world, run_id=unique("parent"), started=True).run_id
        child = _child(world, parent)
        world.append(child, [ev(EventType.RUN_COMPLETED, output=None, continued_as=f"{child}~1")])
        assert EventType.CHILD_ENDED not in [e.event_type for e in world.list_events(parent)]

    def test_a_run_without_a_parent_ends_alone(self, world: World) -> None:
        run = create(world, run_id=unique("alone"), started=True).run_id
        assert world.append(run, [ev(EventType.RUN_COMPLETED, output=1)]).run.status is RunStatus.COMPLETED

    def test_child_events_need_a_live_parent(self, world: World) -> None:
        parent = create(world, run_id=unique("parent"), started=True).run_id
        world.append(parent, [ev(EventType.RUN_COMPLETED, output=None)])
        try:
            world.append(parent, [ev(EventType.CHILD_STARTED, "child:1", run_id="x", workflow_name="child")])
        except RunTerminal:
            pass
        else:
            raise AssertionError("a child_started on an ended run was accepted")

    def test_a_parent_gathers_its_children_and_its_cancellation_cancels_them(self, world: World) -> None:
        wf = Workflows(Celery("children-conformance"), world=world, broker="app")

        @wf.workflow(name="conformance.child")
        def child(n: int) -> int:
            if n < 0:
                create_hook(token=f"hold:{-n}").wait()
            return n * 10

        @wf.workflow(name="conformance.parent")
        def parent(n: int) -> int:
            return sum(gather(*[child.start(i) for i in range(n)]))

        @wf.workflow(name="conformance.holder")
        def holder(token: int) -> int:
            return int(child.start(-token).result())

        worker = LocalWorker(wf)
        run = parent.start(12, run_id=unique("fan"))
        worker.run_until_complete(run, DEADLINE)
        assert run.result() == sum(i * 10 for i in range(12))
        token = abs(hash(run.id)) % 1_000_000 + 1
        held = holder.start(token, run_id=unique("holder"))
        worker.run_until(lambda: _has_hooks(world, f"{held.id}!1"), DEADLINE)
        held.cancel()
        assert world.get_run(f"{held.id}!1").status is RunStatus.CANCELLED
