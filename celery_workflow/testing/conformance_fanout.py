"""Conformance: fan-outs wider than one append, and the World's declared append limits.

A World declares what one append may carry (``append_limits``, :class:`~celery_workflow.world.AppendLimits`); the
runtime splits what one delivery writes into appends within them (:mod:`celery_workflow.runtime.batches`). The
suite checks both sides on the World under test:

* a workflow gathering more parallel steps than one append holds (three appends' worth on a World with limits, 120
  steps on one without) completes, each step created once, in the order the code started them, and run once;
* a World error between two appends of one fan-out is recovered by the delivery's retry, which makes only the
  steps not written yet (on a World with limits);
* batches packed within the declared limits are accepted as they are: step creations with large inputs and their
  deliveries, hooks and waits, the ack on the last; then a run's end that must delete more hooks and waits than one
  DynamoDB transaction could (a World's own cleanup is not the runtime's to split).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from celery import Celery

from celery_workflow.app import Workflows
from celery_workflow.errors import HookNotFound
from celery_workflow.event_data import HookCreatedData
from celery_workflow.events import EventType, NewEvent, RunStatus
from celery_workflow.runtime import batches
from celery_workflow.runtime.context import gather
from celery_workflow.testing._conformance import (
    DEADLINE,
    Conformance,
    claim_one,
    create,
    drain,
    ev,
    hook_created,
    step_created,
    unique,
)
from celery_workflow.testing.driver import LocalWorker
from celery_workflow.testing.faults import Faults
from celery_workflow.world import DEFAULT_QUEUE, AppendLimits, Delivery, World, append_limits

#: The fan-out on a World without append limits (it writes the whole fan-out in one append).
UNLIMITED_WIDTH = 120
#: The size of a step delivery's message in the model batch (a Celery message envelope is about this long).
MESSAGE_BYTES = 1500


def fan_out_width(world: World, appends: int = 3) -> int:
    """The fewest parallel steps whose creation the runtime splits into at least ``appends`` appends on ``world``
    (:data:`UNLIMITED_WIDTH` on a World without limits)."""
    limits = append_limits(world)
    if limits.unlimited:
        return UNLIMITED_WIDTH
    n = 1
    while len(batches.split(*_model_fan_out(n), limits)) < appends:
        n += 1
    return n


def _model_fan_out(n: int) -> tuple[list[NewEvent], list[Delivery]]:
    events = [step_created(f"step:square:{i}", "square", [i]) for i in range(1, n + 1)]
    deliveries = [
        Delivery(DEFAULT_QUEUE, b"m" * MESSAGE_BYTES, "r", idempotency_key=batches.step_key(f"step:square:{i}"))
        for i in range(1, n + 1)
    ]
    return events, deliveries


class _Appends:
    """Every append the World under test is asked for (an instance attribute over its own method, restored after)."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.batches: list[tuple[list[NewEvent], list[Delivery]]] = []
        self._lock = threading.Lock()
        self._own = vars(world).get("append")
        original = world.append

        def append(run_id: str, events: Sequence[NewEvent], *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.batches.append((list(events), list(kwargs.get("deliveries", ()))))
            return original(run_id, events, *args, **kwargs)

        setattr(world, "append", append)  # noqa: B010 - an instance attribute over the World's method

    def restore(self) -> None:
        if self._own is None:
            delattr(self.world, "append")
        else:
            setattr(self.world, "append", self._own)  # noqa: B010


class _Flows:
    def __init__(self, world: World) -> None:
        self.wf = Workflows(Celery("fanout"), world=world, broker="app")
        self.ran: Counter[int] = Counter()
        ran, lock = self.ran, threading.Lock()

        @self.wf.step
        def square(i: int) -> int:
            with lock:
                ran[i] += 1
            return i * i

        @self.wf.workflow
        def fan(n: int) -> int:
            return sum(gather(*[square.start(i) for i in range(1, n + 1)]))

        self.fan = fan
        self.worker = LocalWorker(self.wf, backoff=lambda attempts: 0.05)

    def settle(self, run_id: str, faults: Faults | None = None, timeout: float = 6 * DEADLINE) -> None:
        """Handle deliveries until the run has ended."""
        deadline = time.monotonic() + timeout
        while True:
            if faults is not None:
                with faults.off():
                    view = self.wf.world.get_run(run_id)
            else:
                view = self.wf.world.get_run(run_id)
            if view.status.terminal:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"run {run_id} still {view.status.value} after {timeout} s")
            if not self.worker.run_once():
                time.sleep(0.01)


def _creates_steps(run_id: str, events: Sequence[NewEvent], *args: Any, **kwargs: Any) -> bool:
    return any(e.event_type is EventType.STEP_CREATED for e in events)


def _check_fan_out(world: World, run_id: str, n: int, ran: Counter[int]) -> None:
    view = world.get_run(run_id)
    assert view.status is RunStatus.COMPLETED, (view.status, view.error)
    assert view.output == sum(i * i for i in range(1, n + 1))
    log = world.list_events(run_id)
    assert [e.slot for e in log] == list(range(1, len(log) + 1))
    created = [str(e.correlation_id) for e in log if e.event_type is EventType.STEP_CREATED]
    assert created == [f"step:square:{i}" for i in range(1, n + 1)]  # once each, in the order the code made them
    completed = Counter(str(e.correlation_id) for e in log if e.event_type is EventType.STEP_COMPLETED)
    assert set(completed) == set(created) and set(completed.values()) == {1}
    assert sorted(ran) == list(range(1, n + 1)) and set(ran.values()) == {1}


class FanOutConformance(Conformance):
    """Fan-outs wider than one append, and the World's declared append limits."""

    @pytest.fixture
    def flows(self, world: World) -> Iterator[_Flows]:
        flows = _Flows(world)
        try:
            yield flows
        finally:
            flows.wf.close()

    def test_a_fan_out_wider_than_one_append_completes(self, world: World, flows: _Flows) -> None:
        n = fan_out_width(world)
        limits = append_limits(world)
        appends = _Appends(world)
        try:
            run = flows.fan.start(n)
            flows.settle(run.id)
        finally:
            appends.restore()
        _check_fan_out(world, run.id, n, flows.ran)
        creating = [b for b in appends.batches if any(e.event_type is EventType.STEP_CREATED for e in b[0])]
        assert len(creating) >= (1 if limits.unlimited else 3)
        assert appends.batches[0][0][0].event_type is EventType.RUN_STARTED  # the run's start in its first append
        for events, deliveries in appends.batches:
            assert limits.fits(*limits.cost(events, deliveries)), "an append over the World's declared limits"

    def test_a_world_error_between_the_appends_of_a_fan_out_is_recovered(self, world: World, flows: _Flows) -> None:
        if append_limits(world).unlimited:
            pytest.skip(f"{type(world).__name__} declares no append limits: a fan-out is one append")
        n = fan_out_width(world, appends=2)
        faults = Faults(world)
        try:
            faults.fail("append", call=2, when=_creates_steps)  # the fan-out's second append: the first is written
            run = flows.fan.start(n)
            flows.settle(run.id, faults)
            assert faults.fired == [("append", 2)], "the fault never fired: the test would prove nothing"
        finally:
            faults.restore()
        _check_fan_out(world, run.id, n, flows.ran)
        assert flows.worker.failures, "the delivery that met the error was not retried"

    def test_appends_packed_within_the_declared_limits_are_accepted(self, world: World) -> None:
        limits = append_limits(world)
        if limits.unlimited:
            pytest.skip(f"{type(world).__name__} declares no append limits")
        first = unique("first")
        run = create(world, deliveries=(Delivery(first, b"start", idempotency_key="wake"),))
        claimed = claim_one(world, first)
        assert claimed is not None
        queue = unique("fan")
        steps = _wide(limits, lambda k: _step_unit(world, run.run_id, queue, k))
        hooks = [hook_created(f"hook:{k}", unique("tok")) for k in range(1, 41)]
        waits = [ev(EventType.WAIT_CREATED, f"wait:{k}", resume_at="2999-01-01T00:00:00+00:00") for k in range(1, 41)]
        events = [ev(EventType.RUN_STARTED), *[e for e, _ in steps], *hooks, *waits]
        deliveries = [d for _, d in steps] + [Delivery(queue, b"wake", run.run_id, idempotency_key="wake")]
        chunks = batches.split(events, deliveries, limits)
        assert len(chunks) >= 2
        written = batches.append_split(
            world,
            run.run_id,
            events,
            deliveries,
            expected_count=1,
            ack=claimed.receipt,
            durable=False,
            last_durable=True,
        )
        assert [e.slot for e in written] == list(range(2, len(events) + 2))
        assert [(e.event_type, e.correlation_id) for e in written] == [(e.event_type, e.correlation_id) for e in events]
        world.release(claimed.receipt)  # acked with the last append: a stale receipt changes nothing
        assert claim_one(world, first) is None
        payloads = sorted(bytes(c.payload)[:40] for c in drain(world, queue))
        wanted = sorted([_message(str(e.correlation_id))[:40] for e, _ in steps] + [b"wake"])
        assert payloads == wanted  # every step's delivery, once
        assert len(world.list_hooks(run.run_id)) == 40 and len(world.list_waits(run.run_id)) == 40
        # a run's end deletes every hook, token and wait the run has, more than one DynamoDB transaction holds
        ended = world.append(run.run_id, [ev(EventType.RUN_CANCELLED)]).run
        assert ended.status is RunStatus.CANCELLED
        assert world.list_hooks(run.run_id) == [] and world.list_waits(run.run_id) == []
        for hook in hooks:
            with pytest.raises(HookNotFound):
                world.get_hook_by_token(hook.data_as(HookCreatedData).token)


def _wide(limits: AppendLimits, unit: Callable[[int], tuple[NewEvent, Delivery]]) -> list[tuple[NewEvent, Delivery]]:
    """Units (a step's creation and its delivery) until they fill two appends by the declared limits."""
    out = [unit(1)]
    while len(batches.split([e for e, _ in out], [d for _, d in out], limits)) < 2:
        out.append(unit(len(out) + 1))
    return out


def _message(step_id: str) -> bytes:
    return f"{step_id}|".encode() + b"m" * MESSAGE_BYTES


def _step_unit(world: World, run_id: str, queue: str, k: int) -> tuple[NewEvent, Delivery]:
    """A step's creation with an input of half the World's ``max_payload`` (so that bytes count, not only actions),
    and its delivery."""
    size = int(getattr(world, "max_payload", 65536)) // 2 - 64
    cid = f"step:big:{k}"
    created = step_created(cid, "big", ["x" * size])
    return created, Delivery(queue, _message(cid), run_id, idempotency_key=batches.step_key(cid))
