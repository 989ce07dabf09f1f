"""A new run's first quick inline step starts unwritten: its creation and start ride with the delivery's next write,
beside the run's start, and nothing else changes (the owner rule, redeliveries, slow steps, failures, a run that
moved meanwhile)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from celery_workflow import RunCancelled, Workflows
from celery_workflow.events import EventType, NewEvent, RunStatus
from celery_workflow.runtime import effects
from celery_workflow.testing import LocalWorker, MemoryWorld
from celery_workflow.world import Claim


def _appends(wf: Workflows) -> list[list[EventType]]:
    """The event types of each append the World receives from now on."""
    appends: list[list[EventType]] = []
    original = wf.world.append

    def counting(*args: Any, **kwargs: Any) -> Any:
        appends.append([ev.event_type for ev in args[1]])
        return original(*args, **kwargs)

    wf.world.append = counting  # type: ignore[method-assign]
    return appends


def _flows(wf: Workflows, during: Callable[[list[int]], object] | None = None) -> tuple[Any, Any, list[int]]:
    """A one-step and a two-step workflow over one step, which records its calls and then calls ``during``."""
    calls: list[int] = []

    @wf.step
    def bump(i: int) -> int:
        calls.append(i)
        if during is not None:
            during(calls)
        if i < 0:
            raise ValueError("negative")
        return i + 1

    @wf.workflow
    def once(i: int) -> int:
        return bump(i)

    @wf.workflow
    def twice(i: int) -> int:
        return bump(bump(i))

    return once, twice, calls


def _first(wf: Workflows, run_id: str) -> tuple[bytes, Claim]:
    (claimed,) = wf.world.claim([wf.runtime.default_queue], limit=1, lease=30)
    assert claimed.run_id == run_id
    return claimed.payload, Claim(claimed.receipt, claimed.attempts)


ONE_WRITE = [
    EventType.RUN_STARTED,
    EventType.STEP_CREATED,
    EventType.STEP_STARTED,
    EventType.STEP_COMPLETED,
    EventType.RUN_COMPLETED,
]
TWO_WRITES = [
    [EventType.RUN_STARTED, EventType.STEP_CREATED, EventType.STEP_STARTED],
    [EventType.STEP_COMPLETED, EventType.RUN_COMPLETED],
]


def test_a_known_quick_first_step_starts_with_the_runs_end(wf: Workflows, worker: LocalWorker) -> None:
    once, _, calls = _flows(wf)
    appends = _appends(wf)
    first = once.start(1)
    worker.run_until_complete(first)
    assert appends == TWO_WRITES  # a step this process has not run yet is started in the World first
    assert wf.runtime.inline_seconds["bump"] < effects.HOLD_START_BELOW
    appends.clear()
    second = once.start(2)
    worker.run_until_complete(second)
    assert appends == [ONE_WRITE] and second.result() == 3 and calls == [1, 2]
    started = [e for e in second.events() if e.event_type is EventType.STEP_STARTED]
    assert [e.data["attempt"] for e in started] == [1]
    assert started[0].data["owner"]  # the delivery that ran it, as when the start is written on its own
    steps = wf.world.list_steps(second.id)
    assert [(s.status.value, s.attempt) for s in steps] == [("completed", 1)]


def test_only_the_first_step_is_held(wf: Workflows, worker: LocalWorker) -> None:
    _, twice, _ = _flows(wf)
    worker.run_until_complete(twice.start(0))
    appends = _appends(wf)
    run = twice.start(1)
    worker.run_until_complete(run)
    assert run.result() == 3
    assert appends == [
        [
            EventType.RUN_STARTED,
            EventType.STEP_CREATED,
            EventType.STEP_STARTED,
            EventType.STEP_COMPLETED,
            EventType.STEP_CREATED,
            EventType.STEP_STARTED,
        ],
        [EventType.STEP_COMPLETED, EventType.RUN_COMPLETED],
    ]


def test_a_slow_step_is_started_in_the_world_first(wf: Workflows, worker: LocalWorker) -> None:
    once, _, _ = _flows(wf)
    worker.run_until_complete(once.start(1))
    wf.runtime.inline_seconds["bump"] = effects.HOLD_START_BELOW  # as if its last run took that long
    appends = _appends(wf)
    worker.run_until_complete(once.start(2))
    assert appends == TWO_WRITES


def test_every_write_durable_holds_nothing() -> None:
    wf = Workflows(Celery("unit"), world=MemoryWorld(), broker="app", durability="step")
    try:
        once, _, _ = _flows(wf)
        worker = LocalWorker(wf)
        worker.run_until_complete(once.start(1))
        appends = _appends(wf)
        worker.run_until_complete(once.start(2))
        assert appends == [TWO_WRITES[0], [EventType.STEP_COMPLETED], [EventType.RUN_COMPLETED]]
    finally:
        wf.close()


def test_a_redelivered_first_delivery_runs_nothing_again(wf: Workflows, worker: LocalWorker) -> None:
    """The first delivery completed the run, but its ack was lost: the same message comes again. It reads the run,
    finds it ended, and runs no step."""
    once, _, calls = _flows(wf)
    worker.run_until_complete(once.start(1))
    run = once.start(2)
    payload, claim = _first(wf, run.id)
    assert wf.handle_delivery(payload) == "completed"  # without a claim: the delivery stays queued
    assert calls == [1, 2]
    for again in (Claim(claim.receipt, claim.attempts + 1), None):
        assert wf.handle_delivery(payload, again) == "ended"
    assert calls == [1, 2] and run.result() == 3


def test_a_held_step_that_fails_writes_the_start_first(wf: Workflows, worker: LocalWorker) -> None:
    once, _, calls = _flows(wf)
    worker.run_until_complete(once.start(1))
    appends = _appends(wf)
    run = once.start(-1)
    worker.run_until_idle()
    assert calls[:2] == [1, -1]
    assert appends[0] == [EventType.RUN_STARTED, EventType.STEP_CREATED, EventType.STEP_STARTED]
    assert appends[1] == [EventType.STEP_RETRYING]
    assert wf.world.get_run(run.id).status is RunStatus.RUNNING


def test_a_run_cancelled_during_a_held_step_stays_cancelled(wf: Workflows) -> None:
    """The held write is refused (the run ended under it): the step's result is not recorded on its own, since its
    start never was, and the delivery ends quietly."""
    target: dict[str, str] = {}
    once, _, calls = _flows(wf, lambda calls: len(calls) > 1 and wf.cancel(target["run"], "while it ran"))
    LocalWorker(wf).run_until_complete(once.start(1))
    run = once.start(2)
    target["run"] = run.id
    payload, claim = _first(wf, run.id)
    assert wf.handle_delivery(payload, claim) == "ended"
    assert calls == [1, 2]
    with pytest.raises(RunCancelled):
        run.result()
    assert [e.event_type for e in run.events()] == [EventType.RUN_CREATED, EventType.RUN_CANCELLED]


def test_a_log_moved_under_a_held_step_replays_without_recording_its_result(wf: Workflows) -> None:
    """Another writer moved the run's log while the held step ran (nothing in the library does this to a pending
    run; an operator's tool might): the held write is refused, the step's result is not recorded on its own (its
    start never was), and the replay starts over on the log as it is."""
    target: dict[str, str] = {}
    once, _, calls = _flows(
        wf, lambda calls: len(calls) == 2 and wf.world.append(target["run"], [NewEvent(EventType.RUN_STARTED)])
    )
    LocalWorker(wf).run_until_complete(once.start(1))
    run = once.start(2)
    target["run"] = run.id
    _, claim = _first(wf, run.id)
    assert wf.runtime.handle_workflow(run.id, delivery_id="d", claim=claim) == "completed"
    assert calls == [1, 2, 2] and run.result() == 3
    assert [e.event_type for e in run.events()][1:] == [
        EventType.RUN_STARTED,
        EventType.STEP_CREATED,
        EventType.STEP_STARTED,
        EventType.STEP_COMPLETED,
        EventType.RUN_COMPLETED,
    ]
