"""A run inspector in the browser: server-rendered pages over the World protocol, so it works on every World.

    flask_app.register_blueprint(api.inspector_blueprint(wf, authorize=check), url_prefix="/inspector")
    celery_workflow.inspector.server.serve(wf_or_world, port=8000)  # a server of its own (read-only by default)

Pages:

* ``/``: runs, newest first, filtered by workflow and status, paged with the World's cursors, with counts per status
  among the newest :data:`~.model.COUNT_WINDOW` runs (one bounded listing: the World protocol has no count);
* ``/runs/<id>``: status, input, output or error; a timeline of steps (attempts, durations, errors, queue), sleeps
  (due times) and hooks; live sleeps and hooks (tokens hidden unless revealed); the event log paged by slot; streams
  with a live tail;
* ``/runs/<id>/streams/<name>``: a stream's chunks, paged; ``…/tail``: the live tail, as server-sent events;
* ``/dead-letters``: the dead letters, with a redrive button each.

Actions (POST forms with a CSRF token): cancel a run, resume a hook with a JSON payload, redrive a dead letter. Who
may do what: :mod:`.guard` (without ``authorize`` the inspector is read-only unless ``allow_actions=True``).

The server of its own (:mod:`.server`: ``serve``, ``make_app``, ``as_workflows``) is not imported here: it wraps a
bare World in a :class:`~celery_workflow.app.Workflows`, and ``app`` reaches this package through
``Workflows.blueprint`` and ``api.inspector_blueprint`` (importing it here would close an import loop).
"""

from __future__ import annotations

from celery_workflow.inspector.factory import make_blueprint as blueprint

__all__ = ["blueprint"]
