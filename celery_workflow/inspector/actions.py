"""The inspector's POST actions: cancel a run, resume a hook with a JSON payload, redrive a dead letter.

Each is a form post, admitted in this order (:func:`admit`): the guard (``authorize(request, action)``, or
``allow_actions``; see :mod:`.guard`), the body size, the CSRF check. A success redirects (303) to the page the form
was on; anything else renders an error page and writes nothing: 400 bad input (a payload that is not JSON, with the
parser's message and the text sent), 401/403 refused, 404 unknown run, hook or dead letter, 409 a run that has
already ended, 413 too large.

* cancel: ``wf.runtime.cancel(run_id, reason)``, what ``Run.cancel`` and the RPC's ``cancel`` call;
* resume: ``wf.runtime.resume_hook(token, payload)``, what ``Workflows.resume_hook`` and the RPC call, for a live
  plain hook of the run (webhooks are resumed by a request to their URL). The token is looked up on the server: it
  never has to be revealed in the page;
* redrive: ``dead_letter_store(world).redrive_dead_letters([id])``, what ``celery-workflow dead-letters redrive``
  calls (the message goes back on its queue once, its delivery count reset).
"""

from __future__ import annotations

import json
from typing import Any

from flask import Blueprint, redirect, request, url_for
from werkzeug.wrappers import Response

from celery_workflow import codec
from celery_workflow.dead_letters import dead_letter_store
from celery_workflow.inspector import guard, model
from celery_workflow.inspector.views import Inspector, Problem, links, whole
from celery_workflow.rpc import default_max_body

#: The longest cancellation reason.
MAX_REASON = 1000
#: A form field's bytes may triple when URL-encoded (``%XX``): the body limit is this many times the World's.
FORM_ENCODING = 3


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_payload(text: str, back: str) -> Any:
    """The JSON value of a hook payload typed into the form; Problem 400 saying what is wrong, with the text and a
    link ``back`` to the form."""
    sent = codec.cut(text, model.MAX_SHOWN)
    if not text.strip():
        raise Problem(400, "the payload is empty: type a JSON value, e.g. {} or null", payload=sent, back=back)
    try:
        return json.loads(text, parse_constant=_no_constant)
    except ValueError as exc:
        raise Problem(400, f"the payload is not valid JSON: {exc}", payload=sent, back=back) from None
    except RecursionError:
        raise Problem(400, "the payload nests deeper than the JSON parser allows", payload=sent, back=back) from None


def add_actions(bp: Blueprint, ins: Inspector) -> None:
    limit = FORM_ENCODING * default_max_body(ins.wf)

    def admit(action: str) -> None:
        ins.check(action)
        length = request.content_length
        if length is not None and length > limit:
            raise Problem(413, f"the form's body of {length} bytes exceeds {limit} bytes", "Too large")
        request.max_content_length = limit  # a body without Content-Length is cut there (413)
        request.max_form_memory_size = limit
        problem = guard.csrf_problem()
        if problem is not None:
            raise Problem(403, problem, "Form refused")

    @bp.post("/runs/<run_id>/cancel")
    def cancel(run_id: str) -> Response:
        admit(guard.CANCEL)
        reason = request.form.get("reason", "").strip() or "cancelled in the run inspector"
        if len(reason) > MAX_REASON:
            raise Problem(400, f"the reason is longer than {MAX_REASON} characters")
        ins.wf.runtime.cancel(run_id, reason)
        return redirect(url_for(".run", run_id=run_id), 303)

    @bp.post("/runs/<run_id>/hooks/<hook_id>/resume")
    def resume(run_id: str, hook_id: str) -> Response:
        admit(guard.RESUME)
        text = request.form.get("payload", "")
        ins.world.get_run(run_id)  # 404 for an unknown run
        hook = next((h for h in ins.world.list_hooks(run_id) if h.hook_id == hook_id), None)
        if hook is None:
            raise Problem(404, f"run {run_id} has no live hook {hook_id} (it was disposed, or the run has ended)")
        if hook.is_webhook:
            raise Problem(
                400,
                f"{hook_id} is a webhook: it is resumed by a request to its URL",
                payload=codec.cut(text, model.MAX_SHOWN),
            )
        back = url_for(".run", run_id=run_id, _anchor="hooks")
        ins.wf.runtime.resume_hook(hook.token, parse_payload(text, back))
        return redirect(back, 303)

    @bp.post("/dead-letters/<letter_id>/redrive")
    def redrive(letter_id: str) -> Response:
        admit(guard.REDRIVE)
        store = dead_letter_store(ins.world)
        number = whole(letter_id)
        if number is None and letter_id.isdigit():  # more digits than any id has
            raise Problem(404, f"no dead letter {letter_id[:50]}")
        if not store.redrive_dead_letters([letter_id if number is None else number]):
            raise Problem(404, f"no dead letter {letter_id} (it was redriven or purged already)")
        return redirect(links(".dead_letters", redriven=letter_id), 303)
