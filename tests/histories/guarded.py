"""Changed versions of workflows of :mod:`tests.histories.workflows`, the changes guarded with ``patched()``.

The same changes as :mod:`tests.histories.changed` makes carelessly (steps swapped in ``sequential``, a step added at
the end of ``fan_out``), made safely: a run recorded by the original code keeps its recorded path, a run started on
this code takes the new one. ``tests/unit/test_patched.py`` replays the checked-in histories with this code.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from celery_workflow import Workflows, gather, patched, uuid4
from celery_workflow.testing import MemoryWorld
from tests.histories.workflows import BASE_URL, Item, charge, reserve, square

guarded = Workflows(Celery("histories-guarded"), world=MemoryWorld(), broker="app", base_url=BASE_URL)


@guarded.workflow
def sequential(items: list[Item]) -> dict[str, Any]:
    """sequential.json: charge before reserving, for runs started on this code."""
    order_id = str(uuid4())
    total = sum(item.qty * item.price for item in items)
    if patched("charge-first"):
        receipt = charge(order_id, total)
        count = reserve(order_id, items)
    else:
        count = reserve(order_id, items)
        receipt = charge(order_id, total)
    return {"order_id": order_id, "count": count, "total": total, "receipt": receipt}


@guarded.workflow
def fan_out(n: int) -> int:
    """fan_out.json, fan_out_waiting.json: the sum squared by one more step, for runs that get there on this code."""
    squares = gather(*[square.start(i) for i in range(n)])
    if patched("square-the-sum"):
        return square(sum(squares))
    return sum(squares)
