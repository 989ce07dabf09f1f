"""Conformance: the World's schedule store (``world.schedule_store``, :mod:`celery_workflow.schedules`).

The store's operations (add once, read, list by id, compare-and-set on the version, delete), then the ticker on the
World under test with a clock the test moves: several tickers fire each tick once (one run per tick, its id derived
from the schedule and the tick), a tick missed by more than ``catch_up`` is skipped and one within it started,
``overlap`` applies to a previous run still going, a paused schedule fires nothing and resumes from the first tick
after now. Runs are created in the World directly (no Celery app): the ticker's starter is the World itself.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from celery_workflow.errors import ScheduleNotFound
from celery_workflow.event_data import RunCancelledData
from celery_workflow.events import NewEvent, RunStatus
from celery_workflow.schedules import Schedule, Schedules, Ticker, WorldStarter, schedules_of, tick_run_id
from celery_workflow.testing._conformance import Conformance, unique
from celery_workflow.world import NewRun, World

T0 = datetime(2026, 1, 1, 0, 0, 30, tzinfo=UTC)


@dataclass
class ManualClock:
    """A clock the test moves."""

    at: datetime = T0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def now(self) -> datetime:
        with self.lock:
            return self.at

    def move(self, seconds: float) -> None:
        with self.lock:
            self.at += timedelta(seconds=seconds)

    def real_seconds(self, seconds: float) -> float:
        return 0.0

    def clock_seconds(self, seconds: float) -> float:
        return seconds


def _starter(world: World, started: list[str]) -> WorldStarter:
    def start(name: str, args: Sequence[Any], kwargs: Mapping[str, Any], run_id: str) -> None:
        _, created = world.create_run(NewRun(run_id, name, {"args": list(args), "kwargs": dict(kwargs)}))
        if created:
            started.append(run_id)

    def cancel(run_id: str, reason: str) -> None:
        world.append(run_id, [NewEvent.of(RunCancelledData(reason=reason))])

    return WorldStarter(
        known=lambda name: name.startswith("sched."),
        start_run=start,
        get_status=lambda run_id: world.get_run(run_id).status,
        cancel_run=cancel,
    )


class ScheduleConformance(Conformance):
    """The schedule store and the ticker on the World under test."""

    def _schedules(self, world: World, clock: ManualClock) -> Schedules:
        assert schedules_of(world) is not None, f"{type(world).__name__} keeps no schedules (schedule_store)"
        return Schedules(world, clock)

    # -- the store -------------------------------------------------------------------------------------------------

    def test_schedule_store_adds_once_reads_lists_and_deletes(self, world: World) -> None:
        store = schedules_of(world)
        assert store is not None
        sid = unique("s")
        first = Schedule(sid, "sched.a", "*/5 * * * *", input={"args": [1, "x"], "kwargs": {"k": [True]}},
                         next_tick=T0, created_at=T0, updated_at=T0)  # fmt: skip
        assert store.add_schedule(first) is True
        assert store.add_schedule(replace(first, workflow_name="sched.other")) is False
        assert store.get_schedule(sid) == first
        other = replace(first, schedule_id=sid + "-b")
        assert store.add_schedule(other) is True
        ids = [s.schedule_id for s in store.list_schedules()]
        assert [i for i in ids if i.startswith(sid)] == [sid, sid + "-b"]
        assert store.delete_schedule(sid) is True
        assert store.delete_schedule(sid) is False
        with pytest.raises(ScheduleNotFound):
            store.get_schedule(sid)

    def test_schedule_store_replaces_only_the_version_it_read(self, world: World) -> None:
        store = schedules_of(world)
        assert store is not None
        sid = unique("s")
        stored = Schedule(sid, "sched.a", "* * * * *", next_tick=T0)
        store.add_schedule(stored)
        leased = stored.changed(T0, lease_holder="a", lease_until=T0 + timedelta(seconds=30))
        assert store.replace_schedule(leased, stored.version) is True
        rival = stored.changed(T0, lease_holder="b", lease_until=T0 + timedelta(seconds=30))
        assert store.replace_schedule(rival, stored.version) is False  # the version moved
        assert store.get_schedule(sid) == leased
        gone = Schedule(unique("s"), "sched.a", "* * * * *")
        assert store.replace_schedule(gone, 1) is False  # no such schedule: nothing written
        with pytest.raises(ScheduleNotFound):
            store.get_schedule(gone.schedule_id)

    # -- definitions -----------------------------------------------------------------------------------------------

    def test_defining_again_alike_keeps_the_schedule_and_a_new_cron_restarts_it(self, world: World) -> None:
        clock = ManualClock()
        schedules = self._schedules(world, clock)
        sid = unique("s")
        first = schedules.define(sid, "sched.a", "*/5 * * * *", args=[1])
        assert first.next_tick == datetime(2026, 1, 1, 0, 5, tzinfo=UTC)
        schedules.pause(sid)
        clock.move(3600)
        again = schedules.define(sid, "sched.a", "*/5 * * * *", args=[1])
        assert again.paused and again.next_tick == first.next_tick  # left as it was
        moved = schedules.define(sid, "sched.a", "0 * * * *", args=[2])
        assert moved.paused and moved.next_tick == datetime(2026, 1, 1, 2, 0, tzinfo=UTC)
        assert schedules.get(sid).input == {"args": [2], "kwargs": {}}
        resumed = schedules.resume(sid)
        assert not resumed.paused and resumed.next_tick == datetime(2026, 1, 1, 2, 0, tzinfo=UTC)
        schedules.delete(sid)
        with pytest.raises(ScheduleNotFound):
            schedules.delete(sid)

    # -- the ticker ------------------------------------------------------------------------------------------------

    def test_several_tickers_fire_each_tick_once(self, world: World) -> None:
        clock = ManualClock()
        schedules = self._schedules(world, clock)
        sid = unique("s")
        schedules.define(sid, "sched.a", "* * * * *", overlap="allow")
        store = schedules_of(world)
        assert store is not None
        started: list[str] = []
        tickers = [Ticker(store, _starter(world, started), clock=clock, holder=f"t{n}") for n in range(3)]
        for _ in range(5):
            clock.move(60)
            threads = [threading.Thread(target=t.tick) for t in tickers]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(10)
        expected = [tick_run_id(sid, datetime(2026, 1, 1, 0, m, tzinfo=UTC)) for m in range(1, 6)]
        assert sorted(r for r in started if r.startswith(sid)) == expected
        stored = schedules.get(sid)
        assert stored.last_run_id == expected[-1] and stored.lease_holder is None
        assert stored.next_tick == datetime(2026, 1, 1, 0, 6, tzinfo=UTC)

    def test_missed_ticks_are_started_within_catch_up_and_skipped_beyond(self, world: World) -> None:
        clock = ManualClock()
        schedules = self._schedules(world, clock)
        sid = unique("s")
        schedules.define(sid, "sched.a", "* * * * *", overlap="allow", catch_up=timedelta(minutes=3))
        store = schedules_of(world)
        assert store is not None
        started: list[str] = []
        clock.move(10 * 60)  # 00:10:30: ticks 00:01 ... 00:10 are due; 00:08, 00:09, 00:10 within 3 minutes
        reports, _ = Ticker(store, _starter(world, started), clock=clock).tick()
        assert started == [tick_run_id(sid, datetime(2026, 1, 1, 0, m, tzinfo=UTC)) for m in (8, 9, 10)]
        assert len(reports[0].skipped_late) == 7
        assert schedules.get(sid).next_tick == datetime(2026, 1, 1, 0, 11, tzinfo=UTC)

    def test_overlap_skip_allow_and_cancel_previous(self, world: World) -> None:
        clock = ManualClock()
        schedules = self._schedules(world, clock)
        store = schedules_of(world)
        assert store is not None
        ids = {overlap: unique(overlap) for overlap in ("skip", "allow", "cancel_previous")}
        for overlap, sid in ids.items():
            schedules.define(sid, "sched.a", "* * * * *", overlap=overlap)
        started: list[str] = []
        ticker = Ticker(store, _starter(world, started), clock=clock)
        for _ in range(2):  # the first runs stay pending: still going at the second tick
            clock.move(60)
            ticker.tick()
        runs = {overlap: [r for r in started if r.startswith(sid + "@")] for overlap, sid in ids.items()}
        assert len(runs["skip"]) == 1
        assert len(runs["allow"]) == 2
        first, second = runs["cancel_previous"]
        assert world.get_run(first).status == RunStatus.CANCELLED
        assert world.get_run(second).status == RunStatus.PENDING

    def test_a_paused_schedule_fires_nothing_and_resumes_from_the_next_tick(self, world: World) -> None:
        clock = ManualClock()
        schedules = self._schedules(world, clock)
        store = schedules_of(world)
        assert store is not None
        sid = unique("s")
        schedules.define(sid, "sched.a", "* * * * *", catch_up=timedelta(hours=1))
        schedules.pause(sid)
        started: list[str] = []
        ticker = Ticker(store, _starter(world, started), clock=clock)
        clock.move(5 * 60)
        ticker.tick()
        assert started == []
        schedules.resume(sid)
        ticker.tick()
        assert started == []  # the ticks that came while paused are not caught up
        clock.move(60)
        ticker.tick()
        assert started == [tick_run_id(sid, datetime(2026, 1, 1, 0, 6, tzinfo=UTC))]

    def test_a_ticker_whose_lease_ran_out_is_replaced_and_starts_nothing_twice(self, world: World) -> None:
        clock = ManualClock()
        schedules = self._schedules(world, clock)
        store = schedules_of(world)
        assert store is not None
        sid = unique("s")
        schedules.define(sid, "sched.a", "* * * * *")
        clock.move(60)
        started: list[str] = []
        due = schedules.get(sid)
        dead = due.changed(clock.now(), lease_holder="dead", lease_until=clock.now() + timedelta(seconds=20))
        assert store.replace_schedule(dead, due.version)  # a ticker took the tick and died
        _starter(world, started).start("sched.a", [], {}, tick_run_id(sid, due.next_tick or T0))  # after starting
        ticker = Ticker(store, _starter(world, started), clock=clock, lease=20)
        assert ticker.tick()[0] == []  # its lease holds
        clock.move(21)
        assert [r.started for r in ticker.tick()[0]] == [[tick_run_id(sid, due.next_tick or T0)]]
        assert started == [tick_run_id(sid, due.next_tick or T0)]  # one run: the second start was absorbed
