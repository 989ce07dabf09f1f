"""The ticker: fires due schedule ticks from a worker's main process (no Celery beat, no single point of failure).

Every worker of an app with a World that keeps schedules runs one (a thread started when the worker is ready and
stopped at its shutdown: :mod:`celery_workflow.worker_setup`). It sleeps until the soonest ``next_tick`` of the
schedules of workflows it knows, at most :attr:`Ticker.poll` seconds (a schedule added or resumed elsewhere is seen
then), and for each due schedule:

1. **claims** the tick: a compare-and-set of the schedule's version that sets a short lease
   (:attr:`Ticker.lease` real seconds). Of several tickers that see the tick due, one wins; the others skip it.
   A ticker that dies holding the lease leaves the tick to whichever ticker finds the lease run out;
2. **fires** every tick from ``next_tick`` up to now: a tick later than the schedule's ``catch_up`` window (plus the
   ticker's :attr:`Ticker.period`, for a caller that ticks only so often: the Lambda tick handler, every minute) is
   skipped (missed while nothing ran); one within it starts the run :func:`~.model.tick_run_id` (idempotent by run
   id: a tick fired twice, by a ticker whose lease ran out, starts one run), after applying ``overlap`` to the
   schedule's previous run if it is still going (``skip`` the tick, ``allow`` both, ``cancel_previous``);
3. **moves on**: a compare-and-set that records the last tick and run, sets ``next_tick`` to the first tick after
   now and drops the lease. A schedule paused, redefined or deleted meanwhile keeps that change (the advance is
   applied to what is stored, while its ``next_tick`` is still the one fired).

Time comes from a :class:`Clock`: :class:`SystemClock`, or a :class:`SpedUpClock` in tests (a minute of schedule
time in a second of real time, shared by every worker that builds it from the same start).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

from celery_workflow import ids
from celery_workflow.errors import RunNotFound, ScheduleNotFound
from celery_workflow.schedules.cron import parse_cron
from celery_workflow.schedules.model import Schedule, ScheduleStore, tick_run_id

__all__ = ["Clock", "SpedUpClock", "Starter", "SystemClock", "TickReport", "Ticker"]

log = logging.getLogger("celery_workflow.schedules")


class Clock(Protocol):
    """What the ticker reads the time from."""

    def now(self) -> datetime:
        """The time now (aware UTC)."""
        ...

    def real_seconds(self, seconds: float) -> float:
        """How many real seconds pass while this clock moves ``seconds``."""
        ...

    def clock_seconds(self, seconds: float) -> float:
        """How far this clock moves in ``seconds`` real seconds."""
        ...


class SystemClock:
    """The real time."""

    def now(self) -> datetime:
        return ids.utcnow()

    def real_seconds(self, seconds: float) -> float:
        return seconds

    def clock_seconds(self, seconds: float) -> float:
        return seconds


@dataclass(frozen=True)
class SpedUpClock:
    """A clock that reads ``start`` at the real (epoch) time ``real_start`` and runs ``factor`` times as fast: every
    process that builds it with the same three values reads the same time (tests with several workers)."""

    start: datetime
    factor: float
    real_start: float = field(default_factory=time.time)

    def now(self) -> datetime:
        return ids.to_utc(self.start) + timedelta(seconds=(time.time() - self.real_start) * self.factor)

    def real_seconds(self, seconds: float) -> float:
        return seconds / self.factor

    def clock_seconds(self, seconds: float) -> float:
        return seconds * self.factor


class Starter(Protocol):
    """What the ticker needs of the app: start a run, tell whether one is still going, cancel one."""

    def knows(self, workflow_name: str) -> bool: ...

    def start(self, workflow_name: str, args: Sequence[Any], kwargs: Mapping[str, Any], run_id: str) -> bool:
        """Start the run (idempotent by ``run_id``): True when this call created it."""
        ...

    def running(self, run_id: str) -> bool: ...

    def cancel(self, run_id: str, reason: str) -> None: ...


@dataclass
class TickReport:
    """What one firing of a schedule did."""

    schedule_id: str
    started: list[str] = field(default_factory=list)
    skipped_late: list[datetime] = field(default_factory=list)
    skipped_overlap: list[datetime] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)


def _holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Ticker:
    """Fires the due ticks of the schedules in ``store`` (see the module docstring)."""

    def __init__(
        self,
        store: ScheduleStore,
        starter: Starter,
        *,
        clock: Clock | None = None,
        lease: float = 30.0,
        poll: float = 5.0,
        holder: str | None = None,
        period: float = 0.0,
    ) -> None:
        self.store = store
        self.starter = starter
        self.clock: Clock = clock or SystemClock()
        self.lease = lease
        self.poll = poll
        #: Seconds between two calls of :meth:`tick` by a caller without the thread (0: the thread wakes when a tick
        #: is due): a tick is late only past its schedule's ``catch_up`` plus this, since it could not be seen sooner.
        self.period = period
        self.holder = holder or _holder()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- one pass --------------------------------------------------------------------------------------------------

    def tick(self, stop: Callable[[], bool] | None = None) -> tuple[list[TickReport], datetime | None]:
        """Fire every due schedule once; what was done, and when the next known tick (or lease end) is due.
        ``stop``: asked before each due schedule is fired; once it answers True, the due schedules left are left to
        the next pass (a caller with a deadline: the Lambda tick handler)."""
        reports: list[TickReport] = []
        soonest: datetime | None = None
        left = 0
        for schedule in self.store.list_schedules():
            if schedule.paused or schedule.next_tick is None or not self.starter.knows(schedule.workflow_name):
                continue
            now = self.clock.now()
            if schedule.due(now):
                if left or (stop is not None and stop()):
                    left += 1
                    continue
                try:
                    report = self.fire(schedule)
                except Exception:  # its lease runs out and a ticker tries again; the other schedules go on
                    log.exception("schedule %s: firing its tick failed", schedule.schedule_id)
                    continue
                if report is not None:
                    reports.append(report)
                    continue
            else:
                wake = schedule.lease_until if schedule.leased(now) else schedule.next_tick
                soonest = wake if soonest is None or (wake is not None and wake < soonest) else soonest
        if left:
            log.warning("schedules: %d due schedule(s) left to the next pass (out of time)", left)
        if reports or left:  # what firing stored, or what is still due: look again at once
            soonest = self.clock.now()
        return reports, soonest

    def fire(self, schedule: Schedule) -> TickReport | None:
        """Claim, fire and advance ``schedule`` (as read); None when another ticker claimed it first."""
        now = self.clock.now()
        lease = timedelta(seconds=self.clock.clock_seconds(self.lease))  # real seconds, whatever the clock's pace
        claimed = schedule.changed(now, lease_holder=self.holder, lease_until=now + lease)
        if not self.store.replace_schedule(claimed, schedule.version):
            return None
        assert schedule.next_tick is not None
        cron = parse_cron(schedule.cron, schedule.timezone)
        ticks = [schedule.next_tick, *cron.ticks(schedule.next_tick, now)]
        report = TickReport(schedule.schedule_id)
        last_run, last_tick = schedule.last_run_id, schedule.last_tick
        args = list(schedule.input.get("args", []))
        kwargs = dict(schedule.input.get("kwargs", {}))
        for tick in ticks:
            if (now - tick).total_seconds() > schedule.catch_up + self.period:
                report.skipped_late.append(tick)
                continue
            run_id = tick_run_id(schedule.schedule_id, tick)
            if (
                last_run is not None
                and last_run != run_id
                and schedule.overlap != "allow"
                and self.starter.running(last_run)
            ):
                if schedule.overlap == "skip":
                    report.skipped_overlap.append(tick)
                    last_tick = tick
                    continue
                self.starter.cancel(
                    last_run, f"schedule {schedule.schedule_id}: tick {ids.isoformat(tick)} replaces it"
                )
                report.cancelled.append(last_run)
            if self.starter.start(schedule.workflow_name, args, kwargs, run_id):
                log.info("schedule %s: tick %s started run %s", schedule.schedule_id, ids.isoformat(tick), run_id)
            else:  # fired before by a ticker whose lease ran out
                log.info(
                    "schedule %s: tick %s had started run %s already", schedule.schedule_id, ids.isoformat(tick), run_id
                )
            report.started.append(run_id)
            last_run, last_tick = run_id, tick
        if report.skipped_late:
            log.warning(
                "schedule %s: %d tick(s) missed by more than catch_up (%gs) skipped, the last %s",
                schedule.schedule_id,
                len(report.skipped_late),
                schedule.catch_up,
                ids.isoformat(report.skipped_late[-1]),
            )
        for skipped in report.skipped_overlap:
            log.info(
                "schedule %s: tick %s skipped, run %s still going",
                schedule.schedule_id,
                ids.isoformat(skipped),
                last_run,
            )
        next_tick = cron.next_after(max(now, ticks[-1]))
        self._advance(claimed, schedule.next_tick, next_tick, last_tick, last_run)
        return report

    def _advance(
        self, claimed: Schedule, fired: datetime, next_tick: datetime, last_tick: datetime | None, last_run: str | None
    ) -> None:
        current = claimed
        for _ in range(10):
            if current.next_tick != fired:
                return  # redefined or resumed elsewhere meanwhile: its own next tick stands
            moved = current.changed(
                self.clock.now(),
                next_tick=next_tick,
                last_tick=last_tick,
                last_run_id=last_run,
                lease_holder=None,
                lease_until=None,
            )
            if self.store.replace_schedule(moved, current.version):
                return
            try:
                current = self.store.get_schedule(claimed.schedule_id)
            except ScheduleNotFound:
                return  # deleted meanwhile
        log.warning("schedule %s: could not record its tick after 10 tries", claimed.schedule_id)  # pragma: no cover

    # -- the thread ------------------------------------------------------------------------------------------------

    def serve(self) -> None:
        """Tick until :meth:`stop` (what the thread runs)."""
        while not self._stop.is_set():
            wait = self.poll
            try:
                _, soonest = self.tick()
                if soonest is not None:
                    until = (soonest - self.clock.now()).total_seconds()
                    wait = max(0.0, min(self.poll, self.clock.real_seconds(until)))
            except Exception:
                log.exception("schedules: a pass of the ticker failed; trying again in %gs", self.poll)
            if wait > 0:
                self._stop.wait(wait)

    def start(self) -> Ticker:
        self._thread = threading.Thread(target=self.serve, name="celery_workflow-schedules", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None


@dataclass
class WorldStarter:
    """A :class:`Starter` on callables (the app gives its runtime's ``start``, ``cancel`` and the World's
    ``get_run``)."""

    known: Callable[[str], bool]
    start_run: Callable[[str, Sequence[Any], Mapping[str, Any], str], Any]
    get_status: Callable[[str], Any]
    cancel_run: Callable[[str, str], Any]

    def knows(self, workflow_name: str) -> bool:
        return self.known(workflow_name)

    def start(self, workflow_name: str, args: Sequence[Any], kwargs: Mapping[str, Any], run_id: str) -> bool:
        started = self.start_run(workflow_name, args, kwargs, run_id)
        return bool(started[1]) if isinstance(started, tuple) else True  # (view, created), as Runtime.start answers

    def running(self, run_id: str) -> bool:
        try:
            status = self.get_status(run_id)
        except RunNotFound:
            return False
        return not bool(status.terminal)

    def cancel(self, run_id: str, reason: str) -> None:
        try:
            self.cancel_run(run_id, reason)
        except Exception as exc:  # it ended meanwhile
            log.info("schedules: run %s not cancelled (%s)", run_id, exc)
