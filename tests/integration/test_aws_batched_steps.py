"""On the AWS World every append is a paid TransactWriteItems, and the World asks for batched steps
(``AppendLimits.batch_steps``): the quick inline steps of a Lambda delivery share its appends (issue #31, item 1)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest

from celery_workflow import Workflows
from celery_workflow.aws_lambda import queue_handler
from celery_workflow.event_data import RunStartedData, StepCompletedData, StepCreatedData, StepStartedData
from celery_workflow.events import EventType, NewEvent
from celery_workflow.runtime import effects
from celery_workflow.world import AppendLimits
from celery_workflow.world_sqs import AWSWorld
from tests.integration.aws_fixtures import Aws, aws_fixture, moto_fixture, summing_app  # noqa: F401
from tests.integration.test_aws_kept_snapshots import calls
from tests.integration.test_aws_lambda import Context, invoke, sqs_event


@pytest.fixture(autouse=True)
def _quick_below(monkeypatch: pytest.MonkeyPatch) -> None:
    """A quick step is one that took less than 0.5 s (not 10 ms): a body descheduled on a loaded machine still is."""
    monkeypatch.setattr(effects, "HOLD_START_BELOW", 0.5)


def _drive(aws: Aws, wf: Workflows, n: int) -> Any:
    handler = queue_handler(wf)
    run = wf.start("sum_of", n)
    while not run.status.terminal:
        event = sqs_event(aws)
        if event["Records"]:
            invoke(aws, handler, event, Context(60))
    return run


def _transactions(aws: Aws, world: AWSWorld, n: int) -> tuple[Any, int]:
    """A run of ``n`` steps through the Lambda handler and the TransactWriteItems of its delivery (the run's creation
    left out)."""
    wf = summing_app(world, "batched-app")
    try:
        _drive(aws, wf, 2)  # the process learns the step is quick
        made = calls(aws.dynamodb)
        run = _drive(aws, wf, n)
        assert run.result() == sum(range(n))
        assert [e.event_type for e in run.events()] == [
            EventType.RUN_CREATED,
            EventType.RUN_STARTED,
            *[EventType.STEP_CREATED, EventType.STEP_STARTED, EventType.STEP_COMPLETED] * n,
            EventType.RUN_COMPLETED,
        ]
        return run, made.count("TransactWriteItems") - 1
    finally:
        wf.close()


def _steps_per_append(limits: AppendLimits) -> int:
    """How many quick steps one append takes beside a run's start, as the World's limits count them."""
    step = [
        NewEvent.of(StepCreatedData(step_name="add", input={"args": [0, 0]}, mode="inline"), "step:add:1"),
        NewEvent.of(StepStartedData(owner="d"), "step:add:1"),
        NewEvent.of(StepCompletedData(result=0), "step:add:1"),
    ]
    n = 0
    while limits.fits(*limits.cost([NewEvent.of(RunStartedData()), *step * (n + 1)], [])):
        n += 1
    return n


def test_ten_quick_steps_share_the_deliverys_appends(aws: Aws) -> None:
    world = aws.world()
    assert world.append_limits.batch_steps
    _, transactions = _transactions(aws, world, 10)
    # one append per batch as big as the World's limits allow: APPEND_LIMITS counts each step's start and result as
    # an update of its step item at DynamoDB's 400 KB (what the item may hold), so four steps fit in 4 MB today (3
    # transactions for 10 steps); limits that count less let the whole delivery be one or two
    per_append = _steps_per_append(world.append_limits)
    assert per_append >= 4
    assert transactions <= max(2, math.ceil(10 / per_append))


def test_without_batched_steps_each_step_is_a_transaction(aws: Aws) -> None:
    world = aws.world()
    world.append_limits = replace(world.append_limits, batch_steps=False)  # the SQL Worlds' way
    _, transactions = _transactions(aws, world, 10)
    assert transactions == 10  # the first step's start rides with the run's; each other step's is an append
