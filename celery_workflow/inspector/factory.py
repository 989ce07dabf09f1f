"""The inspector's Flask blueprint: its pages (:mod:`.views`), its actions (:mod:`.actions`), its guard
(:mod:`.guard`), its templates and stylesheet (package data under ``templates/`` and ``static/``)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from flask import Blueprint, Response, url_for
from werkzeug.exceptions import RequestEntityTooLarge

from celery_workflow.errors import CeleryWorkflowError
from celery_workflow.inspector import guard
from celery_workflow.inspector.actions import add_actions
from celery_workflow.inspector.queues import add_queue_views
from celery_workflow.inspector.schedules import add_schedule_views
from celery_workflow.inspector.views import TAIL_LIFETIME, Inspector, Problem, Settings, add_views, problem_of

if TYPE_CHECKING:
    from celery_workflow.app import Workflows

log = logging.getLogger("celery_workflow.inspector")


def make_blueprint(
    wf: Workflows,
    *,
    authorize: guard.Authorize | None = None,
    allow_actions: bool = False,
    name: str = "celery_workflow_inspector",
    tail_lifetime: float = TAIL_LIFETIME,
) -> Blueprint:
    """The run inspector for ``wf``; register it under a prefix, e.g. ``url_prefix="/inspector"``.

    ``authorize(request, action) -> bool`` guards every page (``"view"``), token reveals (``"reveal_token"``) and
    the actions (``"cancel"``, ``"resume_hook"``, ``"redrive"``, ``"pause_schedule"``), as ``api.rpc_blueprint``'s guards the RPC.
    Without it, the pages are open and reveals and actions are refused (403) unless ``allow_actions=True``.
    ``tail_lifetime``: the longest one live-tail answer streams (the browser reconnects after it).
    """
    if authorize is None:
        log.warning(
            "celery_workflow: inspector %r registered without authorize=: anyone who can reach it can read runs%s",
            name,
            " and cancel them, resume hooks and redrive dead letters" if allow_actions else " (actions are off)",
        )
    ins = Inspector(wf, guard.Guard(authorize, allow_actions), Settings(tail_lifetime=tail_lifetime))
    bp = Blueprint(name, __name__, template_folder="templates", static_folder="static", static_url_path="/assets")
    add_views(bp, ins)
    add_queue_views(bp, ins)
    add_schedule_views(bp, ins)
    add_actions(bp, ins)

    @bp.errorhandler(Problem)
    def on_problem(exc: Problem) -> Response:
        return ins.problem(exc)

    @bp.errorhandler(CeleryWorkflowError)
    def on_error(exc: CeleryWorkflowError) -> Response:
        return ins.problem(problem_of(exc))

    @bp.errorhandler(RequestEntityTooLarge)
    def on_too_large(exc: RequestEntityTooLarge) -> Response:
        return ins.problem(Problem(413, "the form's body is larger than the inspector accepts", "Too large"))

    @bp.after_request
    def finish(response: Response) -> Response:
        return guard.finish(response, url_for(".runs"))

    return bp
