"""``wf.schedule(...)`` and the worker's ticker on an in-memory World (issue #30, item 3): the definition is checked
and stored, the ticker thread starts real runs of the workflow with the schedule's arguments under a sped-up clock,
and stops at once."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import Celery

from celery_workflow import Workflows
from celery_workflow.errors import ConfigurationError, InvalidSchedule, ScheduleNotFound, WorldUnavailable
from celery_workflow.events import RunStatus
from celery_workflow.schedules import SpedUpClock, tick_run_id
from celery_workflow.testing import LocalWorker, MemoryWorld
from celery_workflow.worker_setup import start_ticker


@pytest.fixture
def wf() -> Iterator[Workflows]:
    workflows = Workflows(Celery("schedules-unit"), MemoryWorld(), broker="app")

    @workflows.workflow(name="reports.daily")
    def daily(region: str, *, full: bool = False) -> str:
        return f"{region}:{full}"

    yield workflows
    workflows.close()


def test_schedule_stores_the_definition_once(wf: Workflows) -> None:
    first = wf.schedule("reports.daily", cron="0 6 * * mon-fri", id="daily", args=["eu"], kwargs={"full": True})
    assert first.workflow_name == "reports.daily" and first.input == {"args": ["eu"], "kwargs": {"full": True}}
    assert first.overlap == "skip" and first.catch_up == 60.0 and first.next_tick is not None
    again = wf.schedule(wf.registry.workflows["reports.daily"].name, cron="0 6 * * mon-fri", id="daily", args=["eu"],
                        kwargs={"full": True})  # fmt: skip
    assert again == first
    assert [s.schedule_id for s in wf.schedules.list()] == ["daily"]
    wf.schedules.delete("daily")
    with pytest.raises(ScheduleNotFound):
        wf.schedules.get("daily")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"cron": "61 * * * *"}, "minute"),
        ({"cron": "* * * * *", "timezone": "Nowhere/Land"}, "time zone"),
        ({"cron": "* * * * *", "overlap": "queue"}, "overlap"),
        ({"cron": "* * * * *", "catch_up": timedelta(seconds=-1)}, "catch_up"),
        ({"cron": "* * * * *", "id": "a b"}, "schedule id"),
        ({"cron": "* * * * *", "args": [object()]}, "JSON"),
        ({"cron": "* * * * *", "args": ["eu", "us"]}, "too many positional arguments"),
        ({"cron": "* * * * *", "kwargs": {"nope": 1}}, "unexpected keyword argument"),
    ],
)
def test_a_bad_definition_is_refused_and_stores_nothing(
    wf: Workflows, options: dict[str, object], message: str
) -> None:
    values: dict[str, object] = {"id": "bad", "args": ["eu"], **options}
    with pytest.raises(InvalidSchedule, match=message) as raised:
        wf.schedule("reports.daily", **values)  # type: ignore[arg-type]
    assert isinstance(raised.value, ConfigurationError)
    assert wf.schedules.list() == []


def test_the_ticker_starts_one_run_per_tick_with_the_schedules_arguments(wf: Workflows) -> None:
    start = datetime(2026, 1, 1, 0, 0, 50, tzinfo=UTC)
    wf.schedule_clock = SpedUpClock(start, factor=60.0)  # a minute a second
    wf.schedule("reports.daily", cron="* * * * *", id="often", args=["us"], overlap="allow")
    ticker = start_ticker(wf)
    assert ticker is not None
    try:
        worker = LocalWorker(wf)
        first, second = (tick_run_id("often", start + timedelta(seconds=10 + 60 * n)) for n in range(2))

        def started() -> bool:
            return {r.id for r in wf.list_runs()} >= {first, second}

        worker.run_until(started, timeout=10)
    finally:
        begun = time.monotonic()
        ticker.stop()
        assert time.monotonic() - begun < 2
    worker.run_until_idle()
    assert wf.get_run(first).result(timeout=5) == "us:False"
    assert wf.get_run(first).status == RunStatus.COMPLETED
    assert wf.schedules.get("often").last_run_id is not None


def test_no_ticker_for_an_app_without_workflows() -> None:
    bare = Workflows(Celery("schedules-bare"), MemoryWorld(), broker="app")
    assert start_ticker(bare) is None


def test_a_schedule_whose_start_fails_does_not_stop_the_others(wf: Workflows) -> None:
    from celery_workflow.schedules import Ticker, WorldStarter, schedules_of

    clock = SpedUpClock(datetime(2026, 1, 1, 0, 0, 59, tzinfo=UTC), factor=1.0)
    wf.schedule_clock = clock
    wf.schedule("reports.daily", cron="* * * * *", id="a-broken", args=["x"])
    wf.schedule("reports.daily", cron="* * * * *", id="b-fine", args=["eu"])
    store = schedules_of(wf.world)
    assert store is not None
    started: list[str] = []

    def start(name: str, args: Sequence[Any], kwargs: Mapping[str, Any], run_id: str) -> bool:
        if run_id.startswith("a-broken@"):
            raise WorldUnavailable("the World did not answer")
        wf.runtime.start(name, args, kwargs, run_id=run_id)
        started.append(run_id)
        return True

    starter = WorldStarter(lambda n: True, start, lambda r: wf.world.get_run(r).status, wf.runtime.cancel)
    fast = SpedUpClock(datetime(2026, 1, 1, 0, 1, 1, tzinfo=UTC), factor=1.0)
    reports, _ = Ticker(store, starter, clock=fast).tick()
    assert [r.schedule_id for r in reports] == ["b-fine"] and started == ["b-fine@2026-01-01T00:01:00Z"]
    assert wf.schedules.get("a-broken").lease_holder is not None  # left to its lease: tried again when it runs out
