"""The fan-out scenario's app: one workflow that gathers ``n`` parallel no-op steps (``bench/fanout.py``).

The World comes from ``CELERY_WORKFLOW_URL`` (``sqlite:///…``, ``postgresql://…``, ``aws://`` with the ``WORKFLOW_*``
variables of the Terraform module's environment output).
"""

from __future__ import annotations

from celery import Celery

from celery_workflow import Workflows, gather

celery_app = Celery("bench_fanout")
wf = Workflows(celery_app)


@wf.step
def leaf(i: int) -> int:
    return i


@wf.workflow
def fan(n: int) -> int:
    """Start ``n`` steps at once (one delivery each) and wait for them all."""
    return sum(gather(*[leaf.start(i) for i in range(n)]))
