"""A plain Celery app (no workflows) for ``test_plain_celery``: the same tasks on Redis and on our transports.

Configured from the environment: PLAIN_BROKER_URL, PLAIN_TRANSPORT (a ``module:Class``; empty: Kombu's transport of
the URL's scheme), PLAIN_TRANSPORT_OPTIONS (JSON), PLAIN_BACKEND (the result backend: Redis) and PLAIN_RESULTS (a
JSON-lines file the tasks append what they saw to). Celery's defaults otherwise (``acks_late`` off, prefetch
multiplier 4), as a Celery user would start.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded

app = Celery("plainapp")
app.conf.update(
    broker_url=os.environ["PLAIN_BROKER_URL"],
    broker_transport=os.environ.get("PLAIN_TRANSPORT") or None,
    broker_transport_options=json.loads(os.environ.get("PLAIN_TRANSPORT_OPTIONS") or "{}"),
    broker_connection_retry_on_startup=True,
    result_backend=os.environ["PLAIN_BACKEND"],
    result_expires=600,
    worker_lost_wait=1.0,
)


def _record(task: Any, tag: str, **extra: Any) -> None:
    line = {"tag": tag, "at": time.time(), "pid": os.getpid(), "hostname": task.request.hostname, **extra}
    with open(os.environ["PLAIN_RESULTS"], "a") as f:
        f.write(json.dumps(line) + "\n")


@app.task
def add(a: int, b: int) -> int:
    return a + b


@app.task
def tsum(values: list[int]) -> int:
    return sum(values)


@app.task(bind=True)
def record(self: Any, tag: str) -> str:
    _record(self, tag)
    return tag


@app.task(bind=True)
def hold(self: Any, tag: str, seconds: float) -> str:
    _record(self, tag, phase="start")
    time.sleep(seconds)
    _record(self, tag, phase="done")
    return tag


@app.task(bind=True)
def retry_once(self: Any, tag: str) -> int:
    _record(self, tag, retries=self.request.retries)
    if self.request.retries == 0:
        raise self.retry(countdown=1, max_retries=3)
    return int(self.request.retries)


@app.task(bind=True, soft_time_limit=1, time_limit=10)
def soft_limited(self: Any, tag: str) -> str:
    _record(self, tag, phase="start")
    try:
        time.sleep(8)
    except SoftTimeLimitExceeded:
        return "soft limit"
    return "no limit"


@app.task(bind=True, time_limit=1)
def hard_limited(self: Any, tag: str) -> str:
    _record(self, tag, phase="start")
    time.sleep(8)
    return "no limit"


@app.task(bind=True, rate_limit="120/m")
def limited(self: Any, tag: str) -> str:
    _record(self, tag)
    return tag
