"""Crash points: kill the "process" before or after every World write of a run; redelivery must finish it.

A :class:`FaultyWorld` forwards to an in-memory World and raises :class:`Crash` (a BaseException, like SIGKILL
nothing catches) before or after the n-th mutating call. The delivery being handled is then neither acked nor
retried; the test releases its lease, as lease expiry would. For every n, the run must complete with the right
result, contiguous slots and exactly one terminal event per step.

Time is a :class:`ManualClock` shared by the World and the runtime, moved on only when nothing is due: with the wall
clock, a 20 ms sleep found already due on a loaded machine completed inline, one delivery fewer, and the number of
writes (the parametrization, computed at collection) differed between pytest-xdist's workers, which then refused
to run the suite.
"""

from __future__ import annotations

import time
from collections import Counter
from datetime import datetime, timedelta
from typing import Any

import pytest
from celery import Celery

from celery_workflow import Workflows, create_hook, gather, get_writable, sleep
from celery_workflow.errors import HookNotFound
from celery_workflow.events import EventType
from celery_workflow.ids import utcnow
from celery_workflow.testing import LocalWorker, MemoryWorld

MUTATING = frozenset(
    {"create_run", "append", "enqueue", "ack", "release", "retry_later", "extend", "write_stream", "close_stream"}
)


class Crash(BaseException):
    pass


class ManualClock:
    """Now, as the World and the runtime read it: still until :meth:`advance`."""

    def __init__(self) -> None:
        self.now = utcnow()

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


def memory_world() -> tuple[MemoryWorld, ManualClock]:
    clock = ManualClock()
    return MemoryWorld(clock=clock), clock


class FaultyWorld:
    def __init__(self, inner: MemoryWorld, crash_at: int | None, *, after: bool) -> None:
        self.inner = inner
        self.crash_at = crash_at
        self.after = after
        self.calls = 0
        self.crashed = False
        self.names: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in MUTATING:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.names.append(name)
            hit = self.calls == self.crash_at
            if hit and not self.after:
                self.crashed = True
                raise Crash(f"before {name} #{self.calls}")
            result = attr(*args, **kwargs)
            if hit and self.after:
                self.crashed = True
                raise Crash(f"after {name} #{self.calls}")
            return result

        return call


def build(world: Any, clock: ManualClock) -> tuple[Workflows, Any, Counter[str]]:
    wf = Workflows(Celery("crash"), world=world, broker="app")
    wf.runtime.clock = clock
    executions: Counter[str] = Counter()

    @wf.step
    def reserve(order: str) -> str:
        executions["reserve"] += 1
        return f"r-{order}"

    @wf.step(max_retries=2, retry_backoff=0.0)
    def charge(order: str) -> int:
        executions["charge"] += 1
        if executions["charge"] == 1:
            raise RuntimeError("first charge attempt fails")
        return 100

    @wf.step
    def pack(item: str) -> str:
        executions[f"pack-{item}"] += 1
        get_writable("progress").write(item)
        return item.upper()

    @wf.workflow
    def order_flow(order: str) -> dict[str, Any]:
        r = reserve(order)
        cents = charge(order)
        approved = create_hook(token=f"ok:{order}").wait()
        sleep(0.02)
        packed = gather(pack.start("a"), pack.start("b"))
        return {"r": r, "cents": cents, "approved": approved, "packed": packed}

    return wf, order_flow, executions


def drive(
    wf: Workflows, inner: MemoryWorld, clock: ManualClock, flow: Any, order: str, *, timeout: float = 10.0
) -> Any:
    run = None
    while run is None:
        try:
            run = flow.start(order, run_id=f"run-{order}")
        except Crash:
            continue  # the client retries its start: idempotent by run id
    worker = LocalWorker(wf)
    deadline = time.monotonic() + timeout
    resumed = False
    while not inner.get_run(run.id).status.terminal:
        assert time.monotonic() < deadline, f"run stuck: {[e.event_type for e in inner.list_events(run.id)]}"
        if not resumed:
            try:
                inner.get_hook_by_token(f"ok:{order}")
                wf.runtime.resume_hook(f"ok:{order}", True)
                resumed = True
            except HookNotFound:
                pass
            except Crash:
                continue
        claimed = inner.claim(worker.queues, limit=1, lease=30.0)
        if not claimed:
            clock.advance(0.01)  # nothing due: time moves on (the sleep's 20 ms, a retry's backoff)
            continue
        try:
            worker.handle(claimed[0])
        except Crash:
            inner.release(claimed[0].receipt)  # the lease of a dead worker runs out
    return run


def check(inner: MemoryWorld, run: Any, executions: Counter[str]) -> None:
    view = inner.get_run(run.id)
    assert view.status == "completed", view.error
    assert view.output == {"r": "r-x", "cents": 100, "approved": True, "packed": ["A", "B"]}
    events = inner.list_events(run.id)
    assert [e.slot for e in events] == list(range(1, len(events) + 1))
    terminal = Counter(
        e.correlation_id for e in events if e.event_type in (EventType.STEP_COMPLETED, EventType.STEP_FAILED)
    )
    created = [e.correlation_id for e in events if e.event_type is EventType.STEP_CREATED]
    assert sorted(terminal) == sorted(created)
    assert set(terminal.values()) == {1}, terminal
    assert Counter(e.event_type for e in events)[EventType.RUN_COMPLETED] == 1
    assert executions["charge"] >= 2 and executions["pack-a"] >= 1 and executions["pack-b"] >= 1


def fault_free_writes() -> list[str]:
    inner, clock = memory_world()
    faulty = FaultyWorld(inner, None, after=False)
    wf, flow, executions = build(faulty, clock)
    run = drive(wf, inner, clock, flow, "x")
    check(inner, run, executions)
    return faulty.names


WRITES = fault_free_writes()
TOTAL = len(WRITES)


@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
@pytest.mark.parametrize("crash_at", range(1, TOTAL + 1))
def test_a_crash_at_any_write_loses_nothing(crash_at: int, after: bool) -> None:
    inner, clock = memory_world()
    faulty = FaultyWorld(inner, crash_at, after=after)
    wf, flow, executions = build(faulty, clock)
    run = drive(wf, inner, clock, flow, "x")
    assert faulty.crashed
    check(inner, run, executions)


def test_the_scenario_exercises_every_kind_of_write() -> None:
    assert {"create_run", "append", "ack", "write_stream"} <= set(WRITES)
    assert WRITES.count("append") >= 10  # run start, inline steps, retry, hook, wait, parallel steps, completion
