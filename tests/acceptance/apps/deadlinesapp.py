"""Deadlines on real workers: a step whose attempts hang past their timeout (Celery's soft time limit interrupts
them), and a run asleep past its deadline. The World URL comes from CELERY_WORKFLOW_URL."""

from __future__ import annotations

import time
from datetime import timedelta

from celery import Celery

from celery_workflow import StepFailed, Workflows, sleep

celery_app = Celery("deadlinesapp")
wf = Workflows(celery_app, transport_options={"lease_seconds": 60.0})


@wf.step(timeout=timedelta(seconds=1), max_retries=1, retry_backoff=0)
def hang(what: str) -> str:
    end = time.monotonic() + 120
    while time.monotonic() < end:  # far past the timeout: only the worker's time limit ends it
        time.sleep(0.05)
    return what


@wf.workflow
def call_hanging(what: str) -> dict[str, str]:
    try:
        return {"value": hang(what)}
    except StepFailed as exc:
        return {"type": exc.error_type, "message": str(exc.error.get("message", ""))}


@wf.workflow(timeout=timedelta(seconds=2))
def oversleeper() -> str:
    sleep(timedelta(hours=1))
    return "woke"
