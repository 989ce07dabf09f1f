"""Serving the inspector on its own: :func:`make_app` and :func:`serve` (``celery-workflow inspector``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from flask import Flask
from werkzeug.serving import make_server

from celery_workflow.errors import ConfigurationError
from celery_workflow.inspector import guard
from celery_workflow.inspector.factory import make_blueprint
from celery_workflow.world import World

if TYPE_CHECKING:
    from celery_workflow.app import Workflows

log = logging.getLogger("celery_workflow.inspector")

#: The names a browser may use for a server bound to a loopback address (anything else is refused with 400, so a
#: page of another site cannot reach it through DNS rebinding).
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")


def as_workflows(target: Workflows | World) -> Workflows:
    """``target`` itself, or a Workflows around a World.

    A World alone is wrapped with a Celery app of its own (``broker="app"``: the broker settings are left
    alone and no task is registered). The inspector only needs it to build the message that wakes a run whose hook it
    resumes: a ``workflow.<name>`` task message for the run's queue, which is the same whatever app builds it.
    """
    from celery_workflow.app import Workflows

    if isinstance(target, Workflows):
        return target
    if not isinstance(target, World):
        raise ConfigurationError(f"the inspector needs a Workflows or a World, not {type(target).__name__}")
    from celery import Celery  # the message builder only: no broker connection is made

    return Workflows(Celery("celery_workflow_inspector"), target, broker="app")


def make_app(
    target: Workflows | World,
    *,
    authorize: guard.Authorize | None = None,
    allow_actions: bool = False,
    trusted_hosts: Sequence[str] | None = None,
) -> Flask:
    """A Flask app serving the inspector at ``/`` for ``target`` (a Workflows or a World); ``trusted_hosts``: the
    only ``Host`` names it answers (Flask's ``TRUSTED_HOSTS``)."""
    app = Flask("celery_workflow.inspector", static_folder=None)
    if trusted_hosts is not None:
        app.config["TRUSTED_HOSTS"] = list(trusted_hosts)
    app.register_blueprint(make_blueprint(as_workflows(target), authorize=authorize, allow_actions=allow_actions))
    return app


def serve(
    target: Workflows | World,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    authorize: guard.Authorize | None = None,
    allow_actions: bool = False,
) -> None:
    """Serve the inspector for ``target`` (a Workflows or a World) until interrupted, one thread per request.

    Read-only unless ``allow_actions=True`` or ``authorize`` lets actions through (see :mod:`.guard`). Bound to a
    loopback address (the default), it answers only requests addressed to a loopback name. ``port=0`` picks a free
    port; the address is logged either way.
    """
    loopback = host in LOOPBACK_NAMES
    app = make_app(
        target,
        authorize=authorize,
        allow_actions=allow_actions,
        trusted_hosts=LOOPBACK_NAMES if loopback else None,
    )
    server = make_server(host, port, app, threaded=True)
    shown = f"[{host}]" if ":" in host else host
    log.warning("celery_workflow inspector: http://%s:%d/", shown, server.server_port)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
