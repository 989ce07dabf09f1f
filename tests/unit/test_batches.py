"""The splitting of what one delivery writes into appends within the World's limits (issue #26, item 4)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
from celery import Celery

from celery_workflow import Workflows
from celery_workflow.errors import ConfigurationError, EventInvalid, StaleLog
from celery_workflow.events import EventType, NewEvent, RunStatus
from celery_workflow.runtime import batches
from celery_workflow.runtime.batches import Chunk, append_split, split, step_key
from celery_workflow.runtime.context import gather
from celery_workflow.testing._conformance import claim_one, create, ev, hook_created, step_created
from celery_workflow.testing.driver import LocalWorker
from celery_workflow.testing.memory import MemoryWorld
from celery_workflow.world import NO_APPEND_LIMITS, AppendLimits, Delivery, append_limits

SMALL = AppendLimits(max_actions=10, reserved_actions=2)


def fan_out(n: int, *, started: bool = True) -> tuple[list[NewEvent], list[Delivery]]:
    events = ([ev(EventType.RUN_STARTED)] if started else []) + [
        step_created(f"step:s:{i}", "s", [i]) for i in range(1, n + 1)
    ]
    deliveries = [
        Delivery("q", f"s{i}".encode(), "r", idempotency_key=step_key(f"step:s:{i}")) for i in range(1, n + 1)
    ]
    return events, deliveries


def wake() -> Delivery:
    return Delivery("q", b"wake", "r", idempotency_key="wake")


def check(
    chunks: list[Chunk], events: Sequence[NewEvent], deliveries: Sequence[Delivery], limits: AppendLimits
) -> None:
    """What every split keeps: the events in order, every delivery once, each chunk within the limits, a step's
    delivery with its creation, anything else in the last chunk."""
    assert [e for c in chunks for e in c.events] == list(events)
    assert Counter(id(d) for c in chunks for d in c.deliveries) == Counter(id(d) for d in deliveries)
    for chunk in chunks:
        assert limits.fits(*limits.cost(chunk.events, chunk.deliveries)), chunk
        ids = {e.correlation_id for e in chunk.events}
        for d in chunk.deliveries:
            key = d.idempotency_key or ""
            if key.startswith("step:"):
                assert key[len("step:") :] in ids, f"{key} is not with its step's creation"
            else:
                assert chunk is chunks[-1], f"{key} is not in the last append"


def test_one_chunk_when_the_batch_fits_or_the_world_has_no_limits() -> None:
    events, deliveries = fan_out(3)
    assert split(events, deliveries, SMALL) == [Chunk(events, deliveries)]
    events, deliveries = fan_out(5000)
    assert split(events, deliveries, NO_APPEND_LIMITS) == [Chunk(events, deliveries)]


def test_a_fan_out_is_split_within_the_limits_pairs_kept_the_start_first_the_rest_last() -> None:
    events, deliveries = fan_out(40)
    deliveries.append(wake())
    chunks = split(events, deliveries, SMALL)
    check(chunks, events, deliveries, SMALL)
    assert len(chunks) == 11  # 8 actions per append: 4 steps each, the start and the wake-up in the first and last
    assert chunks[0].events[0].event_type is EventType.RUN_STARTED
    assert chunks[-1].deliveries[-1].idempotency_key == "wake"


def test_a_step_retried_later_keeps_its_delivery_with_its_retry() -> None:
    retry = ev(EventType.STEP_RETRYING, "step:s:2", error={"type": "E", "message": "m"}, retry_after="x")
    events = [*fan_out(6)[0], retry]
    deliveries = [*fan_out(6)[1], Delivery("q", b"again", "r", idempotency_key=step_key("step:s:2"))]
    chunks = split(events, deliveries, SMALL)
    check(chunks, events, deliveries, SMALL)
    holding = next(c for c in chunks if b"again" in [d.payload for d in c.deliveries])
    assert retry in holding.events


def test_the_byte_limit_splits_too_and_an_oversized_event_goes_alone() -> None:
    limits = AppendLimits(max_bytes=10_000, reserved_bytes=1_000, event_overhead={"step_created": 100})
    events = [step_created(f"step:s:{i}", "s", ["x" * 2_000]) for i in range(1, 11)]
    events.insert(5, step_created("step:huge:1", "huge", ["y" * 50_000]))
    chunks = split(events, [], limits)
    assert [e for c in chunks for e in c.events] == events
    huge = next(c for c in chunks if any(e.correlation_id == "step:huge:1" for e in c.events))
    assert huge.events == [events[5]]  # the World refuses it, with its own error
    for chunk in chunks:
        if chunk is not huge:
            assert limits.fits(*limits.cost(chunk.events, chunk.deliveries))


def test_deliveries_beyond_the_last_append_fill_the_ones_before() -> None:
    events, _ = fan_out(2)
    wakes = [Delivery("q", f"w{i}".encode(), "r", idempotency_key=f"timer:{i}") for i in range(20)]
    chunks = split(events, wakes, SMALL)
    assert [e for c in chunks for e in c.events] == events
    assert [d for c in chunks for d in c.deliveries] == wakes
    for chunk in chunks:
        assert SMALL.fits(*SMALL.cost(chunk.events, chunk.deliveries))


def test_limits_are_checked() -> None:
    with pytest.raises(ConfigurationError, match="max_actions"):
        AppendLimits(max_actions=3, reserved_actions=3)
    with pytest.raises(ConfigurationError, match="event_actions"):
        AppendLimits(max_actions=10, event_actions={"step_created": -1})
    with pytest.raises(ConfigurationError, match="delivery_actions"):
        AppendLimits(delivery_actions=True)  # type: ignore[arg-type]
    assert append_limits(object()) is NO_APPEND_LIMITS
    assert AppendLimits().unlimited and not SMALL.unlimited


# -- appending the chunks ----------------------------------------------------------------------------------------------


class Recording(MemoryWorld):
    def __init__(self, limits: AppendLimits) -> None:
        super().__init__(append_limits=limits)
        self.calls: list[dict[str, Any]] = []

    def append(self, run_id: str, events: Sequence[NewEvent], **kwargs: Any) -> Any:  # type: ignore[override]
        self.calls.append({"events": list(events), **kwargs})
        return super().append(run_id, events, **kwargs)


def test_only_the_last_append_acks_and_is_durable_each_on_the_count_the_one_before_left() -> None:
    world = Recording(SMALL)
    run = create(world, deliveries=(Delivery("first", b"go", idempotency_key="wake"),))
    claimed = claim_one(world, "first")
    assert claimed is not None
    events, deliveries = fan_out(12)
    written = append_split(
        world, run.run_id, events, deliveries, expected_count=1, ack=claimed.receipt, durable=False, last_durable=True
    )
    assert [e.slot for e in written] == list(range(2, 2 + len(events)))
    assert len(world.calls) == 4
    assert [c["ack"] for c in world.calls] == [None, None, None, claimed.receipt]
    assert [c["durable"] for c in world.calls] == [False, False, False, True]
    counts = [1] + [1 + sum(len(c["events"]) for c in world.calls[:i]) for i in range(1, 4)]
    assert [c["expected_count"] for c in world.calls] == counts
    world.release(claimed.receipt)
    assert claim_one(world, "first") is None  # acked by the last append


class Interleaved(Recording):
    """Another writer appends ``extra`` to the run right after the first append of a split batch."""

    def __init__(self, limits: AppendLimits, extra: list[NewEvent]) -> None:
        super().__init__(limits)
        self.extra = extra

    def append(self, run_id: str, events: Sequence[NewEvent], **kwargs: Any) -> Any:  # type: ignore[override]
        result = super().append(run_id, events, **kwargs)
        if len(self.calls) == 1 and self.extra:
            extra, self.extra = self.extra, []
            MemoryWorld.append(self, run_id, extra)
        return result


def test_another_writers_step_progress_between_appends_is_caught_up_with() -> None:
    world = Interleaved(SMALL, [])
    run = create(world, started=True)
    world.append(run.run_id, [step_created("step:early:1", "early")])
    world.calls.clear()
    world.extra = [ev(EventType.STEP_STARTED, "step:early:1", owner="d2")]
    events, deliveries = fan_out(12, started=False)
    written = append_split(
        world, run.run_id, events, deliveries, expected_count=3, ack=None, durable=True, last_durable=True
    )
    assert [(e.event_type, e.correlation_id) for e in written] == [(e.event_type, e.correlation_id) for e in events]
    slots = [e.slot for e in written]
    assert slots != list(range(slots[0], slots[0] + len(slots)))  # a gap: the replay reads the log again
    log = world.list_events(run.run_id)
    assert [e.slot for e in log] == list(range(1, len(log) + 1))
    assert sum(e.event_type is EventType.STEP_STARTED for e in log) == 1


def test_another_writers_creation_between_appends_stops_the_batch() -> None:
    world = Interleaved(SMALL, [])
    run = create(world, started=True)
    world.calls.clear()
    world.extra = [hook_created("hook:1", "tok")]
    events, deliveries = fan_out(12, started=False)
    with pytest.raises(StaleLog):
        append_split(world, run.run_id, events, deliveries, expected_count=2, ack=None, durable=True, last_durable=True)
    assert len(world.calls) == 2  # the first append stays written; the caller replays from the log


def test_a_stale_first_append_is_raised() -> None:
    world = Recording(SMALL)
    run = create(world, started=True)
    world.calls.clear()
    events, deliveries = fan_out(12, started=False)
    with pytest.raises(StaleLog):
        append_split(world, run.run_id, events, deliveries, expected_count=1, ack=None, durable=True, last_durable=True)
    assert len(world.calls) == 1


def test_the_memory_world_refuses_an_append_over_its_limits() -> None:
    world = MemoryWorld(append_limits=SMALL)
    run = create(world, started=True)
    events, deliveries = fan_out(5, started=False)
    with pytest.raises(EventInvalid, match="append_limits"):
        world.append(run.run_id, events, deliveries=deliveries)
    assert world.get_run(run.run_id).event_count == 2


# -- the runtime -------------------------------------------------------------------------------------------------------


def workflows(world: MemoryWorld) -> tuple[Workflows, Any, Counter[int]]:
    wf = Workflows(Celery("batches"), world=world, broker="app")
    ran: Counter[int] = Counter()

    @wf.step
    def square(i: int) -> int:
        ran[i] += 1
        return i * i

    @wf.workflow
    def fan(n: int) -> int:
        return sum(gather(*[square.start(i) for i in range(1, n + 1)]))

    return wf, fan, ran


@pytest.mark.parametrize("limits", [SMALL, AppendLimits(max_actions=100, reserved_actions=3, default_event_actions=3)])
def test_a_gather_wider_than_one_append_completes(limits: AppendLimits) -> None:
    world = MemoryWorld(append_limits=limits)
    wf, fan, ran = workflows(world)
    run = fan.start(150)
    view = LocalWorker(wf).run_until_complete(run, timeout=30)
    assert view.status is RunStatus.COMPLETED and run.result(timeout=0) == sum(i * i for i in range(1, 151))
    created = [e.correlation_id for e in world.list_events(run.id) if e.event_type is EventType.STEP_CREATED]
    assert created == [f"step:square:{i}" for i in range(1, 151)]
    assert set(ran.values()) == {1} and len(ran) == 150


def test_a_gather_of_a_few_dozen_steps_is_split_on_the_default_memory_world() -> None:
    world = MemoryWorld()
    limits = world.append_limits
    wf, fan, _ = workflows(world)
    seen: list[int] = []
    original = world.append

    def append(run_id: str, events: Sequence[NewEvent], **kwargs: Any) -> Any:
        seen.append(sum(e.event_type is EventType.STEP_CREATED for e in events))
        assert limits.fits(*limits.cost(events, kwargs.get("deliveries", ())))
        return original(run_id, events, **kwargs)

    world.append = append  # type: ignore[method-assign]
    run = fan.start(40)
    LocalWorker(wf).run_until_complete(run)
    assert run.result(timeout=0) == sum(i * i for i in range(1, 41))
    assert len([n for n in seen if n]) >= 2


def test_batches_module_exports() -> None:
    assert set(batches.__all__) >= {"split", "append_split", "step_key", "Chunk"}


class StepFinishesMeanwhile(MemoryWorld):
    """Step 1 of a fan-out starts and finishes on "another worker" right after the fan-out's first append."""

    def __init__(self) -> None:
        super().__init__(append_limits=SMALL)
        self.done = False

    def append(self, run_id: str, events: Sequence[NewEvent], **kwargs: Any) -> Any:  # type: ignore[override]
        result = super().append(run_id, events, **kwargs)
        if not self.done and any(e.correlation_id == "step:square:1" for e in events):
            self.done = True
            super().append(
                run_id,
                [
                    ev(EventType.STEP_STARTED, "step:square:1", owner="elsewhere"),
                    ev(EventType.STEP_COMPLETED, "step:square:1", result=1),
                ],
            )
        return result


def test_a_step_finishing_between_two_appends_of_its_fan_out() -> None:
    world = StepFinishesMeanwhile()
    wf, fan, ran = workflows(world)
    run = fan.start(30)
    worker = LocalWorker(wf)
    worker.run_until_complete(run, timeout=30)
    assert world.done
    assert run.result(timeout=0) == sum(i * i for i in range(1, 31))
    log = world.list_events(run.id)
    assert [e.slot for e in log] == list(range(1, len(log) + 1))
    created = [e.correlation_id for e in log if e.event_type is EventType.STEP_CREATED]
    assert created == [f"step:square:{i}" for i in range(1, 31)]
    assert 1 not in ran and set(ran.values()) == {1} and len(ran) == 29  # step 1 ran elsewhere
    assert worker.failures == []
