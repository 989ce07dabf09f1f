"""The API user code calls inside workflows and steps.

Inside a workflow (during replay): ``sleep``, ``create_hook``, ``create_webhook``, ``gather``, ``now``, ``random``,
``uuid4``, ``workflow_metadata``; step calls and ``step.start(...)`` go through the active replay too.
Inside a step: ``get_writable``, ``step_metadata``. These read the active context from contextvars; nothing global.
"""

from __future__ import annotations

import base64
import json
import random as _random
import re
import uuid as _uuid
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Generic, NoReturn, Protocol, TypeVar

from celery_workflow import codec
from celery_workflow.errors import (
    CeleryWorkflowError,
    ConfigurationError,
    InvalidWebhookResponse,
    PayloadError,
    RunCancelled,
    StepFailed,
    WorkflowFailed,
)

if TYPE_CHECKING:
    from celery_workflow.runtime.replay import Replay
    from celery_workflow.world import World

T = TypeVar("T")


class NotInWorkflow(CeleryWorkflowError):
    """This function can only be called inside a workflow."""


class NotInStep(CeleryWorkflowError):
    """This function can only be called inside a step."""


@dataclass(frozen=True, slots=True)
class WorkflowMetadata:
    run_id: str
    workflow_name: str
    started_at: datetime
    url: str | None = None


@dataclass(frozen=True, slots=True)
class StepMetadata:
    """``step_id`` is stable across retries: use it as the idempotency key of external calls."""

    step_id: str
    step_name: str
    attempt: int
    run_id: str
    workflow_name: str
    started_at: datetime


@dataclass(slots=True)
class StepContext:
    world: World
    metadata: StepMetadata
    writers: dict[str, StreamWriter] = field(default_factory=dict)


class ContinueAsNew(BaseException):
    """Unwinds the workflow function (past user ``except Exception``): the run ends and a successor starts with these
    arguments and a fresh log (:func:`continue_as_new`; the replay turns it into its outcome)."""

    def __init__(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        super().__init__("continue_as_new")
        self.args_ = tuple(args)
        self.kwargs_ = dict(kwargs)


_replay: ContextVar[Replay | None] = ContextVar("celery_workflow_replay", default=None)
_step: ContextVar[StepContext | None] = ContextVar("celery_workflow_step", default=None)


def current_replay() -> Replay | None:
    return _replay.get()


def _require_replay(what: str) -> Replay:
    replay = _replay.get()
    if replay is None or _step.get() is not None:
        raise NotInWorkflow(f"{what}() can only be called inside a workflow")
    return replay


def _require_step(what: str) -> StepContext:
    ctx = _step.get()
    if ctx is None:
        raise NotInStep(f"{what}() can only be called inside a step")
    return ctx


# -- workflow API ----------------------------------------------------------------------------------------------------


def sleep(duration: float | timedelta) -> None:
    """Suspend the run for ``duration`` (seconds or a timedelta). Durable: no worker waits meanwhile."""
    seconds = duration.total_seconds() if isinstance(duration, timedelta) else float(duration)
    _require_replay("sleep").sleep(seconds)


def continue_as_new(*args: Any, **kwargs: Any) -> NoReturn:
    """End this run and start its successor, the same workflow called with ``args``/``kwargs`` and a fresh event log.

    For loops that run for weeks: a delivery replays its run's whole log, so a run's cost per delivery grows with
    its length; handing over every few hundred iterations keeps it flat. The run completes with no output and
    ``continued_as`` naming the successor (``Run.result()`` follows the chain to the last run's result). The
    successor's id is the first run's id with ``~N`` appended (N counting the hand-overs), so each hand-over
    happens once however often this delivery is retried, and the successor starts only once this run's completion
    is written. Hooks, sleeps and steps this run did not wait for end with it; pass on what the successor needs.
    """
    _require_replay("continue_as_new")
    raise ContinueAsNew(args, kwargs)


def now() -> datetime:
    """The run's deterministic clock: when the last event the workflow has observed was recorded."""
    return _require_replay("now").clock


def random() -> float:
    """A deterministic pseudo-random float in [0, 1), the same on every replay of the run."""
    return _require_replay("random").rng.random()


def uuid4() -> _uuid.UUID:
    """A deterministic random UUID, the same on every replay of the run."""
    rng: _random.Random = _require_replay("uuid4").rng
    return _uuid.UUID(int=rng.getrandbits(128), version=4)


def patched(change_id: str) -> bool:
    """Whether this run takes the new path of a workflow change: ``if patched("charge-first"): <new> else: <old>``.

    Deterministic per run: True for a run that reaches the call first on code that has it (a ``patch_applied``
    event records that, so every later replay agrees), False for a run whose log was recorded past this point by
    code before the change. Once no run recorded before the change is in flight, drop the old branch and keep the
    call (or remove it with the old branch: its marker is then ignored). See docs/workflow-changes.md."""
    return _require_replay("patched").patched(change_id)


def workflow_metadata() -> WorkflowMetadata:
    return _require_replay("workflow_metadata").metadata


def create_hook(
    token: str | None = None,
    metadata: Any = None,
    *,
    payload_type: Any = None,
    force: bool = False,
    token_retention: timedelta | datetime | None = None,
) -> Hook[Any]:
    """A hook the outside resumes with ``wf.resume_hook(token, payload)``. ``wait()`` suspends until a payload.

    A token is owned by one live hook at a time: when another run's hook owns ``token``, ``wait()`` raises
    :class:`~celery_workflow.errors.HookConflict`. ``force=True`` takes the token over instead: the owner's hook is
    disposed in its own run (its ``wait()`` then raises HookConflict naming this run) and this hook claims the token
    (a token an ended run retains cannot be taken).

    ``token_retention``: keep the token reserved after this run ends, until the retention ends: a timedelta counted
    from the hook's creation, or an aware datetime. Meanwhile another run's hook with this token gets HookConflict
    (naming this run), a resume finds no hook, and the World keeps the run (its expiry waits for the retention). A
    hook disposed before the run ends releases its token at once, as does a retention over by then."""
    return _require_replay("create_hook").create_hook(
        token=token,
        metadata=metadata,
        payload_type=payload_type,
        force=force,
        token_retention=check_token_retention(token_retention, "create_hook"),
    )


def check_token_retention(retention: Any, what: str) -> timedelta | datetime | None:
    """``token_retention`` of :func:`create_hook` / :func:`create_webhook` if it is one (ConfigurationError if not):
    None, a timedelta of at least zero, or an aware datetime."""
    if retention is None or (isinstance(retention, timedelta) and retention >= timedelta(0)):
        return retention
    if isinstance(retention, datetime) and retention.utcoffset() is not None:
        return retention
    raise ConfigurationError(
        f"{what}(): token_retention must be a timedelta of at least zero or an aware datetime, got {retention!r}"
    )


def create_webhook(
    *,
    token: str | None = None,
    respond_with: Mapping[str, Any] | str | None = None,
    many: bool = False,
    keep_credentials: bool = False,
    token_retention: timedelta | datetime | None = None,
) -> Webhook:
    """A hook resumed by an HTTP request to ``webhook.url``; ``wait()`` returns the :class:`WebhookRequest`.

    ``respond_with``: None answers the caller ``202 Accepted``; a mapping ``{"status", "headers", "body"}`` is the
    fixed response (``status`` an int in 200-599, default 200; ``headers`` str to str, names RFC 7230 tokens, values
    one line of Latin-1, no ``Content-Length`` or ``Transfer-Encoding``; ``body`` a str, sent as ``text/plain;
    charset=utf-8`` unless a ``Content-Type`` is given, or a JSON value, default ``""``), checked here: a malformed
    one raises :class:`~celery_workflow.errors.InvalidWebhookResponse` before anything is written; ``"manual"``
    holds the caller until a step calls ``request.respond(...)``, checked the same way.

    ``many``: by default a webhook answers **once**: its first request is recorded, later ones get ``410 Gone`` and
    record nothing (the World's append decides, so two simultaneous first requests record exactly one), and a second
    ``wait()`` raises :class:`~celery_workflow.errors.ConfigurationError`. Pass ``many=True`` for a webhook the
    workflow iterates (``for request in webhook: ...``): every request is then recorded. (Webhooks created before
    this option existed behave as ``many=True``.)

    ``keep_credentials``: the ``Authorization``, ``Cookie`` and ``Proxy-Authorization`` request headers are dropped
    before the request is recorded (the event log is not a secret store) unless this is True.

    ``token_retention``: keep the token reserved after the run ends, as :func:`create_hook` does (requests to the
    URL meanwhile get 404).
    """
    spec = check_response(respond_with)
    if not isinstance(many, bool) or not isinstance(keep_credentials, bool):
        raise ConfigurationError("create_webhook(): many and keep_credentials must be booleans")
    return _require_replay("create_webhook").create_webhook(
        token=token,
        respond_with=spec,
        many=many,
        keep_credentials=keep_credentials,
        token_retention=check_token_retention(token_retention, "create_webhook"),
    )


#: The fields of a fixed webhook response (``create_webhook(respond_with={...})``).
RESPONSE_FIELDS = frozenset({"status", "headers", "body"})
#: Request headers a webhook drops before recording the request unless created with ``keep_credentials=True``.
CREDENTIAL_HEADERS = frozenset({"authorization", "cookie", "proxy-authorization"})
#: Response headers a webhook's response may not set: the server frames the body itself, and a false
#: ``Content-Length`` or a ``Transfer-Encoding`` would desynchronise the connection.
FRAMING_HEADERS = frozenset({"content-length", "transfer-encoding"})
#: The statuses a webhook may answer with: final responses only (a 1xx is interim: a client would keep waiting).
RESPONSE_STATUSES = range(200, 600)
#: The ``Content-Type`` of a response body given as a str, as bytes, or as a JSON value, when its headers set none.
TEXT_TYPE, BYTES_TYPE, JSON_TYPE = "text/plain; charset=utf-8", "application/octet-stream", "application/json"
_TOKEN_CHARS = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
#: A header value: tab, visible ASCII, space and obs-text (RFC 7230 3.2): no CR, LF, NUL or other control character.
_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")


def check_status(status: Any, what: str) -> int:
    """``status`` if it is an int in :data:`RESPONSE_STATUSES`; InvalidWebhookResponse if not."""
    if isinstance(status, bool) or not isinstance(status, int) or status not in RESPONSE_STATUSES:
        raise InvalidWebhookResponse(f"{what} status must be an int in 200-599, not {status!r}")
    return status


def check_headers(headers: Any, what: str) -> dict[str, str]:
    """``headers`` as a dict if it maps header names (RFC 7230 tokens) to one-line values (no CR, LF, NUL or other
    control character, Latin-1 only) and sets none of :data:`FRAMING_HEADERS`; InvalidWebhookResponse if not."""
    if headers is None:
        return {}
    if not isinstance(headers, Mapping):
        raise InvalidWebhookResponse(f"{what} headers must be a mapping of str to str, not {headers!r}")
    for name, value in headers.items():
        if not isinstance(name, str) or not name or not set(name) <= _TOKEN_CHARS:
            raise InvalidWebhookResponse(f"{what} header name {name!r} is not a valid HTTP header name")
        if not isinstance(value, str) or not _VALUE.fullmatch(value):
            raise InvalidWebhookResponse(
                f"{what} header {name!r} must have a one-line str value of Latin-1 characters, not {value!r}"
            )
        if name.lower() in FRAMING_HEADERS:
            raise InvalidWebhookResponse(f"{what} may not set {name}: the server frames the body itself")
    return dict(headers)


def response_body(spec: Mapping[str, Any]) -> tuple[bytes, str]:
    """The body of a manual response as :meth:`WebhookRequest.respond` records it (``body_b64``, ``text`` or
    ``json``), with the ``Content-Type`` it has when its headers set none. InvalidWebhookResponse if malformed."""
    forms = [key for key in ("body_b64", "text", "json") if key in spec]
    if len(forms) != 1:
        raise InvalidWebhookResponse("a manual response has exactly one of body_b64, text and json")
    value = spec[forms[0]]
    try:
        if forms[0] == "body_b64":
            return base64.b64decode(str(value), validate=True), BYTES_TYPE
        if forms[0] == "text":
            return str(value).encode("utf-8"), TEXT_TYPE
        return json.dumps(value, allow_nan=False).encode(), JSON_TYPE
    except (ValueError, TypeError, RecursionError) as exc:
        raise InvalidWebhookResponse(f"a manual response's body cannot be sent: {exc}") from None


def check_response(respond_with: Any) -> Mapping[str, Any] | str | None:
    """``respond_with`` if it is None, ``"manual"`` or a well-formed fixed response; InvalidWebhookResponse if not."""
    if respond_with is None or respond_with == "manual":
        return respond_with  # type: ignore[no-any-return]
    if not isinstance(respond_with, Mapping):
        raise InvalidWebhookResponse(
            f"respond_with must be None, 'manual' or a mapping {{status, headers, body}}, not {respond_with!r}"
        )
    unknown = set(respond_with) - RESPONSE_FIELDS
    if unknown:
        raise InvalidWebhookResponse(
            f"respond_with has unknown keys {sorted(map(str, unknown))}; it takes {sorted(RESPONSE_FIELDS)}"
        )
    check_status(respond_with.get("status", 200), "respond_with")
    check_headers(respond_with.get("headers", {}), "respond_with")
    body = respond_with.get("body", "")
    if not isinstance(body, str):
        try:
            json.dumps(body, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidWebhookResponse(
                f"respond_with body must be a str or a JSON-serialisable value: {exc}"
            ) from None
    return respond_with


class Awaitable(Protocol):
    """What :func:`gather` waits for: a :class:`StepFuture` or a child run (``ChildRun``)."""

    def result(self) -> Any: ...


def gather(*futures: Awaitable, return_exceptions: bool = False) -> list[Any]:
    """Wait for several step futures (started with ``step.start(...)``) and child runs (``other_workflow.start(...)``)
    that run in parallel. A failed step raises StepFailed, a failed or cancelled child WorkflowFailed or
    RunCancelled (the first in argument order), after every other has been waited for; ``return_exceptions=True``
    puts those errors in the list instead."""
    _require_replay("gather")
    results: list[Any] = []
    pending_error: CeleryWorkflowError | None = None
    for fut in futures:
        try:
            results.append(fut.result())
        except (StepFailed, WorkflowFailed, RunCancelled) as exc:
            if not return_exceptions:
                pending_error = pending_error or exc
            results.append(exc)
    if pending_error is not None:
        raise pending_error
    return results


class StepFuture(Generic[T]):
    """A step started with ``step.start(...)``; it runs as its own delivery, in parallel with the workflow."""

    def __init__(self, replay: Replay, step_id: str, decode: Any) -> None:
        self._replay = replay
        self.step_id = step_id
        self._decode = decode

    def result(self) -> T:
        """The step's result (suspending the run until it exists); raises StepFailed if it failed for good."""
        value: T = self._replay.step_result(self.step_id, self._decode)
        return value

    def done(self) -> bool:
        return self._replay.step_done(self.step_id)

    def __repr__(self) -> str:
        return f"<StepFuture {self.step_id}>"


class Hook(Generic[T]):
    """A durable hook. ``wait()`` returns the next payload; iterate for many payloads."""

    def __init__(self, replay: Replay, hook_id: str, token: str, payload_type: Any = None) -> None:
        self._replay = replay
        self.hook_id = hook_id
        self.token = token
        self._payload_type = payload_type
        self._consumed = 0

    def wait(self) -> T:
        value, self._consumed = self._replay.hook_next(self.hook_id, self._consumed)
        if self._payload_type is not None:
            return codec.from_json(value, self._payload_type)  # type: ignore[no-any-return]
        return value  # type: ignore[no-any-return]

    def __iter__(self) -> Iterator[T]:
        while True:
            yield self.wait()

    def dispose(self) -> None:
        """Release the hook (and its token) before the run ends."""
        self._replay.hook_dispose(self.hook_id)

    def __repr__(self) -> str:
        return f"<Hook {self.hook_id} token={self.token!r}>"


@dataclass(frozen=True, slots=True)
class WebhookRequest:
    """An HTTP request received by a webhook. JSON-safe, so it can be passed to a step as an argument.

    When the webhook was created with ``respond_with="manual"``, the HTTP caller waits until a step calls
    :meth:`respond` on this request (or the endpoint's timeout passes).
    """

    method: str
    headers: dict[str, str] = field(default_factory=dict)
    body_b64: str = ""
    query: str = ""
    response_stream: str | None = None

    @classmethod
    def build(
        cls,
        method: str,
        headers: Mapping[str, str],
        body: bytes = b"",
        query: str = "",
        response_stream: str | None = None,
    ) -> WebhookRequest:
        return cls(method, dict(headers), base64.b64encode(body).decode(), query, response_stream)

    @property
    def body(self) -> bytes:
        return base64.b64decode(self.body_b64)

    def without_credentials(self) -> WebhookRequest:
        """This request without its credential headers (:data:`CREDENTIAL_HEADERS`, compared case-insensitively)."""
        kept = {k: v for k, v in self.headers.items() if k.lower() not in CREDENTIAL_HEADERS}
        return self if len(kept) == len(self.headers) else replace(self, headers=kept)

    def json(self) -> Any:
        return json.loads(self.body or b"null")

    def text(self) -> str:
        return self.body.decode()

    def respond(self, body: Any = None, *, status: int = 200, headers: Mapping[str, str] | None = None) -> None:
        """Answer the waiting HTTP caller (inside a step). ``body``: bytes, str (sent as ``text/plain;
        charset=utf-8`` unless ``headers`` set a ``Content-Type``), or a JSON value (``application/json``).

        Checked as a fixed response is: ``status`` an int in 200-599, header names RFC 7230 tokens, values one line
        of Latin-1 (no CR, LF or NUL), no ``Content-Length`` or ``Transfer-Encoding`` (the server frames the body).
        A malformed response raises :class:`~celery_workflow.errors.InvalidWebhookResponse` here, and the caller
        gets a ``500`` with a generic body at once rather than a response it was not meant to see."""
        if self.response_stream is None:
            raise ConfigurationError("this webhook was not created with respond_with='manual'")
        writer = get_writable(self.response_stream)
        try:
            spec: dict[str, Any] = {
                "status": check_status(status, "the response"),
                "headers": check_headers(headers, "the response"),
            }
            if isinstance(body, (bytes, bytearray)):
                spec["body_b64"] = base64.b64encode(bytes(body)).decode()
            elif isinstance(body, str):
                spec["text"] = body
            else:
                spec["json"] = codec.to_json(body)
            writer.write(spec)
        except InvalidWebhookResponse as exc:
            _refuse(writer, exc)
            raise
        except PayloadError as exc:  # a body that cannot be encoded, or too large to record
            _refuse(writer, exc)
            raise InvalidWebhookResponse(f"the response cannot be recorded: {exc.message}") from exc
        writer.close()

    def to_payload(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "headers": dict(self.headers),
            "body_b64": self.body_b64,
            "query": self.query,
            "response_stream": self.response_stream,
        }

    @classmethod
    def from_payload(cls, data: Mapping[str, Any]) -> WebhookRequest:
        return cls(
            method=str(data.get("method", "POST")),
            headers={str(k): str(v) for k, v in dict(data.get("headers", {})).items()},
            body_b64=str(data.get("body_b64", "")),
            query=str(data.get("query", "")),
            response_stream=data.get("response_stream"),
        )


def _refuse(writer: StreamWriter, exc: CeleryWorkflowError) -> None:
    """Record that the response was refused, so the waiting caller gets its 500 now (a step retried after a refusal
    finds the stream closed: the caller has had its answer)."""
    try:
        writer.write({"invalid": codec.cut(exc.message, 1024)})
        writer.close()
    except CeleryWorkflowError:
        pass


class Webhook(Hook[WebhookRequest]):
    """A hook resumed over HTTP: ``POST {base_url}/webhooks/{token}``."""

    def __init__(self, replay: Replay, hook_id: str, token: str, base_url: str | None, *, many: bool = True) -> None:
        super().__init__(replay, hook_id, token)
        self._base_url = base_url
        self.many = many

    @property
    def url(self) -> str:
        if not self._base_url:
            raise ConfigurationError("Workflows(base_url=...) is not set, so webhooks have no URL")
        from urllib.parse import quote

        return f"{self._base_url.rstrip('/')}/webhooks/{quote(self.token, safe='')}"

    def wait(self) -> WebhookRequest:
        if not self.many and self._consumed >= 1:
            raise ConfigurationError(
                f"webhook {self.hook_id} answers once and has had its request; create it with"
                " create_webhook(many=True) to receive several"
            )
        value, self._consumed = self._replay.hook_next(self.hook_id, self._consumed)
        return WebhookRequest.from_payload(value)


# -- step API --------------------------------------------------------------------------------------------------------


class StreamWriter:
    """Writes values (JSON or bytes) to a run's named stream; each write is durable when it returns."""

    def __init__(self, world: World, run_id: str, name: str) -> None:
        self._world = world
        self.run_id = run_id
        self.name = name

    def write(self, value: Any) -> int:
        """Append ``value``; return the stream's length after it."""
        return self._world.write_stream(self.run_id, self.name, [codec.dumps_chunk(value)])

    def close(self) -> None:
        """Close the stream: readers stop after the last chunk."""
        self._world.close_stream(self.run_id, self.name)


def get_writable(name: str = "default") -> StreamWriter:
    ctx = _require_step("get_writable")
    writer = ctx.writers.get(name)
    if writer is None:
        writer = ctx.writers[name] = StreamWriter(ctx.world, ctx.metadata.run_id, name)
    return writer


def step_metadata() -> StepMetadata:
    return _require_step("step_metadata").metadata


def enter_replay(replay: Replay) -> Any:
    return _replay.set(replay)


def exit_replay(token: Any) -> None:
    _replay.reset(token)


def enter_step(ctx: StepContext) -> Any:
    return _step.set(ctx)


def exit_step(token: Any) -> None:
    _step.reset(token)


def in_step() -> bool:
    return _step.get() is not None
