"""HTTP edges: a Flask blueprint serving the RPC endpoint and the webhook endpoint.

    flask_app.register_blueprint(blueprint(wf), url_prefix="/v1/workflow")     # RPC + webhooks
    flask_app.register_blueprint(webhook_blueprint(wf), url_prefix="/hooks")   # webhooks alone (public)
    CeleryWorkflow(flask_app, wf)                                              # extension form

``POST {prefix}/rpc`` takes ``{"method": ..., "params": {...}}`` (methods in :data:`METHODS`) and answers JSON:
``{"result": ...}`` or ``{"error": {"code", "message"}}`` with 400 (malformed body or invalid params), 404 (unknown
method, workflow, run or token), 405 (not POST), 409 (conflict), 413 (too large), 503 (the World is unreachable).
Bad input never yields a 500 and never changes anything.

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
  (``hook_not_found``, one message), so a plain hook's existence is not revealed.

There is no authentication here: expose only :func:`webhook_blueprint` publicly, and wrap :func:`rpc_blueprint` in
your own authentication (a ``before_request`` on the blueprint, or a private network). This is the only module that
knows Flask.
"""

from __future__ import annotations

import base64
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from celery_workflow import codec
from celery_workflow.errors import (
    CeleryWorkflowError,
    EventConflict,
    EventInvalid,
    HookNotFound,
    NotFound,
    PayloadError,
    PayloadTooLarge,
    RunNotFound,
    TooEarly,
    WorkflowNotFound,
    WorldError,
)
from celery_workflow.events import Event, RunStatus, RunView, StepView
from celery_workflow.ids import isoformat
from celery_workflow.runtime.context import WebhookRequest
from celery_workflow.runtime.continuation import continued_as

try:
    from flask import Blueprint, Flask, Response, current_app, request
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    from celery_workflow.errors import ConfigurationError

    raise ConfigurationError("the HTTP edges need Flask: pip install 'celery-workflow[flask]'") from exc

if TYPE_CHECKING:
    from celery_workflow.app import Workflows

#: Room for the JSON envelope (method, parameter names, escapes) an RPC body may take beyond the World's
#: ``max_payload``. With ``max_body=None`` (the default) the RPC endpoint accepts ``world.max_payload + BODY_ROOM``
#: bytes and a webhook ``world.max_payload * 3 // 4`` (its body is stored base64-encoded): what the World can store.
#: A value that passes the body limit but not the World's (non-ASCII sent as ``\u`` escapes, large headers) is
#: still refused with 413 before anything is written; pass ``max_body=`` to choose another limit.
BODY_ROOM = 64 * 1024
#: Longest a single RPC call may block (``wait`` of get_run / read_stream).
MAX_WAIT = 30.0
#: How long a webhook caller waits for a ``respond_with="manual"`` response.
WEBHOOK_RESPONSE_TIMEOUT = 30.0
EXTENSION_KEY = "celery_workflow"
#: The largest ``list_runs`` answer: a page is cut short (with a cursor to the rest) rather than grow past it.
MAX_RESPONSE = 8 * 1_048_576
#: ``authorize(request, method)``: True lets the RPC call through.
Authorize = Callable[[Any, str], bool]

log = logging.getLogger("celery_workflow.api")


# -- params ------------------------------------------------------------------------------------------------------------


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    return value


#: An id, token, name or cursor: no NUL (SQL text columns refuse it; it is bad input, not an outage).
Text = Annotated[str, AfterValidator(_no_nul)]
#: Positions and counts are 64-bit integers in every World.
MAX_INT64 = 2**63 - 1
RunId = Field(min_length=1, max_length=200)


class StartParams(_Params):
    workflow: Text = Field(min_length=1, max_length=200)
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    run_id: Text | None = Field(default=None, min_length=1, max_length=200)


class GetRunParams(_Params):
    run_id: Text = RunId
    wait: float = Field(default=0.0, ge=0.0, le=MAX_WAIT)


class ListRunsParams(_Params):
    workflow: Text | None = Field(default=None, max_length=200)
    status: Literal["pending", "running", "completed", "failed", "cancelled"] | None = None
    limit: int = Field(default=100, ge=1, le=1000)
    cursor: Text | None = Field(default=None, max_length=400)


class ListEventsParams(_Params):
    run_id: Text = RunId
    after_slot: int = Field(default=0, ge=0, le=MAX_INT64)
    limit: int = Field(default=1000, ge=1, le=1000)


class RunParams(_Params):
    run_id: Text = RunId


class CancelParams(_Params):
    run_id: Text = RunId
    reason: str | None = Field(default=None, max_length=1000)


class ResumeHookParams(_Params):
    token: Text = Field(min_length=1, max_length=512)
    payload: Any = None


class ReadStreamParams(_Params):
    run_id: Text = RunId
    name: Text = Field(default="default", min_length=1, max_length=512)
    start: int = Field(default=0, ge=0, le=MAX_INT64)
    limit: int = Field(default=100, ge=1, le=1000)
    wait: float = Field(default=0.0, ge=0.0, le=MAX_WAIT)


# -- JSON views --------------------------------------------------------------------------------------------------------


def _time(value: Any) -> str | None:
    return None if value is None else isoformat(value)


def run_json(run: RunView) -> dict[str, Any]:
    return {
        "run_id": run.run_id,
        "workflow_name": run.workflow_name,
        "status": run.status.value,
        "input": run.input,
        "output": run.output,
        "error": run.error,
        "queue": run.queue,
        "event_count": run.event_count,
        "created_at": _time(run.created_at),
        "updated_at": _time(run.updated_at),
        "started_at": _time(run.started_at),
        "completed_at": _time(run.completed_at),
    }


def event_json(ev: Event) -> dict[str, Any]:
    return {
        "slot": ev.slot,
        "event_type": ev.event_type.value,
        "correlation_id": ev.correlation_id,
        "data": dict(ev.data),
        "created_at": _time(ev.created_at),
    }


def step_json(step: StepView) -> dict[str, Any]:
    return {
        "step_id": step.step_id,
        "step_name": step.step_name,
        "status": step.status.value,
        "attempt": step.attempt,
        "input": step.input,
        "output": step.output,
        "error": step.error,
        "created_at": _time(step.created_at),
        "started_at": _time(step.started_at),
        "completed_at": _time(step.completed_at),
        "retry_after": _time(step.retry_after),
    }


def chunk_json(index: int, data: bytes) -> dict[str, Any]:
    value = codec.loads(data)
    if isinstance(value, bytes):
        return {"index": index, "bytes_b64": base64.b64encode(value).decode()}
    return {"index": index, "value": value}


# -- the RPC methods ---------------------------------------------------------------------------------------------------


class _Methods:
    def __init__(self, wf: Workflows) -> None:
        self.wf = wf

    def start(self, p: StartParams) -> dict[str, Any]:
        view, created = self.wf.runtime.start(p.workflow, p.args, p.kwargs, run_id=p.run_id)
        return {"run": run_json(view), "created": created}

    def get_run(self, p: GetRunParams) -> dict[str, Any]:
        world = self.wf.world
        view = world.wait_for_terminal(p.run_id, p.wait) if p.wait > 0 else world.get_run(p.run_id)
        run = run_json(view)
        successor = continued_as(world, view)
        if successor is not None:
            run["continued_as"] = successor  # the run handed over to it (continue_as_new): its result is the chain's
        return {"run": run}

    def list_runs(self, p: ListRunsParams) -> dict[str, Any]:
        """A page of at most ``limit`` runs and at most :data:`MAX_RESPONSE` bytes: a page over it is asked again
        with half the limit (the World's own cursor then points after its last run)."""
        limit = p.limit
        while True:
            page = self.wf.world.list_runs(workflow=p.workflow, status=p.status, limit=limit, cursor=p.cursor)
            runs = [run_json(r) for r in page.items]
            if limit == 1 or len(json.dumps(runs, default=str)) <= MAX_RESPONSE:
                return {"runs": runs, "cursor": page.cursor}
            limit = max(1, limit // 2)

    def list_events(self, p: ListEventsParams) -> dict[str, Any]:
        events = self.wf.world.list_events(p.run_id, after_slot=p.after_slot, limit=p.limit + 1)
        more = len(events) > p.limit
        events = events[: p.limit]
        return {"events": [event_json(e) for e in events], "cursor": events[-1].slot if more else None}

    def list_steps(self, p: RunParams) -> dict[str, Any]:
        return {"steps": [step_json(s) for s in self.wf.world.list_steps(p.run_id)]}

    def cancel(self, p: CancelParams) -> dict[str, Any]:
        return {"run": run_json(self.wf.runtime.cancel(p.run_id, p.reason))}

    def resume_hook(self, p: ResumeHookParams) -> dict[str, Any]:
        hook = self.wf.runtime.resume_hook(p.token, p.payload)
        return {"hook": {"run_id": hook.run_id, "hook_id": hook.hook_id, "token": hook.token}}

    def read_stream(self, p: ReadStreamParams) -> dict[str, Any]:
        self.wf.world.get_run(p.run_id)  # 404 for an unknown run rather than an empty stream
        page = self.wf.world.read_stream(p.run_id, p.name, start=p.start, limit=p.limit, wait=p.wait)
        return {
            "chunks": [chunk_json(c.index, c.data) for c in page.chunks],
            "closed": page.closed,
            "next_index": page.next_index,
        }


METHODS: dict[str, type[_Params]] = {
    "start": StartParams,
    "get_run": GetRunParams,
    "list_runs": ListRunsParams,
    "list_events": ListEventsParams,
    "list_steps": RunParams,
    "cancel": CancelParams,
    "resume_hook": ResumeHookParams,
    "read_stream": ReadStreamParams,
}


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
    if isinstance(exc, (PayloadError, EventInvalid)):
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


def default_max_body(wf: Workflows, *, webhook: bool = False) -> int:
    """The body limit ``max_body=None`` stands for: what ``wf``'s World can store (see :data:`BODY_ROOM`)."""
    limit = wf.runtime.max_payload
    return limit * 3 // 4 if webhook else limit + BODY_ROOM


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
    methods = _Methods(wf)

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
            body,
            request.query_string.decode("latin-1"),
            response_stream=stream,
        )
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


def _fixed_response(spec: dict[str, Any]) -> Response:
    """The fixed response of a webhook, checked by ``create_webhook``. A malformed one (a webhook recorded before
    that check) answers 202 after a warning: its request is recorded already."""
    from celery_workflow.errors import InvalidWebhookResponse
    from celery_workflow.runtime.context import check_response

    try:
        check_response(spec)
    except InvalidWebhookResponse as exc:
        log.warning("webhook fixed response ignored: %s", exc.message)
        return _accepted()
    body = spec.get("body", "")
    headers: dict[str, str] = dict(spec.get("headers", {}))
    payload = body if isinstance(body, str) else json.dumps(body)
    resp = Response(payload, status=spec.get("status", 200))
    for key, value in headers.items():
        resp.headers[key] = value
    if not isinstance(body, str) and "content-type" not in {k.lower() for k in headers}:
        resp.mimetype = "application/json"
    return resp


def _await_response(wf: Workflows, run_id: str, stream: str, timeout: float) -> Response:
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        page = wf.world.read_stream(run_id, stream, start=0, limit=1, wait=max(0.0, min(left, 5.0)))
        if page.chunks:
            spec = codec.loads(page.chunks[0].data)
            resp = Response(status=int(spec.get("status", 200)))
            if "body_b64" in spec:
                resp.set_data(base64.b64decode(spec["body_b64"]))
            elif "text" in spec:
                resp.set_data(spec["text"])
            else:
                resp.set_data(json.dumps(spec.get("json")))
                resp.mimetype = "application/json"
            for key, value in dict(spec.get("headers", {})).items():
                resp.headers[str(key)] = str(value)
            return resp
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
