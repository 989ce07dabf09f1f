"""A Celery app that keeps its own broker (RabbitMQ or Redis) and runs workflows over it through the relay
(``Workflows(..., broker="app")``), for ``test_relay``.

Configured from the environment: RELAY_BROKER_URL (the app's broker), RELAY_QUEUE (its default queue: a name of the
test's own on a shared broker), RELAY_OTHER_QUEUE (another queue, for a routed workflow), CELERY_WORKFLOW_URL (the World), CW_RELAY_LEASE (seconds a relayed delivery is leased
before it is published again: short, so a lost message comes back quickly) and CW_MARKERS (a folder the steps and
plain tasks write to).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from celery import Celery

from celery_workflow import RetryableError, Workflows, create_hook, sleep, step_metadata

celery_app = Celery("relayapp", broker=os.environ["RELAY_BROKER_URL"])
celery_app.conf.update(
    task_default_queue=os.environ["RELAY_QUEUE"],
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
)
wf = Workflows(
    celery_app,
    os.environ["CELERY_WORKFLOW_URL"],
    broker="app",
    relay_lease=float(os.environ.get("CW_RELAY_LEASE", "300")),
)
MARKERS = Path(os.environ.get("CW_MARKERS", "/tmp"))


@celery_app.task(name="relayapp.plain")
def plain(name: str, text: str) -> str:
    """An ordinary task of the app: it keeps running on the app's broker."""
    (MARKERS / name).write_text(text)
    return text


@wf.step(max_retries=3)
def charge(order: str) -> str:
    attempt = step_metadata().attempt
    (MARKERS / f"charge-{order}-{attempt}").touch()
    if attempt == 1:
        raise RetryableError("the bank is busy", retry_after=0.5)
    return f"rcpt-{order}@{attempt}"


@wf.step
def ship(order: str) -> str:
    return f"shipped-{order}"


@wf.workflow
def order(order_id: str, nap: float) -> dict[str, object]:
    receipt = charge(order_id)
    decision = create_hook(token=f"approve:{order_id}").wait()
    sleep(nap)
    return {"receipt": receipt, "decision": decision, "shipped": ship(order_id)}


@wf.step
def slow_once(tag: str) -> str:
    attempt = step_metadata().attempt
    (MARKERS / f"slow-{tag}-started-{attempt}").touch()
    deadline = time.monotonic() + 60
    while not (MARKERS / f"slow-{tag}-release").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return f"{tag}@{attempt}"


@wf.workflow
def killable(tag: str) -> str:
    return slow_once(tag)


@wf.step
def add(a: int, b: int) -> int:
    return a + b


@wf.workflow(queue=os.environ["RELAY_OTHER_QUEUE"])
def elsewhere(n: int) -> int:
    """A workflow routed to a queue of its own: only workers consuming it (``-Q``) run and relay it."""
    return add(n, 1)


@wf.workflow
def adding(n: int) -> int:
    total = 0
    for i in range(n):
        total = add(total, i)
    return total
