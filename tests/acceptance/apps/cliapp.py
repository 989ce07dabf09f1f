"""The workflows `tests/integration/test_cli.py` looks at with `celery -A cliapp workflow …` and runs on a real
`celery -A cliapp worker`.

The World URL comes from CELERY_WORKFLOW_URL; CW_MARKERS is a folder where ``ship`` waits for the test's go-ahead
(``go-<order>``) between its two stream values, so a watcher is seen following the run while it runs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from celery import Celery

from celery_workflow import Workflows, create_hook, get_writable

celery_app = Celery("cliapp")
wf = Workflows(celery_app)
MARKERS = Path(os.environ.get("CW_MARKERS", "/tmp"))


@wf.step
def pack(order: str) -> str:
    return f"label-{order}"


@wf.step
def ship(order: str) -> None:
    progress = get_writable("progress")
    progress.write({"stage": "shipping", "order": order})
    deadline = time.monotonic() + 20
    while not (MARKERS / f"go-{order}").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no go-ahead for {order}")
        time.sleep(0.02)
    progress.write({"stage": "shipped", "order": order})
    progress.close()


@wf.workflow
def deliver(order: str) -> dict[str, str]:
    label = pack(order)
    ship(order)
    return {"order": order, "label": label}


@wf.step(max_retries=0)
def explode() -> None:
    raise ValueError("boom")


@wf.workflow
def fails() -> None:
    explode()


@wf.workflow
def waits(token: str) -> object:
    return create_hook(token=token).wait()
