"""HTTP edges: a Flask blueprint serving the RPC endpoint and the webhook endpoint.

    flask_app.register_blueprint(blueprint(wf), url_prefix="/v1/workflow")     # RPC + webhooks
    flask_app.register_blueprint(webhook_blueprint(wf), url_prefix="/hooks")   # webhooks alone (public)
    CeleryWorkflow(flask_app, wf)                                              # extension form

``POST {prefix}/rpc`` takes ``{"method": ..., "params": {...}}`` (methods in :data:`METHODS`) and answers JSON:
``{"result": ...}`` or ``{"error": {"code", "message"}}`` with 400 (malformed body or invalid params), 404 (unknown
method, workflow, run or token), 405 (not POST), 409 (conflict), 413 (too large), 503 (the World is unreachable).
Bad input never yields a 500 and never changes anything. What it answers is bounded (:mod:`celery_workflow.rpc`):

* ``start`` answers only the run's id, workflow and status, also when ``run_id`` names a run started before with the
  same workflow and arguments (``created`` false); the id of a run of another workflow or with other arguments is a
  409 that names neither;
* listings (``list_runs``, ``list_events``, ``list_steps``, ``read_stream``) are paged with cursors and at most
  ``rpc.MAX_RESPONSE`` bytes; in a page of more than one item a value over ``rpc.MAX_LISTED_VALUE`` bytes is left out
  and named in the item's ``truncated``; a page of one item (``limit=1``) and ``get_step`` answer values whole;
* hook tokens in event data are shown as ``"(hidden)"`` unless ``authorize(request, "reveal_token")`` allows them
  (without ``authorize``, never).

``ANY {prefix}/webhooks/<token>`` resumes a hook created with ``create_webhook()`` (plain hooks are not reachable
from outside: their tokens may be guessable). It answers 202, the webhook's fixed response, or, for
``respond_with="manual"``, the response a step gives with ``request.respond(...)`` (504 if none comes in time).
Webhooks are safe by default:

* a webhook answers **once**: its first accepted request is recorded, a later one gets ``410`` with the code
  ``webhook_used`` and records nothing; of two simultaneous first requests the World's append takes exactly one.
  A webhook the workflow iterates is created with ``create_webhook(many=True)`` and records every request;
* ``HEAD`` answers 204 with no body and ``OPTIONS`` 204 with ``Allow``; neither reads a body nor resumes the hook;
* the ``Authorization``, ``Cookie`` and ``Proxy-Authorization`` request headers are not recorded unless the webhook
  was created with ``keep_credentials=True``;
* an unknown token, a plain hook's token and a webhook whose run has ended all get the same ``404``
  (``hook_not_found``, one message), so a plain hook's existence is not revealed;
* the body limit holds as stated: with ``max_body=None`` a body of exactly :func:`default_max_body` bytes (binary
  or text: it is stored base64-encoded) is accepted and one byte more is ``413``, for a request whose method,
  headers and query string take at most :func:`webhook_room` bytes as recorded (more is ``431``
  ``request_headers_too_large``, recording nothing);
* a response, fixed or manual, is checked before it is sent: a status in 200-599, header names that are RFC 7230
  tokens, one-line Latin-1 values (no CR, LF or NUL), no ``Content-Length`` or ``Transfer-Encoding``. A manual
  response that fails gets the caller a ``500`` (``invalid_response``, a generic message) and is logged, and the
  step's ``request.respond`` raises ``InvalidWebhookResponse``. A str body without a ``Content-Type`` is sent as
  ``text/plain; charset=utf-8``, a JSON value as ``application/json``, bytes as ``application/octet-stream``.

There is no authentication here: expose only :func:`webhook_blueprint` publicly, and wrap :func:`rpc_blueprint` in
your own authentication (a ``before_request`` on the blueprint, or a private network). This is the only module that
knows Flask.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from celery_workflow import codec
from celery_workflow.errors import (
    CeleryWorkflowError,
    EventConflict,
    EventInvalid,
    HookNotFound,
    InvalidCursor,
    InvalidWebhookResponse,
    NotFound,
    PayloadError,
    PayloadTooLarge,
    RunNotFound,
    TooEarly,
    WorkflowNotFound,
    WorldError,
)
from celery_workflow.events import RunStatus
from celery_workflow.rpc import (  # the body limits live with the RPC's vocabulary; importable from here as before
    BODY_ROOM,
    METHODS,
    WEBHOOK_ROOM,
    InvalidParams,
    Methods,
    default_max_body,
    webhook_room,
)
from celery_workflow.runtime.context import (
    WebhookRequest,
    check_headers,
    check_response,
    check_status,
    response_body,
)

try:
    from flask import Blueprint, Flask, Response, current_app, request
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    from celery_workflow.errors import ConfigurationError

    raise ConfigurationError("the HTTP edges need Flask: pip install 'celery-workflow[flask]'") from exc

if TYPE_CHECKING:
    from celery_workflow.app import Workflows

__all__ = [
    "BODY_ROOM",
    "EXTENSION_KEY",
    "WEBHOOK_METHODS",
    "WEBHOOK_RESPONSE_TIMEOUT",
    "WEBHOOK_ROOM",
    "Authorize",
    "blueprint",
    "default_max_body",
    "error_response",
    "inspector_blueprint",
    "rpc_blueprint",
    "webhook_blueprint",
    "webhook_room",
]

#: How long a webhook caller waits for a ``respond_with="manual"`` response.
WEBHOOK_RESPONSE_TIMEOUT = 30.0
EXTENSION_KEY = "celery_workflow"
#: ``authorize(request, method)``: True lets the RPC call through.
Authorize = Callable[[Any, str], bool]

log = logging.getLogger("celery_workflow.api")


# -- errors ------------------------------------------------------------------------------------------------------------


def _error(status: int, code: str, message: str, **extra: Any) -> Response:
    body = {"error": {"code": code, "message": message, **extra}}
    return Response(json.dumps(body, default=str), status=status, mimetype="application/json")


def _ok(result: Any, status: int = 200) -> Response:
    return Response(json.dumps({"result": result}, default=str), status=status, mimetype="application/json")


def error_response(exc: BaseException) -> Response:
    """The JSON error answer for an exception raised while serving a call."""
    if isinstance(exc, WorkflowNotFound):
        return _error(404, "workflow_not_found", exc.message)
    if isinstance(exc, RunNotFound):
        return _error(404, "run_not_found", exc.message)
    if isinstance(exc, HookNotFound):
        return _error(404, "hook_not_found", exc.message)
    if isinstance(exc, NotFound):
        return _error(404, "not_found", exc.message)
    if isinstance(exc, PayloadTooLarge):
        return _error(413, "payload_too_large", exc.message)
    if isinstance(exc, (PayloadError, EventInvalid, InvalidParams, InvalidCursor)):
        return _error(400, "invalid_params", exc.message)
    if isinstance(exc, TooEarly):
        return _error(409, "too_early", exc.message)
    if isinstance(exc, EventConflict):
        return _error(409, "conflict", exc.message)
    if isinstance(exc, WorldError):
        return _error(503, "unavailable", exc.message)
    if isinstance(exc, CeleryWorkflowError):
        return _error(400, "invalid_request", exc.message)
    raise exc


def _read_body(limit: int) -> bytes | Response:
    length = request.content_length
    if length is not None and length > limit:
        return _error(413, "payload_too_large", f"request body of {length} bytes exceeds {limit} bytes")
    data = request.stream.read(limit + 1)
    if len(data) > limit:
        return _error(413, "payload_too_large", f"request body exceeds {limit} bytes")
    return data


# -- blueprints --------------------------------------------------------------------------------------------------------


def _rpc_view(wf: Workflows, max_body: int, authorize: Authorize | None) -> Callable[[], Response]:
    def may_reveal() -> bool:  # hook tokens in event data: only for a caller authorize lets see them
        return authorize is not None and bool(authorize(request, "reveal_token"))

    methods = Methods(wf, may_reveal)

    def rpc() -> Response:
        if request.method != "POST":
            resp = _error(405, "method_not_allowed", "the RPC endpoint takes POST")
            resp.headers["Allow"] = "POST"
            return resp
        if request.mimetype != "application/json":  # a browser form or a text/plain post never gets this far
            return _error(415, "unsupported_media_type", "the RPC endpoint takes Content-Type: application/json")
        body = _read_body(max_body)
        if isinstance(body, Response):
            return body
        try:
            doc = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            return _error(400, "invalid_request", f"the body is not JSON: {exc}")
        except RecursionError:
            return _error(400, "invalid_request", "the body nests deeper than the JSON parser allows")
        if not isinstance(doc, dict) or not isinstance(doc.get("method"), str):
            return _error(400, "invalid_request", 'the body must be {"method": "...", "params": {...}}')
        extra = set(doc) - {"method", "params"}
        if extra:
            return _error(400, "invalid_request", f"unknown top-level fields: {sorted(extra)}")
        name = doc["method"]
        if authorize is not None and not authorize(request, name):
            if "Authorization" not in request.headers:
                return _error(401, "unauthorized", f"{name}: credentials required")
            return _error(403, "forbidden", f"{name}: not allowed")
        model = METHODS.get(name)
        if model is None:
            return _error(404, "method_not_found", f"no RPC method {name!r}; methods: {sorted(METHODS)}")
        raw = doc.get("params", {})
        if not isinstance(raw, dict):
            return _error(400, "invalid_params", "params must be an object")
        try:
            params = model.model_validate(raw)
        except ValidationError as exc:
            details = [{"loc": list(e["loc"]), "msg": e["msg"]} for e in exc.errors()]
            return _error(400, "invalid_params", f"invalid params for {name}", details=details)
        try:
            return _ok(getattr(methods, name)(params))
        except CeleryWorkflowError as exc:
            return error_response(exc)
        except RecursionError:  # a payload nested deeper than encoding it allows
            return _error(400, "invalid_params", f"invalid params for {name}: nested too deeply")

    return rpc


#: The methods a webhook answers; HEAD and OPTIONS never resume it.
WEBHOOK_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def _no_webhook() -> Response:
    """The one answer for an unknown token, a plain hook's token and a webhook gone meanwhile: a plain hook's
    existence is not revealed."""
    return _error(404, "hook_not_found", "no webhook has this token")


def _webhook_view(wf: Workflows, max_body: int, response_timeout: float) -> Callable[[str], Response]:
    from celery_workflow.errors import WebhookUsed

    room = webhook_room(wf)

    def webhook(token: str) -> Response:
        if request.method == "OPTIONS":  # answered without looking the token up
            resp = Response(status=204)
            resp.headers["Allow"] = ", ".join(WEBHOOK_METHODS)
            return resp
        try:
            hook = wf.world.get_hook_by_token(token)
        except HookNotFound:
            return _no_webhook()
        except CeleryWorkflowError as exc:
            return error_response(exc)
        if not hook.is_webhook:
            return _no_webhook()
        if request.method == "HEAD":  # a probe: nothing is read, recorded or resumed
            return Response(status=204)
        body = _read_body(max_body)
        if isinstance(body, Response):
            return body
        manual = hook.respond_with == "manual"
        stream = f"__webhook_response__:{uuid.uuid4().hex}" if manual else None
        req = WebhookRequest.build(
            request.method,
            {k: v for k, v in request.headers.items()},
            b"",
            request.query_string.decode("latin-1"),
            response_stream=stream,
        )
        around = codec.encoded_size(req.to_payload())  # what the request takes beside its body, as recorded
        if around > room:
            return _error(
                431,
                "request_headers_too_large",
                f"the request's headers and query string take {around} bytes; a webhook records at most {room}",
            )
        req = WebhookRequest.build(req.method, req.headers, body, req.query, response_stream=stream)
        try:
            # The runtime drops credential headers unless the webhook keeps them, and a webhook that answers once
            # takes the first request the World's append accepts; a later or losing one is WebhookUsed.
            wf.runtime.resume_webhook(token, req, hook=hook)
        except WebhookUsed:
            return _error(410, "webhook_used", "this webhook answers once and has already had its request")
        except HookNotFound:
            return _no_webhook()
        except CeleryWorkflowError as exc:
            return error_response(exc)
        if stream is not None:
            return _await_response(wf, hook.run_id, stream, response_timeout)
        fixed = hook.respond_with
        if isinstance(fixed, dict):
            return _fixed_response(fixed)
        return _accepted()

    return webhook


def _accepted() -> Response:
    return Response(json.dumps({"accepted": True}), status=202, mimetype="application/json")


def _response(status: int, headers: dict[str, str], body: bytes, content_type: str) -> Response:
    """A checked webhook response; ``content_type`` unless ``headers`` set one."""
    resp = Response(body, status=status)
    for key, value in headers.items():
        resp.headers[key] = value
    if "content-type" not in {k.lower() for k in headers}:
        resp.headers["Content-Type"] = content_type
    return resp


def _fixed_response(spec: dict[str, Any]) -> Response:
    """The fixed response of a webhook, checked by ``create_webhook``. A malformed one (a webhook recorded before
    that check) answers 202 after a warning: its request is recorded already."""
    try:
        check_response(spec)
    except InvalidWebhookResponse as exc:
        log.warning("webhook fixed response ignored: %s", exc.message)
        return _accepted()
    body = spec.get("body", "")
    status, headers = spec.get("status", 200), check_headers(spec.get("headers", {}), "respond_with")
    if isinstance(body, str):
        return _response(status, headers, body.encode(), "text/plain; charset=utf-8")
    return _response(status, headers, json.dumps(body).encode(), "application/json")


def _manual_response(spec: Any) -> Response:
    """The response a step recorded with ``request.respond``, checked again here (a refused one is recorded as
    ``{"invalid": reason}``): InvalidWebhookResponse if it may not be sent."""
    if not isinstance(spec, dict):
        raise InvalidWebhookResponse(f"a manual response is a mapping, not {type(spec).__name__}")
    if "invalid" in spec:
        raise InvalidWebhookResponse(str(spec["invalid"]))
    status = check_status(spec.get("status", 200), "the response")
    headers = check_headers(spec.get("headers", {}), "the response")
    body, content_type = response_body(spec)
    return _response(status, headers, body, content_type)


def _await_response(wf: Workflows, run_id: str, stream: str, timeout: float) -> Response:
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        page = wf.world.read_stream(run_id, stream, start=0, limit=1, wait=max(0.0, min(left, 5.0)))
        if page.chunks:
            try:
                return _manual_response(codec.loads(page.chunks[0].data))
            except (InvalidWebhookResponse, PayloadError) as exc:
                log.error("run %s: its webhook response was refused: %s", run_id, exc.message)
                return _error(500, "invalid_response", "the workflow's response to this request was invalid")
        if left <= 0:
            return _error(504, "response_timeout", f"the workflow did not respond within {timeout:g} s")
        if wf.world.get_run(run_id).status in (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED):
            return _error(502, "no_response", "the run ended without responding")


def rpc_blueprint(
    wf: Workflows,
    *,
    name: str = "celery_workflow_rpc",
    max_body: int | None = None,
    authorize: Authorize | None = None,
) -> Blueprint:
    """The RPC endpoint alone: ``POST /rpc``, guarded by ``authorize(request, method) -> bool`` (denied: 401 when
    the request carries no ``Authorization`` header, 403 otherwise). Without ``authorize`` anyone who reaches it can
    start, cancel and resume runs: a warning says so, for an endpoint that is private by other means. ``max_body``:
    the largest request body (413 beyond); None: what the World can store (:func:`default_max_body`)."""
    if authorize is None:
        log.warning(
            "celery_workflow: RPC blueprint %r registered without authorize=: anyone who can reach it can start,"
            " cancel and resume runs",
            name,
        )
    bp = Blueprint(name, __name__)
    bp.add_url_rule(
        "/rpc",
        "rpc",
        _rpc_view(wf, default_max_body(wf) if max_body is None else max_body, authorize),
        methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
    )
    return bp


def inspector_blueprint(
    wf: Workflows,
    *,
    authorize: Authorize | None = None,
    allow_actions: bool = False,
    name: str = "celery_workflow_inspector",
) -> Blueprint:
    """The run inspector in the browser (:mod:`celery_workflow.inspector`): runs, a run's timeline, events, streams
    with a live tail, dead letters, and POST actions (cancel, resume a hook, redrive). ``authorize(request, action)``
    guards every page (``"view"``), token reveals (``"reveal_token"``) and the actions (``"cancel"``,
    ``"resume_hook"``, ``"redrive"``), with the same answers as :func:`rpc_blueprint`'s (401 / 403). Without it the
    pages are open and the inspector is read-only (reveals and actions get 403) unless ``allow_actions=True``."""
    from celery_workflow.inspector import blueprint as make

    return make(wf, authorize=authorize, allow_actions=allow_actions, name=name)


def webhook_blueprint(
    wf: Workflows,
    *,
    name: str = "celery_workflow_webhooks",
    max_body: int | None = None,
    response_timeout: float = WEBHOOK_RESPONSE_TIMEOUT,
) -> Blueprint:
    """The webhook endpoint alone: ``ANY /webhooks/<token>``; safe to expose publicly (authorised by its token).
    ``max_body``: the largest request body (413 beyond); None: what the World can store (:func:`default_max_body`)."""
    bp = Blueprint(name, __name__)
    bp.add_url_rule(
        "/webhooks/<path:token>",
        "webhook",
        _webhook_view(wf, default_max_body(wf, webhook=True) if max_body is None else max_body, response_timeout),
        methods=list(WEBHOOK_METHODS),  # HEAD and OPTIONS listed: the view answers them without resuming
    )
    return bp


def blueprint(
    wf: Workflows,
    *,
    name: str = "celery_workflow",
    max_body: int | None = None,
    authorize: Authorize | None = None,
) -> Blueprint:
    """RPC and webhooks together; register it under a prefix, e.g. ``url_prefix="/v1/workflow"``. ``authorize``
    guards the RPC (see :func:`rpc_blueprint`); webhooks are authorised by their tokens alone. ``max_body``: both
    endpoints' body limit; None gives each what the World can store (:func:`default_max_body`)."""
    bp = Blueprint(name, __name__)
    bp.register_blueprint(rpc_blueprint(wf, max_body=max_body, authorize=authorize))
    bp.register_blueprint(webhook_blueprint(wf, max_body=max_body))
    return bp


class CeleryWorkflow:
    """Flask extension form: ``CeleryWorkflow(app, wf)`` or ``ext = CeleryWorkflow(wf=wf); ext.init_app(app)``.

    Registers :func:`blueprint` under ``url_prefix`` and keeps the Workflows in ``app.extensions``; the extension
    object keeps no reference to the app.
    """

    def __init__(
        self,
        app: Flask | None = None,
        wf: Workflows | None = None,
        *,
        url_prefix: str = "/v1/workflow",
        authorize: Authorize | None = None,
    ) -> None:
        self.wf = wf
        self.url_prefix = url_prefix
        self.authorize = authorize
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask, wf: Workflows | None = None) -> None:
        workflows = wf or self.wf
        if workflows is None:
            raise TypeError("CeleryWorkflow needs the Workflows to serve")
        app.extensions[EXTENSION_KEY] = workflows
        app.register_blueprint(blueprint(workflows, authorize=self.authorize), url_prefix=self.url_prefix)

    @staticmethod
    def current() -> Workflows:
        """The Workflows of the current Flask app."""
        wf: Workflows = current_app.extensions[EXTENSION_KEY]
        return wf
