"""Changed versions of workflows of :mod:`tests.histories.workflows`, as a careless upgrade might deploy them.

They are registered under the same workflow names on a separate :class:`~celery_workflow.Workflows` (``changed``)
and call the same steps, so that replaying a checked-in history with ``changed`` shows what a worker running this
code would do to a run recorded by the original: ``tests/unit/test_histories.py`` expects each to raise
:class:`~celery_workflow.errors.ReplayDivergence` against the histories named in its docstring.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from celery_workflow import Workflows, create_hook, gather, now, sleep, uuid4, workflow_metadata
from celery_workflow.testing import MemoryWorld
from tests.histories.workflows import (
    BASE_URL,
    Item,
    call_flaky_api,
    charge,
    lookup,
    reserve,
    square,
    stamp,
)

changed = Workflows(Celery("histories-changed"), world=MemoryWorld(), broker="app", base_url=BASE_URL)


@changed.workflow
def sequential(items: list[Item]) -> dict[str, Any]:
    """sequential.json: the two steps swapped (charge before reserving)."""
    order_id = str(uuid4())
    total = sum(item.qty * item.price for item in items)
    receipt = charge(order_id, total)
    count = reserve(order_id, items)
    return {"order_id": order_id, "count": count, "total": total, "receipt": receipt}


@changed.workflow
def retrying(request: str) -> dict[str, Any]:
    """retrying.json: the step called with other arguments."""
    return call_flaky_api(request.lower())


@changed.workflow
def sleeper(seconds: float) -> str:
    """sleep_woke.json, sleep_asleep.json: the sleep removed."""
    before = stamp("before", now().isoformat())
    after = stamp("after", now().isoformat())
    return f"{before} {after}"


@changed.workflow
def fan_out(n: int) -> int:
    """fan_out.json: a step added at the end (fan_out_waiting.json never got that far: it still replays)."""
    squares = gather(*[square.start(i) for i in range(n)])
    return square(sum(squares))


@changed.workflow
def approvals(needed: int) -> list[Any]:
    """hook_resumed.json: the same events, another output (stops after the first payload)."""
    hook = create_hook(token=f"approvals:{workflow_metadata().run_id}", metadata={"needed": needed})
    return [hook.wait()]


@changed.workflow
def recovers(key: str) -> dict[str, str]:
    """step_failed_caught.json: StepFailed no longer caught, so the run now fails where it completed."""
    return {"value": lookup(key)}


@changed.workflow
def waits_forever(order_id: str) -> str:
    """cancelled.json: a sleep added before the wait, where the recorded run was already waiting on its hook."""
    reserve(order_id, [Item("pen", 1, 150)])
    hook = create_hook(token=f"cancel:{order_id}")
    sleep(60)
    return str(hook.wait())
