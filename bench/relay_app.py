"""The relay scenario's app (``bench/relay.py``): no-op workflows of 1 and 10 steps and a sleeper, on the Postgres
World at CELERY_WORKFLOW_URL, its deliveries carried by the World's transport (BENCH_BROKER=world) or relayed through
the app's own broker (BENCH_BROKER=<RabbitMQ or Redis URL>, ``broker="app"``), on queue BENCH_QUEUE."""

from __future__ import annotations

import os

from celery import Celery

from celery_workflow import Workflows, sleep

_broker = os.environ.get("BENCH_BROKER", "world")
celery_app = Celery("bench_relay", broker=None if _broker == "world" else _broker)
celery_app.conf.update(task_default_queue=os.environ.get("BENCH_QUEUE", "celery"), worker_prefetch_multiplier=1)
wf = Workflows(celery_app, broker="world" if _broker == "world" else "app")


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


@wf.workflow
def nap(seconds: float) -> int:
    sleep(seconds)
    return noop(1)
