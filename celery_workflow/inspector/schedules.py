"""The inspector's schedules page (issue #30, item 3): every schedule of the World, with its workflow, cron expression
and time zone, state, next tick and last run, and pause / resume forms (the ``"pause_schedule"`` action, admitted as
every action is: the guard, then the CSRF check; see :mod:`.guard`). A World that keeps no schedules says so."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flask import Blueprint, Response, redirect, url_for
from werkzeug.wrappers import Response as Redirect

from celery_workflow.errors import ScheduleNotFound
from celery_workflow.inspector import guard
from celery_workflow.schedules import Schedules, schedules_of

if TYPE_CHECKING:
    from celery_workflow.inspector.views import Inspector

__all__ = ["add_schedule_views"]


def add_schedule_views(bp: Blueprint, ins: Inspector) -> None:
    from celery_workflow.inspector.views import Problem

    @bp.get("/schedules")
    def schedules() -> Response:
        ins.check(guard.VIEW)
        if schedules_of(ins.world) is None:
            return ins.page("schedules.html", schedules=[], unavailable="This World keeps no schedules.")
        return ins.page("schedules.html", schedules=ins.wf.schedules.list(), unavailable=None)

    def change(schedule_id: str, paused: bool) -> Redirect:
        ins.check(guard.SCHEDULE)
        problem = guard.csrf_problem()
        if problem is not None:
            raise Problem(403, problem, "Form refused")
        manager: Schedules = ins.wf.schedules
        try:
            manager.pause(schedule_id) if paused else manager.resume(schedule_id)
        except ScheduleNotFound:
            raise Problem(404, f"no schedule {schedule_id}") from None
        return redirect(url_for(".schedules"), 303)

    @bp.post("/schedules/<schedule_id>/pause")
    def pause_schedule(schedule_id: str) -> Redirect:
        return change(schedule_id, True)

    @bp.post("/schedules/<schedule_id>/resume")
    def resume_schedule(schedule_id: str) -> Redirect:
        return change(schedule_id, False)
