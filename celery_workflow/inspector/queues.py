"""The inspector's queues page: how many deliveries each queue of the app holds and how many workers consume it.

It reads the World's queue store through the broker contract (``size`` and ``consumers``, see
:mod:`celery_workflow._backend.queue_contract`); a World whose store cannot tell (none, or one without the member)
shows what it can and says what it cannot.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flask import Blueprint, Response

from celery_workflow import worker_setup
from celery_workflow.inspector import guard

if TYPE_CHECKING:
    from celery_workflow.inspector.views import Inspector


@dataclass(frozen=True, slots=True)
class QueueRow:
    name: str
    messages: int | None  # None: the store cannot count them
    consumers: int | None  # None: the store keeps no consumers


def queue_rows(inspector: Inspector) -> tuple[list[QueueRow], str | None]:
    """One row per queue the app may deliver to (the default queue first), and what cannot be told, if anything."""
    world = inspector.world
    store = getattr(world, "store", None)
    size: Callable[[str], int] | None = getattr(store, "size", None)
    consumers: Mapping[str, int] | None = worker_setup.queue_consumers(world)
    names = worker_setup.known_queues(inspector.wf)
    missing = []
    if not callable(size):
        missing.append("how many deliveries a queue holds")
    if consumers is None:
        missing.append("which workers consume a queue")
    rows = []
    for name in names:
        count = size(name) if callable(size) else None
        rows.append(QueueRow(name, count, None if consumers is None else consumers.get(name, 0)))
    note = f"This World's queue store cannot tell {' or '.join(missing)}." if missing else None
    return rows, note


def add_queue_views(bp: Blueprint, ins: Inspector) -> None:
    @bp.get("/queues")
    def queues() -> Response:
        """Depth and consumers per queue (a queue with deliveries and no consumer is flagged)."""
        ins.check(guard.VIEW)
        rows, note = queue_rows(ins)
        return ins.page("queues.html", rows=rows, note=note)
