"""Retention on the AWS World (seed aws-world.txt, "Retention") on a real moto server: an expiry delivery that
arrives before the run is due to expire is deferred (its ``QUEUE#expire-<runId>`` record kept, due later), never
lost; a run holding a token whose retention has not ended is kept until it ends."""

from __future__ import annotations

from datetime import timedelta

import pytest

from celery_workflow import ids
from celery_workflow.errors import RunNotFound
from celery_workflow.events import EventType, RunStatus
from celery_workflow.testing._conformance import create, ev, eventually
from celery_workflow.world_sqs import AWSWorld
from tests.integration.aws_fixtures import Aws, aws_fixture, moto_fixture  # noqa: F401

_EXPIRE = "celery-workflow-expire-"


def _expired(world: AWSWorld, run_id: str) -> bool | None:
    """Claim what is due (expiry deliveries are handled inside the World); True once the run is gone."""
    world.claim(["celery"], limit=10)
    try:
        world.get_run(run_id)
    except RunNotFound:
        return True
    return None


def _scheduled(aws: Aws, world: AWSWorld) -> list[str] | None:
    world.claim(["celery"], limit=10)
    names = [s["Name"] for s in aws.schedules() if s["Name"].startswith(_EXPIRE)]
    return names or None


def test_an_expiry_that_arrives_early_is_deferred_and_happens_later(aws: Aws, monkeypatch: pytest.MonkeyPatch) -> None:
    short = aws.world(retention=timedelta(seconds=1))
    run = create(short, run_id="wrun_deferred", started=True)
    short.append(run.run_id, [ev(EventType.RUN_COMPLETED, output=1)])  # its expiry is due in a second
    longer = aws.world(retention=timedelta(hours=1))  # the retention was lengthened meanwhile
    assert eventually(lambda: _scheduled(aws, longer), timeout=15, interval=0.1) == [f"{_EXPIRE}wrun_deferred"]
    assert longer.get_run(run.run_id).status is RunStatus.COMPLETED  # deferred: an hour after the run's end
    later = ids.utcnow() + timedelta(hours=2)
    assert aws.fire_due_schedules(later) == 1
    monkeypatch.setattr(ids, "utcnow", lambda: later)  # two hours pass
    eventually(lambda: _expired(longer, run.run_id), timeout=15, interval=0.1)
