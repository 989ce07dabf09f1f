"""The payload-limit checks every real World passes (``test_payload_limits_*``): values of exactly the World's
``max_payload`` are stored, even beside an input as large; one byte more fails where it is produced, once, with
``PayloadTooLarge`` as the recorded cause; a huge error message is cut so the run still ends."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_workflow import StepFailed, WorkflowFailed, Workflows
from celery_workflow.codec import MAX_ERROR_MESSAGE
from celery_workflow.events import EventType
from celery_workflow.testing import LocalWorker
from celery_workflow.world import World

TOO_LARGE = "celery_workflow.errors.PayloadTooLarge"


def sized(n: int) -> str:
    """A string whose JSON encoding is ``n`` bytes."""
    return "x" * (n - 2)


def check_payload_limits(world: World, *, timeout: float = 30.0) -> None:
    wf = Workflows(Celery("payload-limits"), world=world, broker="app")
    worker = LocalWorker(wf)
    limit = world.max_payload
    pad = "p" * (limit - 200)  # an input about as large as the limit, stored beside each value
    calls: list[int] = []

    @wf.step(max_retries=3)
    def produce(text: str, n: int) -> str:
        calls.append(n)
        return sized(n)

    @wf.workflow
    def steps(text: str) -> dict[str, Any]:
        fits = produce(text, limit)
        try:
            produce(text, limit + 1)
        except StepFailed as exc:
            return {"fits": len(fits), "type": exc.error_type}
        return {"fits": len(fits)}

    @wf.workflow
    def output(text: str, n: int) -> str:
        return sized(n)

    @wf.workflow
    def raises(text: str) -> None:
        raise ValueError("m" * 1_000_000)

    run = steps.start(pad)
    worker.run_until_complete(run, timeout)
    assert run.result() == {"fits": limit - 2, "type": TOO_LARGE}
    assert calls == [limit, limit + 1]  # the oversized result's step ran once
    (failed,) = [e for e in run.events() if e.event_type is EventType.STEP_FAILED]
    assert failed.data["error"]["type"] == TOO_LARGE
    assert not [e for e in run.events() if e.event_type is EventType.STEP_RETRYING]

    fits = output.start(pad, limit)
    worker.run_until_complete(fits, timeout)
    assert len(fits.result()) == limit - 2

    over = output.start(pad, limit + 1)
    worker.run_until_complete(over, timeout)
    with pytest.raises(WorkflowFailed) as info:
        over.result()
    assert info.value.error["type"] == TOO_LARGE

    loud = raises.start(pad)
    worker.run_until_complete(loud, timeout)
    with pytest.raises(WorkflowFailed) as info:
        loud.result()
    assert len(info.value.error["message"].encode()) <= MAX_ERROR_MESSAGE
    assert "[truncated" in info.value.error["message"]
    assert worker.failures == []  # no append was refused and retried
