"""``continue_as_new``: a run hands over to a successor with a fresh log, so long loops replay in bounded time."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from celery_workflow import (
    RunCancelled,
    RunStatus,
    WorkflowFailed,
    Workflows,
    continue_as_new,
)
from celery_workflow.errors import NotFound
from celery_workflow.events import Event, EventType
from celery_workflow.rpc import GetRunParams, Methods
from celery_workflow.runtime import continuation
from celery_workflow.runtime.context import NotInWorkflow
from celery_workflow.runtime.continuation import successor_id
from celery_workflow.testing import History, LocalWorker, replay_history
from celery_workflow.world import NewRun


@dataclasses.dataclass
class Tally:
    count: int
    total: int


def _loop(wf: Workflows, *, chunk: int | None) -> Any:
    """A workflow looping ``n`` times over a queued step (one delivery per iteration), handing over every ``chunk``
    iterations when ``chunk`` is set."""

    @wf.step(queue="elsewhere")
    def tick(i: int) -> int:
        return i

    @wf.workflow
    def loop(n: int, state: Tally) -> Tally:
        for i in range(state.count, n):
            state = Tally(i + 1, state.total + tick(i))
            if chunk is not None and state.count % chunk == 0 and state.count < n:
                continue_as_new(n, state)
        return state

    return loop


def _events_per_delivery(wf: Workflows) -> list[int]:
    """Record how many events each workflow delivery loads (its replay reads and re-runs all of them)."""
    loaded: list[int] = []
    world = wf.world
    read = world.get_run_with_events

    def counting(run_id: str) -> tuple[Any, list[Event]]:
        run, events = read(run_id)
        loaded.append(len(events))
        return run, events

    world.get_run_with_events = counting  # type: ignore[method-assign]
    return loaded


def test_a_run_hands_over_and_result_follows_the_chain(wf: Workflows) -> None:
    loop = _loop(wf, chunk=4)
    worker = LocalWorker(wf)  # after the workflow: it serves the queues declared so far
    run = loop.start(10, Tally(0, 0), run_id="counter")
    worker.run_until(lambda: _last_of_chain(wf, "counter").status.terminal, timeout=30)
    assert run.result() == Tally(10, 45)
    assert run.status is RunStatus.COMPLETED
    assert run.result(follow=False) is None
    assert run.continued_as == "counter~1"

    first = wf.world.list_events("counter")
    end = first[-1]
    assert end.event_type is EventType.RUN_COMPLETED
    assert end.data["continued_as"] == "counter~1"
    assert end.data["continued_with"] == {"args": [10, {"count": 4, "total": 6}], "kwargs": {}}
    second = wf.world.list_events("counter~1")
    assert second[0].data["continues"] == "counter"
    assert second[0].data["input"] == end.data["continued_with"]
    last = wf.world.get_run("counter~2")
    assert last.status is RunStatus.COMPLETED and last.output == {"count": 10, "total": 45}
    with pytest.raises(NotFound):
        wf.world.get_run("counter~3")
    # the RPC answer names the successor too, so HTTP clients follow the chain
    answer = Methods(wf).get_run(GetRunParams(run_id="counter"))
    assert answer["run"]["continued_as"] == "counter~1"
    assert "continued_as" not in Methods(wf).get_run(GetRunParams(run_id="counter~2"))["run"]


def _last_of_chain(wf: Workflows, run_id: str) -> Any:
    view = wf.world.get_run(run_id)
    while (succ := continuation.continued_as(wf.world, view)) is not None:
        view = wf.world.get_run(succ)
    return view


@pytest.mark.parametrize("chunk", [None, 10])
def test_replay_cost_per_delivery_does_not_grow_with_the_length_of_a_loop_that_hands_over(
    wf: Workflows, chunk: int | None
) -> None:
    """The events one delivery replays, measured at the end of a 30- and a 120-iteration loop: bounded by the chunk
    with continue_as_new; growing with the loop without it (the contrast shows the measure can fail)."""
    loop = _loop(wf, chunk=chunk)
    loaded = _events_per_delivery(wf)
    worker = LocalWorker(wf)
    peaks = []
    for n in (30, 120):
        loaded.clear()
        run = loop.start(n, Tally(0, 0))
        worker.run_until(lambda run=run: _last_of_chain(wf, run.id).status.terminal, timeout=60)
        assert run.result() == Tally(n, n * (n - 1) // 2)
        peaks.append(max(loaded))
    if chunk is None:
        assert peaks[1] > 3 * peaks[0]  # one run's log: every delivery replays everything before it
    else:
        assert peaks[0] == peaks[1] <= 4 * chunk + 6  # run_created/started, 4 events per iteration, the hand-over


def test_a_failure_in_a_successor_names_that_run(wf: Workflows, worker: LocalWorker) -> None:
    @wf.workflow
    def countdown(n: int) -> int:
        if n == 0:
            raise ValueError("boom at zero")
        continue_as_new(n - 1)

    run = countdown.start(2, run_id="cd")
    worker.run_until(lambda: _last_of_chain(wf, "cd").status.terminal, timeout=30)
    with pytest.raises(WorkflowFailed) as failed:
        run.result()
    assert failed.value.run_id == "cd~2"


def test_continue_as_new_outside_a_workflow_is_refused(wf: Workflows, worker: LocalWorker) -> None:
    with pytest.raises(NotInWorkflow):
        continue_as_new(1)

    @wf.step(max_retries=0)
    def inside() -> None:
        continue_as_new()

    @wf.workflow
    def calls_it_in_a_step() -> None:
        inside()

    run = calls_it_in_a_step.start()
    worker.run_until_complete(run)
    with pytest.raises(WorkflowFailed) as failed:
        run.result()
    assert "NotInWorkflow" in str(failed.value)


def test_a_crash_between_the_two_writes_hands_over_once(wf: Workflows, worker: LocalWorker) -> None:
    @wf.workflow
    def twice(n: int) -> int:
        if n < 2:
            continue_as_new(n + 1)
        return n

    world = wf.world
    append = world.append
    crashed: list[str] = []

    def crash_once(run_id: str, events: Any, **kw: Any) -> Any:
        if not crashed and any(e.event_type is EventType.RUN_COMPLETED for e in events):
            crashed.append(run_id)
            raise OSError("the worker died here")
        return append(run_id, events, **kw)

    world.append = crash_once  # type: ignore[method-assign]
    run = twice.start(0, run_id="tw")
    worker.run_until(lambda: _last_of_chain(wf, "tw").status.terminal, timeout=30)
    assert crashed == ["tw"]
    assert run.result() == 2
    assert {r.run_id for r in world.list_runs(limit=10).items} == {"tw", "tw~1", "tw~2"}


def test_a_successor_waits_for_its_predecessor_and_cancels_itself_when_orphaned(wf: Workflows) -> None:
    @wf.workflow
    def parked(n: int) -> int:
        return n

    world, runtime = wf.world, wf.runtime
    pred = parked.start(1, run_id="p")
    succ = "p~1"
    world.create_run(NewRun(succ, parked.name, {"args": [2], "kwargs": {}}, continues="p"))
    # the predecessor has not ended: the successor's check waits and checks again later
    assert runtime.handle_workflow(succ, delivery_id="check-1") == "waiting"
    assert world.get_run(succ).status is RunStatus.PENDING
    # the predecessor ends without handing over (cancelled): the successor cancels itself, naming why
    pred.cancel("stop")
    assert runtime.handle_workflow(succ, delivery_id="check-2") == "ended"
    view = world.get_run(succ)
    assert view.status is RunStatus.CANCELLED
    with pytest.raises(RunCancelled):
        pred.result()


def test_a_successor_id_taken_by_other_arguments_is_superseded(wf: Workflows, worker: LocalWorker) -> None:
    @wf.workflow
    def step_up(n: int) -> int:
        if n < 1:
            continue_as_new(n + 1)
        return n * 10

    world = wf.world
    # an earlier attempt created ~1 with other arguments and never completed its predecessor
    world.create_run(NewRun("s~1", step_up.name, {"args": [7], "kwargs": {}}, continues="s"))
    run = step_up.start(0, run_id="s")
    worker.run_until(lambda: _last_of_chain(wf, "s").status.terminal, timeout=30)
    assert run.continued_as == "s~2"
    assert run.result() == 10
    assert world.get_run("s~1").status is RunStatus.CANCELLED


def test_successor_ids_stay_bounded_along_a_chain() -> None:
    assert successor_id("order-1") == "order-1~1"
    assert successor_id("order-1~1") == "order-1~2"
    assert successor_id("order-1~9", skip=2) == "order-1~12"
    long = "x" * 200
    first = successor_id(long)
    assert len(first) <= 200 and first.endswith("~1")
    chain = first
    for _ in range(50):
        chain = successor_id(chain)
    assert chain == first[: -len("~1")] + "~51"


def test_a_recorded_hand_over_replays_as_a_hand_over(wf: Workflows, worker: LocalWorker) -> None:
    @wf.workflow
    def again(n: int) -> int:
        if n < 1:
            continue_as_new(n + 1)
        return n

    run = again.start(0, run_id="h")
    worker.run_until(lambda: _last_of_chain(wf, "h").status.terminal, timeout=30)
    result = replay_history(wf, History.from_world(wf.world, run.id))
    assert result.status == "continued"
    assert result.output == {"args": [1], "kwargs": {}}
