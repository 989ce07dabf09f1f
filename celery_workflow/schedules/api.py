"""The schedules' part of :class:`~celery_workflow.Workflows` (``wf.schedule(...)``, ``wf.schedules``,
``wf.schedule_clock``), a base class of it kept here so that ``app.py`` stays the Celery side."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from celery_workflow.errors import InvalidSchedule, PayloadError
from celery_workflow.schedules.manage import Schedules
from celery_workflow.schedules.model import Schedule
from celery_workflow.schedules.ticker import Clock, SystemClock

if TYPE_CHECKING:
    from celery_workflow.app import Workflow
    from celery_workflow.runtime.registry import Registry
    from celery_workflow.world import World

__all__ = ["Scheduling"]


class Scheduling:
    """Schedules on the World of a :class:`~celery_workflow.Workflows` (see :mod:`celery_workflow.schedules`)."""

    world: World
    registry: Registry
    #: The time schedules fire by (None: the real time; a :class:`~celery_workflow.schedules.SpedUpClock` in tests);
    #: the worker's ticker reads it.
    schedule_clock: Clock | None = None

    def schedule(
        self,
        workflow: Workflow[Any, Any] | str,
        *,
        cron: str,
        id: str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        timezone: str = "UTC",
        overlap: str = "skip",
        catch_up: timedelta | float = timedelta(minutes=1),
    ) -> Schedule:
        """Start a run of ``workflow`` at every tick of ``cron`` in ``timezone``, durably in the World (idempotent:
        see :mod:`celery_workflow.schedules.manage`); the workers' tickers fire it, one run per tick. The arguments
        of a workflow registered here are checked against its signature now (InvalidSchedule), not at its first
        tick."""
        name = workflow if isinstance(workflow, str) else workflow.name
        wdef = self.registry.workflows.get(name)
        if wdef is not None:
            try:
                encoded = wdef.signature.encode_args(args, kwargs or {})
            except PayloadError as exc:
                raise InvalidSchedule(f"schedule {id}: {exc}") from exc
            args, kwargs = encoded["args"], encoded["kwargs"]
        return self.schedules.define(
            id, name, cron, args=args, kwargs=kwargs, timezone=timezone, overlap=overlap, catch_up=catch_up
        )

    @property
    def schedules(self) -> Schedules:
        """List, show, pause, resume and delete this World's schedules."""
        return Schedules(self.world, self.schedule_clock or SystemClock())
