"""The AWS World keeps no step items (issue #31, item 2): a step's view is folded from the run's log, and must be the
view the transition rules planned when the events were appended."""

from __future__ import annotations

from datetime import timedelta

from celery_workflow import ids, rules
from celery_workflow._aws.log import step_views
from celery_workflow.events import Event, EventType, NewEvent

ERROR = {"type": "ValueError", "message": "no", "traceback": None}


def test_the_log_gives_the_views_the_rules_planned() -> None:
    t0 = ids.utcnow()
    run, first = rules.new_run("wrun_fold", {"workflow_name": "wf", "input": {"args": [], "kwargs": {}}}, t0)
    snapshot = rules.Snapshot(run)
    log: list[Event] = [first]
    later = t0 + timedelta(seconds=10)
    batches = [
        [NewEvent(EventType.RUN_STARTED, None, {})],
        [
            NewEvent(EventType.STEP_CREATED, "a", {"step_name": "add", "input": {"args": [1], "kwargs": {}}}),
            NewEvent(EventType.STEP_CREATED, "b", {"step_name": "sub", "input": [2], "queue": "slow"}),
            NewEvent(EventType.STEP_CREATED, "c", {"step_name": "mul", "input": None}),
        ],
        [NewEvent(EventType.STEP_STARTED, "a", {"owner": "d1"})],
        [NewEvent(EventType.STEP_RETRYING, "a", {"error": ERROR, "retry_after": ids.isoformat(later)})],
        [NewEvent(EventType.STEP_STARTED, "a", {"owner": "d2"}), NewEvent(EventType.STEP_STARTED, "b", {})],
        [
            NewEvent(EventType.STEP_COMPLETED, "a", {"result": {"n": 5}}),
            NewEvent(EventType.STEP_FAILED, "b", {"error": ERROR}),
        ],
    ]
    for i, batch in enumerate(batches, start=1):
        now = t0 + timedelta(seconds=i * 3)
        plan = rules.plan_append(snapshot, batch, now=now)
        log += plan.events
        snapshot = rules.advance(snapshot, plan)
    folded = step_views(log)
    assert folded == snapshot.steps
    assert list(folded) == ["a", "b", "c"]  # creation order
    assert folded["a"].attempt == 2 and folded["a"].retry_after is None and folded["a"].output == {"n": 5}
    assert folded["a"].started_at == t0 + timedelta(seconds=9)  # the first attempt's start
    assert folded["b"].status.value == "failed" and folded["c"].status.value == "pending"
    retrying = step_views(log[:7])["a"]  # up to the retry: what a reader of that prefix gets
    assert retrying.status.value == "pending" and retrying.error == ERROR and retrying.retry_after == later
