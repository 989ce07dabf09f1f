"""The workflows tests/acceptance/test_flower_truth.py runs on a real `celery -A flowerapp worker -E` watched by a
real Flower: a run that fails with FatalError, a queued step that fails once then succeeds, an inline step.

The World URL comes from CELERY_WORKFLOW_URL (or the AWS World's environment).
"""

from __future__ import annotations

from celery import Celery

from celery_workflow import FatalError, Workflows, step_metadata

celery_app = Celery("flowerapp")
wf = Workflows(celery_app, broker="world")


@wf.step(max_retries=0)
def declined(order: str) -> None:
    raise FatalError(f"card declined for {order}")


@wf.workflow
def fulfil(order: str) -> None:
    declined(order)  # inline: its attempt fails for good, and so does the run


@wf.step(max_retries=2, retry_backoff=0.2)
def charge(tag: str) -> str:
    attempt = step_metadata().attempt
    if attempt == 1:
        raise RuntimeError(f"gateway timeout on attempt {attempt} of {tag}")
    return f"{tag}@{attempt}"


@wf.workflow
def billing(tag: str) -> str:
    return charge.start(tag).result()  # a step delivery of its own: its first attempt is retried


@wf.step
def add(a: int, b: int) -> int:
    return a + b


@wf.workflow
def adding(n: int) -> int:
    return add(n, 1)  # inline
