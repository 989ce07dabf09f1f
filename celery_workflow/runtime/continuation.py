"""Hand-overs between runs (``continue_as_new``): successor ids, the successor's start gate, following a chain.

A run that calls :func:`celery_workflow.continue_as_new` ends with ``run_completed`` carrying ``continued_as`` (the
successor's id) and no output; the successor is the same workflow with the new arguments and a log of its own, its
``run_created`` naming its predecessor (``continues``). Two writes of two runs, never one transaction over both (so
it works alike on every World), made safe by the order and a gate:

1. the successor is created first, with only a *check* delivery due :data:`CHECK_AFTER` later;
2. the predecessor's completion is appended with the successor's wake-up, acking the delivery being handled.

The successor runs only once its predecessor's completion names it (:func:`gate`): its check delivery, coming before
that, waits again; finding the predecessor ended any other way (cancelled meanwhile, or a replay that moved on
without handing over), it cancels the successor. A crash between the two writes re-runs the predecessor's delivery,
which meets the successor it already created (same deterministic id) and appends the completion.
"""

from __future__ import annotations

import hashlib
import re
from datetime import timedelta
from typing import Literal

from celery_workflow.errors import NotFound
from celery_workflow.event_data import EventData, RunCompletedData, RunCreatedData
from celery_workflow.events import EventType, RunStatus, RunView
from celery_workflow.world import World

#: How long after its creation a successor checks that its predecessor handed over (normally it is woken at once).
CHECK_AFTER = timedelta(seconds=60)
#: Successor ids are ``<first run id>~<N>``; user-chosen run ids cannot contain ``~``, so they never collide.
SEPARATOR = "~"
_MAX_RUN_ID = 200
_NUMBERED = re.compile(r"^(?P<root>.+)~(?P<n>[0-9]+)$", re.DOTALL)


def successor_id(run_id: str, *, skip: int = 0) -> str:
    """The id of the run that ``run_id`` hands over to: ``<root>~<N+1>`` (``skip`` more when that one is taken).

    The root of a chain is its first run's id, cut and suffixed with a hash when the result would pass 200
    characters, so ids stay bounded along a chain of any length."""
    m = _NUMBERED.match(run_id)
    root, n = (m["root"], int(m["n"])) if m else (run_id, 0)
    suffix = f"{SEPARATOR}{n + 1 + skip}"
    if len(root) + len(suffix) > _MAX_RUN_ID:
        digest = hashlib.blake2b(root.encode(), digest_size=8).hexdigest()
        root = f"{root[:150]}-{digest}"
    return root + suffix


def predecessor_of(created: EventData) -> str | None:
    """The run a run's ``run_created`` event (its data) says it continues, if any."""
    return created.continues if isinstance(created, RunCreatedData) else None


def continued_as(world: World, view: RunView) -> str | None:
    """The successor a completed run handed over to, or None (one read of its last event, which is its
    ``run_completed``: an ended run takes no more events; no read for other runs)."""
    if view.status is not RunStatus.COMPLETED or view.output is not None:
        return None
    last = world.list_events(view.run_id, after_slot=max(0, view.event_count - 1))
    if not last or last[-1].event_type is not EventType.RUN_COMPLETED:
        return None
    return last[-1].data_as(RunCompletedData).continued_as


def gate(world: World, run: RunView, predecessor: str) -> Literal["go", "wait", "orphan"]:
    """Whether a successor not yet started may run: ``go`` once its predecessor's completion names it, ``wait``
    while the predecessor has not ended, ``orphan`` when it ended without handing over to this run."""
    try:
        pred = world.get_run(predecessor)
    except NotFound:
        return "orphan"
    if not pred.status.terminal:
        return "wait"
    return "go" if continued_as(world, pred) == run.run_id else "orphan"
