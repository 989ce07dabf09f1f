"""A run's first delivery carries the run's opening, so the worker that takes it need not read the run first.

``Runtime.start`` writes the run (``run_created``) and its first delivery in one transaction, so it knows exactly
what the log holds when that delivery arrives: one event, the run pending. It puts that event's data in the task
message's headers (``cw_opening``, only when small: :data:`LIMIT`), and the worker replays against it instead of
reading the run. Nothing is trusted that could be stale: every write of a replay is conditional on the event count
the replay has seen (1 here), so a run that moved meanwhile (cancelled, or already started by a duplicate of the
delivery) refuses the first write, and the handler reads the log and replays again as usual. The workflow code
observes nothing of the run before its first write (reading the clock or metadata writes the deferred
``run_started`` first), so a replay from the opening behaves exactly as one from the stored log.

What it saves is one read (a round trip, a DynamoDB query) per run; what it costs is the input's bytes once more in
the first message.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from celery_workflow.events import Event, EventType, RunStatus, RunView
from celery_workflow.ids import isoformat, parse_iso
from celery_workflow.world import NewRun

#: The task-message header that carries it.
HEADER = "cw_opening"
#: The largest opening carried, in bytes of JSON (larger inputs are read from the World as before).
LIMIT = 4096


def opening_of(run: NewRun, now: datetime) -> dict[str, Any] | None:
    """What a new run's first delivery carries: its ``run_created`` data and the time it was started (None when
    larger than :data:`LIMIT`)."""
    opening = {"data": run.event_data(), "at": isoformat(now)}
    try:
        size = len(json.dumps(opening, separators=(",", ":")))
    except (TypeError, ValueError):
        return None
    return opening if size <= LIMIT else None


def opened(run_id: str, opening: Any) -> tuple[RunView, list[Event]] | None:
    """The run and log a delivery's opening stands for (None for anything not an opening, so the log is read)."""
    if not isinstance(opening, Mapping):
        return None
    data, at = opening.get("data"), opening.get("at")
    if not isinstance(data, Mapping) or not isinstance(data.get("workflow_name"), str) or "input" not in data:
        return None
    try:
        created = parse_iso(str(at))
    except (TypeError, ValueError):
        return None
    queue = data.get("queue")
    run = RunView(
        run_id=run_id,
        workflow_name=str(data["workflow_name"]),
        status=RunStatus.PENDING,
        input=data["input"],
        queue=queue if isinstance(queue, str) else None,
        created_at=created,
        updated_at=created,
        event_count=1,
    )
    return run, [Event(run_id, 1, EventType.RUN_CREATED, None, dict(data), created)]
