"""A new run's first delivery carries the run's opening: the worker replays without reading, and nothing goes wrong
when the run moved before the delivery came."""

from __future__ import annotations

import json
from typing import Any

import pytest

from celery_workflow import RunCancelled, Workflows
from celery_workflow.app import decode_message
from celery_workflow.events import RunStatus
from celery_workflow.runtime import opening
from celery_workflow.testing import LocalWorker


def _reads(wf: Workflows) -> list[str]:
    reads: list[str] = []
    read = wf.world.get_run_with_events

    def counting(run_id: str) -> Any:
        reads.append(run_id)
        return read(run_id)

    wf.world.get_run_with_events = counting  # type: ignore[method-assign]
    return reads


def _flows(wf: Workflows) -> tuple[Any, list[int]]:
    calls: list[int] = []

    @wf.step
    def bump(i: int) -> int:
        calls.append(i)
        return i + 1

    @wf.workflow
    def once(i: int, padding: str = "") -> int:
        return bump(i)

    return once, calls


def _first_message(wf: Workflows, run_id: str) -> bytes:
    (claimed,) = wf.world.claim([wf.runtime.default_queue], limit=1, lease=30)
    assert claimed.run_id == run_id
    return claimed.payload


def test_the_first_delivery_replays_from_its_opening_without_a_read(wf: Workflows, worker: LocalWorker) -> None:
    once, calls = _flows(wf)
    reads = _reads(wf)
    run = once.start(1)
    worker.run_until_complete(run)
    assert run.result() == 2 and calls == [1]
    assert reads == []  # the run completed in its first delivery, which read nothing
    second = once.start(5)
    message = json.loads(_first_message(wf, second.id))
    assert message["headers"][opening.HEADER]["data"] == {
        "workflow_name": once.name,
        "input": {"args": [5], "kwargs": {}},
        "queue": wf.runtime.default_queue,
    }


def test_a_run_cancelled_before_its_first_delivery_is_read_and_left_alone(wf: Workflows) -> None:
    once, calls = _flows(wf)
    reads = _reads(wf)
    run = once.start(1)
    run.cancel("changed my mind")
    payload = _first_message(wf, run.id)
    assert wf.handle_delivery(payload) == "ended"  # the opening's first write was refused; the log says cancelled
    assert calls == [] and reads == [run.id]
    with pytest.raises(RunCancelled):
        run.result()


def test_a_duplicate_first_delivery_finds_the_run_moved_on(wf: Workflows) -> None:
    once, calls = _flows(wf)
    run = once.start(1)
    payload = _first_message(wf, run.id)
    assert wf.handle_delivery(payload) == "completed"
    assert wf.handle_delivery(payload) == "ended"  # the same message again: the opening is stale, the log is read
    assert calls == [1] and run.result() == 2


def test_a_run_deleted_before_its_first_delivery_drops_it(wf: Workflows, monkeypatch: pytest.MonkeyPatch) -> None:
    once, calls = _flows(wf)
    run = once.start(1)
    payload = _first_message(wf, run.id)
    world: Any = wf.world
    world._runs.pop(run.id)  # as retention would
    assert wf.handle_delivery(payload) == "missing"
    assert calls == []


def test_large_inputs_and_bad_openings_are_read_from_the_world(wf: Workflows) -> None:
    once, calls = _flows(wf)
    reads = _reads(wf)
    big = once.start(1, padding="x" * opening.LIMIT)
    payload = _first_message(wf, big.id)
    assert decode_message(payload).opening is None
    assert wf.handle_delivery(payload) == "completed" and reads == [big.id]
    for bad in (
        {"data": "nope"},
        {"data": {"input": 1}},
        {"at": "never", "data": {"workflow_name": "x", "input": 1}},
        7,
    ):
        assert opening.opened("r", bad) is None
    run = once.start(2)
    assert wf.runtime.handle_workflow(run.id, delivery_id="d", opening={"data": [], "at": 3}) == "completed"
    assert wf.world.get_run(run.id).status is RunStatus.COMPLETED and calls == [1, 2]
