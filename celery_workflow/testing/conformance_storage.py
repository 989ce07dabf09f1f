"""World conformance: run creation, appends (slots, atomicity, expected counts), views, listings and the reading
of an ended run's streams."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta
from typing import Any

import pytest

from celery_workflow import codec, ids
from celery_workflow.errors import (
    EntityExists,
    EventInvalid,
    InvalidCursor,
    NotFound,
    RunNotFound,
    StaleLog,
    StepNotFound,
)
from celery_workflow.event_data import RunCreatedData, StepCreatedData
from celery_workflow.events import EventType, RunStatus
from celery_workflow.testing._conformance import (
    Conformance,
    create,
    delivery,
    drain,
    ev,
    eventually,
    hook_created,
    iso_in,
    requires,
    step_created,
    unique,
)
from celery_workflow.world import NewRun, World

_BIG = "x" * (codec.MAX_PAYLOAD_BYTES + 10)


class StorageConformance(Conformance):
    """Run creation, appends and views. Subclasses provide a ``world`` fixture (a fresh World per test)."""

    # -- create_run ------------------------------------------------------------------------------------------------

    def test_create_run_writes_run_created_at_slot_1(self, world: World) -> None:
        run_id = ids.new_run_id()
        before = ids.utcnow() - timedelta(seconds=1)
        view, created = world.create_run(NewRun(run_id, "wf.orders", {"args": [1, "a"], "kwargs": {}}, queue="q1"))
        assert created
        assert (view.run_id, view.workflow_name, view.status, view.event_count) == (
            run_id,
            "wf.orders",
            RunStatus.PENDING,
            1,
        )
        assert view.input == {"args": [1, "a"], "kwargs": {}}
        assert view.queue == "q1"
        assert view.started_at is None and view.completed_at is None and view.output is None
        assert view.created_at >= before and view.created_at.utcoffset() == timedelta(0)
        (event,) = world.list_events(run_id)
        assert (event.run_id, event.slot, event.event_type, event.correlation_id) == (
            run_id,
            1,
            EventType.RUN_CREATED,
            None,
        )
        assert event.body == RunCreatedData(
            workflow_name="wf.orders", input={"args": [1, "a"], "kwargs": {}}, queue="q1"
        )
        assert event.data == event.body.to_data()  # stored as given
        assert world.get_run(run_id) == view

    def test_create_run_keeps_the_trace_context_of_its_start(self, world: World) -> None:
        """Telemetry: the W3C traceparent recorded in ``run_created`` comes back to every reader (a worker's
        deliveries continue the run's trace from it)."""
        traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        run_id = ids.new_run_id()
        world.create_run(NewRun(run_id, "wf", {"args": [], "kwargs": {}}, traceparent=traceparent))
        (event,) = world.list_events(run_id, limit=1)
        assert isinstance(event.body, RunCreatedData) and event.body.traceparent == traceparent
        assert event.data["traceparent"] == traceparent

    def test_create_run_is_idempotent_by_run_id(self, world: World) -> None:
        queue = unique("q")
        first = create(world, deliveries=(delivery(queue, b"first"),))
        again, created = world.create_run(
            NewRun(first.run_id, "wf", {"args": [2], "kwargs": {}}), [delivery(queue, b"second")]
        )
        assert not created
        assert again == world.get_run(first.run_id)
        assert again.input == {"args": [1], "kwargs": {}}
        assert len(world.list_events(first.run_id)) == 1
        assert [c.payload for c in drain(world, queue)] == [b"first"]

    def test_create_run_of_another_workflow_id_is_entity_exists(self, world: World) -> None:
        run = create(world, workflow="wf.a")
        with pytest.raises(EntityExists):
            world.create_run(NewRun(run.run_id, "wf.b", {"args": [], "kwargs": {}}))
        assert world.get_run(run.run_id).workflow_name == "wf.a"

    def test_create_run_stores_its_deliveries(self, world: World) -> None:
        queue = unique("q")
        run = create(world, deliveries=(delivery(queue, b"go", run_id="r"),))
        (claimed,) = drain(world, queue)
        assert claimed.payload == b"go"
        assert world.get_run(run.run_id).event_count == 1

    def test_rejected_create_run_writes_nothing(self, world: World) -> None:
        queue = unique("q")
        run_id = ids.new_run_id()
        with pytest.raises(EventInvalid):
            world.create_run(NewRun(run_id, "wf", {"args": [_BIG], "kwargs": {}}), [delivery(queue)])
        with pytest.raises(RunNotFound):
            world.get_run(run_id)
        assert drain(world, queue) == []

    # -- append ----------------------------------------------------------------------------------------------------

    def test_append_fills_contiguous_slots(self, world: World) -> None:
        run = create(world)
        result = world.append(
            run.run_id, [ev(EventType.RUN_STARTED), step_created("s1"), step_created("s2", args=[3, {"k": "v"}])]
        )
        assert [e.slot for e in result.events] == [2, 3, 4]
        assert [e.event_type for e in result.events] == [
            EventType.RUN_STARTED,
            EventType.STEP_CREATED,
            EventType.STEP_CREATED,
        ]
        assert result.run.event_count == 4 and result.run.status is RunStatus.RUNNING
        more = world.append(run.run_id, [step_created("s3")])
        assert [e.slot for e in more.events] == [5]
        log = world.list_events(run.run_id)
        assert [e.slot for e in log] == [1, 2, 3, 4, 5]
        assert log[3].data_as(StepCreatedData).input == {"args": [3, {"k": "v"}], "kwargs": {}}
        assert log[1:4] == result.events
        assert world.get_run(run.run_id).event_count == 5

    def test_list_events_pages_by_slot(self, world: World) -> None:
        run = create(world, started=True)
        world.append(run.run_id, [step_created(f"s{i}") for i in range(5)])
        assert [e.slot for e in world.list_events(run.run_id, after_slot=3)] == [4, 5, 6, 7]
        assert [e.slot for e in world.list_events(run.run_id, after_slot=3, limit=2)] == [4, 5]
        assert world.list_events(run.run_id, after_slot=7) == []
        with pytest.raises(RunNotFound):
            world.list_events(ids.new_run_id())

    def test_get_run_with_events_reads_the_run_and_its_whole_log(self, world: World) -> None:
        run = create(world, started=True)
        world.append(run.run_id, [step_created("s1"), step_created("s2")])
        view, log = world.get_run_with_events(run.run_id)
        assert view == world.get_run(run.run_id) and view.event_count == 4
        assert log == world.list_events(run.run_id) and [e.slot for e in log] == [1, 2, 3, 4]
        with pytest.raises(RunNotFound):
            world.get_run_with_events(ids.new_run_id())

    def test_rejected_batch_writes_nothing(self, world: World) -> None:
        queue = unique("q")
        run = create(world, started=True)
        batch = [step_created("a"), step_created("b"), ev(EventType.STEP_COMPLETED, "missing", result=1)]
        with pytest.raises(StepNotFound):
            world.append(run.run_id, batch, deliveries=[delivery(queue, b"lost")])
        assert world.get_run(run.run_id).event_count == 2
        assert len(world.list_events(run.run_id)) == 2
        assert world.list_steps(run.run_id) == []
        assert drain(world, queue) == []

    def test_invalid_event_late_in_batch_writes_nothing(self, world: World) -> None:
        run = create(world, started=True)
        with pytest.raises(EventInvalid):
            world.append(run.run_id, [step_created("a"), ev(EventType.STEP_COMPLETED, "a")])  # no result
        with pytest.raises(EventInvalid):
            world.append(run.run_id, [step_created("a"), ev(EventType.STEP_FAILED, None, error={})])  # no id
        assert world.get_run(run.run_id).event_count == 2
        assert world.list_steps(run.run_id) == []

    def test_event_data_too_large_is_invalid_and_writes_nothing(self, world: World) -> None:
        run = create(world, started=True)
        world.append(run.run_id, [step_created("s"), ev(EventType.STEP_STARTED, "s")])
        with pytest.raises(EventInvalid):
            world.append(run.run_id, [ev(EventType.STEP_COMPLETED, "s", result=_BIG)])
        with pytest.raises(EventInvalid):
            world.append(run.run_id, [step_created("t"), step_created("u", args=[_BIG])])
        assert world.get_run(run.run_id).event_count == 4
        assert world.get_step(run.run_id, "s").status == "running"
        assert [s.step_id for s in world.list_steps(run.run_id)] == ["s"]

    def test_world_only_events_cannot_be_appended(self, world: World) -> None:
        run = create(world)
        with pytest.raises(EventInvalid):
            world.append(run.run_id, [ev(EventType.RUN_CREATED, workflow_name="wf", input={})])
        with pytest.raises(EventInvalid):
            world.append(run.run_id, [ev(EventType.HOOK_CONFLICT, "h", token="t")])
        assert world.get_run(run.run_id).event_count == 1

    def test_expected_count_guards_the_append(self, world: World) -> None:
        queue = unique("q")
        run = create(world)
        world.append(run.run_id, [ev(EventType.RUN_STARTED)], expected_count=1)
        with pytest.raises(StaleLog):
            world.append(run.run_id, [step_created("s")], expected_count=1, deliveries=[delivery(queue)])
        assert world.get_run(run.run_id).event_count == 2
        assert world.list_steps(run.run_id) == []
        assert drain(world, queue) == []
        assert world.append(run.run_id, [step_created("s")], expected_count=2).run.event_count == 3

    def test_append_to_unknown_run_is_run_not_found(self, world: World) -> None:
        queue = unique("q")
        with pytest.raises(RunNotFound):
            world.append(ids.new_run_id(), [ev(EventType.RUN_STARTED)], deliveries=[delivery(queue)])
        assert drain(world, queue) == []

    def test_append_stores_its_deliveries_atomically(self, world: World) -> None:
        queue = unique("q")
        run = create(world)
        when = ids.utcnow() - timedelta(seconds=1)
        world.append(
            run.run_id,
            [ev(EventType.RUN_STARTED), step_created("s")],
            deliveries=[delivery(queue, b"a", run_id=run.run_id), delivery(queue, b"b", not_before=when)],
        )
        got = drain(world, queue)
        assert sorted(c.payload for c in got) == [b"a", b"b"]
        assert {c.run_id for c in got} == {run.run_id, None}

    def test_no_op_append_still_stores_its_deliveries(self, world: World) -> None:
        queue = unique("q")
        run = create(world, started=True)
        result = world.append(run.run_id, [ev(EventType.RUN_STARTED)], deliveries=[delivery(queue)])
        assert result.events == [] and result.run.event_count == 2
        assert len(drain(world, queue)) == 1

    # -- views -----------------------------------------------------------------------------------------------------

    def test_get_run_of_unknown_id_is_run_not_found(self, world: World) -> None:
        with pytest.raises(RunNotFound):
            world.get_run(ids.new_run_id())
        with pytest.raises(NotFound):
            world.list_steps(ids.new_run_id())

    @requires("consistent_listings")
    def test_list_runs_newest_first_with_filters_and_paging(self, world: World) -> None:
        prefix = unique("wrun").lower()
        even, odd = unique("wf.even"), unique("wf.odd")
        made = [create(world, workflow=even if i % 2 == 0 else odd, run_id=f"{prefix}_{i:02d}") for i in range(5)]
        world.append(made[1].run_id, [ev(EventType.RUN_STARTED)])
        world.append(made[2].run_id, [ev(EventType.RUN_CANCELLED)])
        ours = [r.run_id for r in reversed(made)]

        def ids_of(**filters: Any) -> list[str]:
            return [r.run_id for r in world.list_runs(limit=1000, **filters).items if r.run_id.startswith(prefix)]

        assert ids_of() == ours
        assert ids_of(workflow=even) == [ours[0], ours[2], ours[4]]
        assert ids_of(status="running") == [made[1].run_id]
        assert ids_of(status=RunStatus.CANCELLED) == [made[2].run_id]
        assert ids_of(workflow=even, status="pending") == [ours[0], ours[4]]
        assert world.list_runs(workflow=unique("wf.none")).items == []
        seen: list[str] = []
        cursor = None
        pages = 0
        while True:
            page = world.list_runs(workflow=even, limit=2, cursor=cursor)
            assert len(page.items) <= 2
            seen += [r.run_id for r in page.items]
            pages += 1
            if page.cursor is None:
                break
            cursor = page.cursor
        assert seen == [ours[0], ours[2], ours[4]] and pages == 2
        exact = world.list_runs(workflow=odd, limit=2)
        assert [r.run_id for r in exact.items] == [ours[1], ours[3]] and exact.cursor is None

    def test_list_runs_is_newest_first_by_creation_whatever_the_run_ids(self, world: World) -> None:
        """Caller-chosen ids in the reverse of creation order: the run created last is listed first, and the
        cursors page through the same order (a World whose listing lags its writes is waited for)."""
        prefix = unique("zrun").lower()
        name = unique("wf.created")
        made: list[Any] = []
        for suffix in ("c", "b", "a"):  # the ids sort against the creation order
            made.append(create(world, workflow=name, run_id=f"{prefix}_{suffix}"))
            eventually(lambda: True if ids.utcnow() > made[-1].created_at else None)  # the next one is newer
        world.append(made[0].run_id, [ev(EventType.RUN_STARTED)])
        world.append(made[2].run_id, [ev(EventType.RUN_STARTED)])
        running: dict[str, Any] = {"workflow": name, "status": RunStatus.RUNNING}

        def listed(count: int, **filters: Any) -> list[str] | None:
            got = [r.run_id for r in world.list_runs(limit=1000, **filters).items if r.run_id.startswith(prefix)]
            return got if len(got) == count else None

        newest_first = [r.run_id for r in reversed(made)]
        assert eventually(lambda: listed(3)) == newest_first
        assert eventually(lambda: listed(3, workflow=name)) == newest_first
        assert eventually(lambda: listed(2, **running)) == [made[2].run_id, made[0].run_id]
        for filters, expected in (({"workflow": name}, newest_first), (running, [made[2].run_id, made[0].run_id])):
            seen: list[str] = []
            cursor = None
            while True:
                page = world.list_runs(limit=1, cursor=cursor, **filters)
                seen += [r.run_id for r in page.items]
                if page.cursor is None:
                    break
                cursor = page.cursor
            assert seen == expected
        with pytest.raises(InvalidCursor):
            world.list_runs(cursor=made[0].run_id)  # a run id is no cursor

    def test_list_runs_by_run_id_prefix_and_creation_time(self, world: World) -> None:
        """``run_id_prefix`` keeps the runs whose id starts with it; ``created_from`` (inclusive) and
        ``created_until`` (exclusive) bound the creation time; they combine with the other filters and the cursor."""
        prefix = unique("qrun").lower()
        name = unique("wf.search")
        made: list[Any] = []
        for i in range(4):
            made.append(create(world, workflow=name, run_id=f"{prefix}_{'ab'[i % 2]}{i}"))
            eventually(lambda: True if ids.utcnow() > made[-1].created_at else None)  # the next one is newer
        newest_first = [r.run_id for r in reversed(made)]

        def listed(count: int, **filters: Any) -> list[str] | None:
            got = [r.run_id for r in world.list_runs(limit=1000, **filters).items]
            return got if len(got) == count else None

        assert eventually(lambda: listed(4, run_id_prefix=prefix)) == newest_first
        assert eventually(lambda: listed(2, run_id_prefix=f"{prefix}_a")) == [made[2].run_id, made[0].run_id]
        assert eventually(lambda: listed(2, run_id_prefix=f"{prefix}_b", workflow=name)) == [
            made[3].run_id,
            made[1].run_id,
        ]
        assert world.list_runs(run_id_prefix=f"{prefix}_c").items == []
        middle = {"created_from": made[1].created_at, "created_until": made[3].created_at}
        assert eventually(lambda: listed(2, run_id_prefix=prefix, **middle)) == [made[2].run_id, made[1].run_id]
        assert eventually(lambda: listed(2, workflow=name, **middle)) == [made[2].run_id, made[1].run_id]
        assert eventually(lambda: listed(1, workflow=name, created_until=made[1].created_at)) == [made[0].run_id]
        assert eventually(lambda: listed(1, workflow=name, created_from=made[3].created_at)) == [made[3].run_id]
        seen: list[str] = []
        cursor = None
        while True:  # a page at a time, within the time range
            page = world.list_runs(limit=1, cursor=cursor, workflow=name, created_from=made[1].created_at)
            seen += [r.run_id for r in page.items]
            if page.cursor is None:
                break
            cursor = page.cursor
        assert seen == newest_first[:3]
        with pytest.raises(ValueError):
            world.list_runs(run_id_prefix="")
        with pytest.raises(ValueError):
            world.list_runs(created_from=datetime(2026, 1, 1))  # naive

    def test_a_reader_of_an_ended_runs_open_stream_returns_what_is_there_without_waiting(self, world: World) -> None:
        """Nobody is left to write or close the stream of an ended run: a read that may wait 30 s returns at once
        with what is there (nothing more, not closed), and a reader waiting when the run ends returns too."""
        run = create(world, started=True)
        world.write_stream(run.run_id, "open", [codec.dumps_chunk("one")])
        waiting: list[Any] = []
        reader = threading.Thread(
            target=lambda: waiting.append(world.read_stream(run.run_id, "open", start=1, wait=30))
        )
        reader.start()
        world.append(run.run_id, [ev(EventType.RUN_COMPLETED, output=None)])
        reader.join(10)
        assert not reader.is_alive() and waiting[0].chunks == [] and not waiting[0].closed
        started = time.monotonic()
        page = world.read_stream(run.run_id, "open", wait=30)
        assert [codec.loads(c.data) for c in page.chunks] == ["one"]
        rest = world.read_stream(run.run_id, "open", start=page.next_index, wait=30)
        never = world.read_stream(run.run_id, "never written", wait=30)
        assert (rest.chunks, rest.closed, rest.next_index) == ([], False, 1)
        assert (never.chunks, never.closed) == ([], False)
        assert time.monotonic() - started < 10  # three reads, none of which waited out its 30 s

    def test_list_steps_hooks_and_waits_in_creation_order(self, world: World) -> None:
        run = create(world, started=True)
        token = unique("tok")
        world.append(run.run_id, [step_created("zz"), step_created("aa"), step_created("mm")])
        world.append(run.run_id, [hook_created("h2", token + "2"), hook_created("h1", token + "1", metadata={"m": 1})])
        world.append(
            run.run_id,
            [
                ev(EventType.WAIT_CREATED, "w2", resume_at=iso_in(60)),
                ev(EventType.WAIT_CREATED, "w1", resume_at=iso_in(30)),
            ],
        )
        assert [s.step_id for s in world.list_steps(run.run_id)] == ["zz", "aa", "mm"]
        hooks = world.list_hooks(run.run_id)
        assert [(h.hook_id, h.token, h.metadata) for h in hooks] == [
            ("h2", token + "2", None),
            ("h1", token + "1", {"m": 1}),
        ]
        assert [w.wait_id for w in world.list_waits(run.run_id)] == ["w2", "w1"]
        assert world.get_step(run.run_id, "aa").step_name == "step"
        with pytest.raises(StepNotFound):
            world.get_step(run.run_id, "nope")
        other = create(world)
        assert world.list_steps(other.run_id) == [] and world.list_hooks(other.run_id) == []
        assert world.list_waits(other.run_id) == []
