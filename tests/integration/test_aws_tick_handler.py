"""The Lambda tick handler (``celery_workflow.aws_lambda.tick_handler``) on a moto server: on a deployment without
Celery workers, an invocation every minute fires the due schedules and sends the starts their writers left unsent;
one part failing leaves the other to run and is reported, both failing fail the invocation."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest

from celery_workflow import Workflows, ids
from celery_workflow._aws import starts as starts_module
from celery_workflow.aws_lambda import queue_handler, tick_handler
from celery_workflow.errors import TickFailed, WorldUnavailable
from celery_workflow.schedules import tick_run_id
from celery_workflow.testing.conformance_schedules import T0, ManualClock
from celery_workflow.world_sqs import AWSWorld
from tests.integration.aws_fixtures import Aws, aws_fixture, moto_fixture, summing_app  # noqa: F401
from tests.integration.test_aws_lambda import Context, invoke, sqs_event

FIRST_TICK = T0.replace(second=0) + timedelta(minutes=1)  # T0 is 00:00:30: the first tick of "* * * * *"


def _due_schedule(wf: Workflows) -> ManualClock:
    """``sum_of(2)`` scheduled every minute, its first tick due (the clock half a minute past it)."""
    clock = ManualClock()
    wf.schedule_clock = clock
    wf.schedule("sum_of", cron="* * * * *", id="every-minute", args=[2])
    clock.move(60)
    return clock


def _unsent_start(world: AWSWorld, wf: Workflows, monkeypatch: pytest.MonkeyPatch, run_id: str) -> None:
    """A run whose start was committed in its META but never sent (the send failed), made sweepable at once."""
    original = world.queue.send_body
    monkeypatch.setattr(world.queue, "send_body", lambda *a, **k: (_ for _ in ()).throw(WorldUnavailable("gone")))
    with pytest.raises(WorldUnavailable):
        wf.start("sum_of", 3, run_id=run_id)
    monkeypatch.setattr(world.queue, "send_body", original)
    monkeypatch.setattr(starts_module, "SWEEP_GRACE", timedelta(0))


def _finish(aws: Aws, wf: Workflows, run_id: str) -> Any:
    """Hand the queue's messages to the queue handler until the run ends; its result."""
    run, handler = wf.get_run(run_id), queue_handler(wf)
    for _ in range(50):
        if run.status.terminal:
            return run.result()
        event = sqs_event(aws)
        if event["Records"]:
            invoke(aws, handler, event, Context(60))
    raise AssertionError(f"run {run_id} did not end: {run.status}")


def _tick_of(when: datetime) -> str:
    return tick_run_id("every-minute", when)


def test_a_due_schedule_fires_one_run_and_a_second_invocation_nothing(aws: Aws) -> None:
    wf = summing_app(aws.world(), "tick-schedule-app")
    try:
        _due_schedule(wf)
        tick = tick_handler(wf)
        summary = tick({"source": "aws.scheduler"}, Context(60))
        assert summary == {"schedules_fired": 1, "runs_started": 1, "starts_sent": 0, "errors": {}}
        assert tick({}, Context(60)) == {"schedules_fired": 0, "runs_started": 0, "starts_sent": 0, "errors": {}}
        assert [r.run_id for r in wf.world.list_runs(workflow="sum_of").items] == [_tick_of(FIRST_TICK)]
        assert _finish(aws, wf, _tick_of(FIRST_TICK)) == 1
        assert wf.schedules.get("every-minute").last_run_id == _tick_of(FIRST_TICK)
    finally:
        wf.close()


def test_a_start_left_unsent_is_sent_and_its_run_completes(aws: Aws, monkeypatch: pytest.MonkeyPatch) -> None:
    world = aws.world()
    wf = summing_app(world, "tick-outbox-app")
    try:
        _unsent_start(world, wf, monkeypatch, "wrun_tick_unsent")
        assert sqs_event(aws)["Records"] == []  # nothing to hand a queue handler: it would never sweep
        tick = tick_handler(wf)
        assert tick({}, Context(60)) == {"schedules_fired": 0, "runs_started": 0, "starts_sent": 1, "errors": {}}
        assert tick({}, Context(60))["starts_sent"] == 0  # the windows overlap: sent once all the same
        assert _finish(aws, wf, "wrun_tick_unsent") == 3
    finally:
        wf.close()


def test_a_failing_ticker_leaves_the_sweep_to_run_and_is_reported(aws: Aws, monkeypatch: pytest.MonkeyPatch) -> None:
    world = aws.world()
    wf = summing_app(world, "tick-ticker-down-app")
    try:
        _due_schedule(wf)
        _unsent_start(world, wf, monkeypatch, "wrun_tick_ticker_down")
        tick = tick_handler(wf)
        store = world.schedule_store
        monkeypatch.setattr(store, "list_schedules", lambda: (_ for _ in ()).throw(WorldUnavailable("throttled")))
        summary = tick({}, Context(60))
        assert summary == {
            "schedules_fired": 0,
            "runs_started": 0,
            "starts_sent": 1,
            "errors": {"schedules": "WorldUnavailable: throttled"},
        }
        monkeypatch.undo()  # the store is back: the next minute fires the tick still within its catch-up
        assert tick({}, Context(60))["runs_started"] == 1
    finally:
        wf.close()


def test_a_failing_sweep_leaves_the_ticker_to_run_and_both_failing_fail_the_invocation(
    aws: Aws, monkeypatch: pytest.MonkeyPatch
) -> None:
    world = aws.world()
    wf = summing_app(world, "tick-sweep-down-app")
    try:
        _due_schedule(wf)
        tick = tick_handler(wf)
        monkeypatch.setattr(world, "sweep_outbox", lambda *a, **k: (_ for _ in ()).throw(WorldUnavailable("down")))
        summary = tick({}, Context(60))
        assert summary["runs_started"] == 1 and summary["errors"] == {"outbox": "WorldUnavailable: down"}
        store = world.schedule_store
        monkeypatch.setattr(store, "list_schedules", lambda: (_ for _ in ()).throw(WorldUnavailable("throttled")))
        with pytest.raises(TickFailed, match="schedules: WorldUnavailable: throttled; outbox: WorldUnavailable: down"):
            tick({}, Context(60))
    finally:
        wf.close()


def test_no_schedule_is_fired_past_half_the_invocations_time(aws: Aws) -> None:
    wf = summing_app(aws.world(), "tick-deadline-app")
    try:
        _due_schedule(wf)
        tick = tick_handler(wf)
        assert tick({}, Context(0))["schedules_fired"] == 0  # out of time: left due for the next minute
        assert wf.world.list_runs(workflow="sum_of").items == []
        assert tick({}, Context(60))["runs_started"] == 1
        assert ids.isoformat(wf.schedules.get("every-minute").last_tick) == ids.isoformat(FIRST_TICK)
    finally:
        wf.close()


def test_a_tick_seen_up_to_a_minute_past_its_catch_up_is_fired(aws: Aws) -> None:
    """The tick 00:01 seen at 00:02:10, 70 s late (its catch-up is a minute): the previous invocation, a minute
    before, could not see it, so it is fired, not skipped; 00:02 is skipped while its run goes on (overlap)."""
    wf = summing_app(aws.world(), "tick-late-app")
    try:
        clock = _due_schedule(wf)
        clock.move(40)
        assert tick_handler(wf)({}, Context(60))["runs_started"] == 1
        assert [r.run_id for r in wf.world.list_runs(workflow="sum_of").items] == [_tick_of(FIRST_TICK)]
    finally:
        wf.close()
