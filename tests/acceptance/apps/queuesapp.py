"""An app whose workflows use several queues, for `celery -A queuesapp worker` with and without ``-Q`` (issue #27,
items 10 and 11).

``routed`` is routed to ``backfill`` (a route), its step ``doubled`` runs on ``bulk`` (a step's queue); ``extra`` is
only declared (``queues=``); ``plain`` runs on the default queue. ``pool_size`` reports the World's pool bound in the
process that runs it (a prefork child). The World URL comes from CELERY_WORKFLOW_URL; CW_CONCURRENCY, when set, is
the Postgres World's ``concurrency``.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from celery_workflow import Workflows
from celery_workflow.world import open_world

URL = os.environ["CELERY_WORKFLOW_URL"]
concurrency = os.environ.get("CW_CONCURRENCY")
celery_app = Celery("queuesapp")
wf = Workflows(
    celery_app,
    open_world(URL, concurrency=int(concurrency)) if concurrency else URL,
    routes={"routed": "backfill"},
    queues=["backfill", "bulk", "extra"],
)


@wf.step(queue="bulk")
def doubled(x: int) -> int:
    return x * 2


@wf.workflow
def routed(x: int) -> int:
    return doubled.start(x).result() + 1


@wf.workflow
def plain(x: int) -> int:
    return x


@wf.step
def pool_bound() -> dict[str, Any]:
    db = getattr(wf.world, "db", None)
    return {"pid": os.getpid(), "max_size": None if db is None else db.pool.max_size}


@wf.workflow
def pool_size() -> dict[str, Any]:
    return pool_bound()
