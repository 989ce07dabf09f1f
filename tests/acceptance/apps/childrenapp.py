"""Child runs on real workers: a parent fans out to children (each with a step) and sums their results; a parent
whose child fails catches it. The World URL comes from CELERY_WORKFLOW_URL."""

from __future__ import annotations

from celery import Celery

from celery_workflow import FatalError, WorkflowFailed, Workflows, gather

celery_app = Celery("childrenapp")
wf = Workflows(celery_app, transport_options={"lease_seconds": 60.0})


@wf.step
def square(n: int) -> int:
    if n < 0:
        raise FatalError(f"no square of {n} here")
    return n * n


@wf.workflow
def child(n: int) -> int:
    return square(n)


@wf.workflow
def parent(count: int) -> int:
    return sum(gather(*[child.start(n) for n in range(count)]))


@wf.workflow
def careful(n: int) -> str:
    try:
        return str(child.start(n).result())
    except WorkflowFailed as exc:
        return f"child {exc.run_id} failed"
