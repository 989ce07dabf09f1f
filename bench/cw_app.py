"""celery_workflow side of the benchmark: no-op workflows of 1 and 10 steps on the Postgres World."""

from __future__ import annotations

import os

from celery import Celery

from celery_workflow import Workflows

celery_app = Celery("bench_cw")
wf = Workflows(celery_app, durability=os.environ.get("CW_DURABILITY", "delivery"))
if os.environ.get("CW_HAND_OFF") == "0":  # consumers leave no standing claims (bench/handoff.py)
    celery_app.conf.broker_transport_options = {**(celery_app.conf.broker_transport_options or {}), "hand_off": False}


@wf.step
def noop(i: int) -> int:
    return i


@wf.workflow
def one_step() -> int:
    return noop(0)


@wf.workflow
def ten_steps() -> int:
    total = 0
    for i in range(10):
        total += noop(i)
    return total
