"""The sleeping-runs scenario's app: a workflow that sleeps until a given time and returns how late it woke."""

from __future__ import annotations

from celery import Celery

from celery_workflow import Workflows, now, sleep

celery_app = Celery("bench_sleep")
wf = Workflows(celery_app)


@wf.workflow
def nap(due: float) -> float:
    """Sleep until ``due`` (a Unix time); return the seconds between ``due`` and the wake-up's write."""
    sleep(max(0.0, due - now().timestamp()))
    return now().timestamp() - due
