"""The RPC's vocabulary, without HTTP: the parameters each method takes (pydantic models, strict), the JSON views of
runs, events, steps and stream chunks it answers with, and the methods themselves over a
:class:`~celery_workflow.app.Workflows`.

:mod:`celery_workflow.api` serves them over Flask (``POST {prefix}/rpc``); the command line prints the same views.

Every answer is bounded: a listing holds at most ``limit`` items and :data:`MAX_RESPONSE` bytes and gives a cursor to
the rest (``list_runs``: ``cursor``; ``list_events``: the next ``after_slot``; ``list_steps``: the next ``after``;
``read_stream``: ``next_index``). In a page of more than one item, a value over :data:`MAX_LISTED_VALUE` bytes of
JSON is left out (None) and the item says so: ``"truncated": {"output": 300002}`` (an event's data fields as
``"data.<field>"``). Ask for that item alone (``limit=1`` from its position, or ``get_step``) to have it whole. Hook
tokens in event data (:data:`TOKEN_EVENTS`) are :data:`HIDDEN` unless the caller may reveal them.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from celery_workflow import codec
from celery_workflow.errors import CeleryWorkflowError, EntityExists
from celery_workflow.events import Event, EventType, RunView, StepView
from celery_workflow.ids import isoformat
from celery_workflow.runtime.continuation import continued_as
from celery_workflow.waiting_on import run_waiting_on, waiting_json

if TYPE_CHECKING:
    from celery_workflow.app import Workflows

#: Room for the JSON envelope (method, parameter names, escapes) an RPC body may take beyond the World's
#: ``max_payload``. With ``max_body=None`` (the default) the RPC endpoint accepts ``world.max_payload + BODY_ROOM``
#: bytes and a webhook what :func:`default_max_body` says (its body is stored base64-encoded beside its headers).
#: An RPC value that passes the body limit but not the World's (non-ASCII sent as ``\u`` escapes) is still refused
#: with 413 before anything is written; pass ``max_body=`` to choose another limit.
BODY_ROOM = 64 * 1024
#: Room a webhook request's method, headers and query string take in the World beside its body (as recorded, in
#: bytes of JSON): a request whose headers need more gets ``431`` and records nothing. A World whose ``max_payload``
#: is under four times this gives them a quarter of it.
WEBHOOK_ROOM = 16 * 1024
#: Longest a single RPC call may block (``wait`` of get_run / read_stream).
MAX_WAIT = 30.0
#: The largest listing answer (``list_runs``, ``list_events``, ``list_steps``, ``read_stream``), in bytes of JSON: a
#: page is cut short (with a cursor to the rest) rather than grow past it; it always holds at least one item.
MAX_RESPONSE = 8 * 1_048_576
#: In a page of more than one item, a value longer than this in JSON (a run's or a step's input, output or error, a
#: field of an event's data, a stream chunk) is left out: the item's ``truncated`` maps its field to its size in
#: bytes. A page of one item (``limit=1``), ``get_run`` and ``get_step`` answer every value whole.
MAX_LISTED_VALUE = 64 * 1024
#: Events and stream chunks are read from the World this many at a time, so a server holds at most this many
#: large values of one answer at once.
READ_BATCH = 100
#: What a hidden hook token is shown as (see :func:`event_json`).
HIDDEN = "(hidden)"
#: The event types whose data may carry a hook token (``token``), hidden unless the caller may reveal tokens.
TOKEN_EVENTS = frozenset(
    {EventType.HOOK_CREATED, EventType.HOOK_CONFLICT, EventType.HOOK_DISPOSED, EventType.HOOK_RECEIVED}
)
TOKEN_FIELDS = frozenset({"token"})


def webhook_room(wf: Workflows) -> int:
    """The bytes a webhook request's method, headers and query string may take as recorded (:data:`WEBHOOK_ROOM`,
    or a quarter of a small World's ``max_payload``)."""
    return min(WEBHOOK_ROOM, wf.runtime.max_payload // 4)


def default_max_body(wf: Workflows, *, webhook: bool = False) -> int:
    """The body limit ``max_body=None`` stands for: what ``wf``'s World can store. For the RPC, ``max_payload`` and
    :data:`BODY_ROOM`; for a webhook, the largest body whose base64 encoding fits in ``max_payload`` beside
    :func:`webhook_room` bytes of method, headers and query string: a body of exactly this size is accepted (with
    headers within the room), one byte more is 413."""
    limit = wf.runtime.max_payload
    return (limit - webhook_room(wf)) // 4 * 3 if webhook else limit + BODY_ROOM


class InvalidParams(CeleryWorkflowError):
    """A parameter the method cannot use (a cursor that names nothing): the RPC answers 400 ``invalid_params``."""


# -- params ------------------------------------------------------------------------------------------------------------


class Params(BaseModel):
    """Parameters of an RPC method: strict, and no field beyond those declared."""

    model_config = ConfigDict(extra="forbid", strict=True)


def _text(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (a lone surrogate cannot be stored or looked up)") from None
    return value


#: An id, token, name, cursor or reason: no NUL (SQL text columns refuse it) and nothing UTF-8 cannot encode (a lone
#: surrogate): bad input, never an outage.
Text = Annotated[str, AfterValidator(_text)]
#: Positions and counts are 64-bit integers in every World.
MAX_INT64 = 2**63 - 1
RunId = Field(min_length=1, max_length=200)


class StartParams(Params):
    workflow: Text = Field(min_length=1, max_length=200)
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    run_id: Text | None = Field(default=None, min_length=1, max_length=200)


class GetRunParams(Params):
    run_id: Text = RunId
    wait: float = Field(default=0.0, ge=0.0, le=MAX_WAIT)


class ListRunsParams(Params):
    workflow: Text | None = Field(default=None, max_length=200)
    status: Literal["pending", "running", "completed", "failed", "cancelled"] | None = None
    limit: int = Field(default=100, ge=1, le=1000)
    cursor: Text | None = Field(default=None, max_length=400)


class ListEventsParams(Params):
    run_id: Text = RunId
    after_slot: int = Field(default=0, ge=0, le=MAX_INT64)
    limit: int = Field(default=1000, ge=1, le=1000)


class RunParams(Params):
    run_id: Text = RunId


class ListStepsParams(Params):
    run_id: Text = RunId
    after: Text | None = Field(default=None, min_length=1, max_length=400)
    limit: int = Field(default=100, ge=1, le=1000)


class GetStepParams(Params):
    run_id: Text = RunId
    step_id: Text = Field(min_length=1, max_length=400)


class CancelParams(Params):
    run_id: Text = RunId
    reason: Text | None = Field(default=None, max_length=1000)


class ResumeHookParams(Params):
    token: Text = Field(min_length=1, max_length=512)
    payload: Any = None
    #: seconds to keep looking for a hook the run has not reached yet (``Workflows.resume_hook(wait=...)``)
    wait: float = Field(default=0.0, ge=0.0, le=MAX_WAIT)


class ReadStreamParams(Params):
    run_id: Text = RunId
    name: Text = Field(default="default", min_length=1, max_length=512)
    start: int = Field(default=0, ge=0, le=MAX_INT64)
    limit: int = Field(default=100, ge=1, le=1000)
    wait: float = Field(default=0.0, ge=0.0, le=MAX_WAIT)


# -- JSON views --------------------------------------------------------------------------------------------------------


def _time(value: Any) -> str | None:
    return None if value is None else isoformat(value)


def _size(value: Any) -> int:
    """Bytes of ``value`` in an answer (the HTTP edge writes ASCII JSON)."""
    try:
        return len(json.dumps(value, default=str))
    except (ValueError, RecursionError):
        return MAX_LISTED_VALUE + 1


def _shown(fields: Mapping[str, Any], whole: bool) -> tuple[dict[str, Any], dict[str, int]]:
    """``fields`` with, unless ``whole``, those longer than :data:`MAX_LISTED_VALUE` as None; and their sizes."""
    shown: dict[str, Any] = {}
    cut: dict[str, int] = {}
    for name, value in fields.items():
        size = 0 if whole or value is None else _size(value)
        if size > MAX_LISTED_VALUE:
            shown[name], cut[name] = None, size
        else:
            shown[name] = value
    return shown, cut


def listed(item: dict[str, Any], fields: Mapping[str, Any], *, whole: bool) -> dict[str, Any]:
    """``item`` with ``fields`` (name to value) in it, or, unless ``whole``, those longer than
    :data:`MAX_LISTED_VALUE` left out (None) and named in ``item["truncated"]`` with their size in bytes."""
    shown, cut = _shown(fields, whole)
    item.update(shown)
    if cut:
        item["truncated"] = cut
    return item


def start_json(run: RunView) -> dict[str, Any]:
    """What a start answers about its run: its id, workflow and status (never its input or output)."""
    return {"run_id": run.run_id, "workflow_name": run.workflow_name, "status": run.status.value}


def run_json(run: RunView, *, whole: bool = True) -> dict[str, Any]:
    item: dict[str, Any] = {"run_id": run.run_id, "workflow_name": run.workflow_name, "status": run.status.value}
    listed(item, {"input": run.input, "output": run.output, "error": run.error}, whole=whole)
    item.update(
        queue=run.queue,
        event_count=run.event_count,
        created_at=_time(run.created_at),
        updated_at=_time(run.updated_at),
        started_at=_time(run.started_at),
        completed_at=_time(run.completed_at),
    )
    return item


def event_data(ev: Event, *, reveal: bool = False) -> dict[str, Any]:
    """An event's data, a hook token in it shown as :data:`HIDDEN` unless ``reveal``."""
    data = dict(ev.data)
    if not reveal and ev.event_type in TOKEN_EVENTS:
        for key in TOKEN_FIELDS & set(data):
            data[key] = HIDDEN
    return data


def event_json(ev: Event, *, reveal: bool = False, whole: bool = True) -> dict[str, Any]:
    """An event; hook tokens hidden unless ``reveal``; unless ``whole``, data fields over :data:`MAX_LISTED_VALUE`
    left out (``truncated`` names them)."""
    item: dict[str, Any] = {"slot": ev.slot, "event_type": ev.event_type.value, "correlation_id": ev.correlation_id}
    item["data"], cut = _shown(event_data(ev, reveal=reveal), whole)
    if cut:
        item["truncated"] = {f"data.{key}": size for key, size in cut.items()}
    item["created_at"] = _time(ev.created_at)
    return item


def step_json(step: StepView, *, whole: bool = True) -> dict[str, Any]:
    item: dict[str, Any] = {
        "step_id": step.step_id,
        "step_name": step.step_name,
        "status": step.status.value,
        "attempt": step.attempt,
    }
    listed(item, {"input": step.input, "output": step.output, "error": step.error}, whole=whole)
    item.update(
        queue=step.queue,
        created_at=_time(step.created_at),
        started_at=_time(step.started_at),
        completed_at=_time(step.completed_at),
        retry_after=_time(step.retry_after),
    )
    return item


def chunk_json(index: int, data: bytes, *, whole: bool = True) -> dict[str, Any]:
    value = codec.loads(data)
    if isinstance(value, bytes):
        return listed({"index": index}, {"bytes_b64": base64.b64encode(value).decode()}, whole=whole)
    return listed({"index": index}, {"value": value}, whole=whole)


class _Page:
    """Items of an answer, up to :data:`MAX_RESPONSE` bytes (the first always goes in)."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.size = 0

    def add(self, item: dict[str, Any]) -> bool:
        """Append ``item``; False (and not appended) when it would take the page past the limit."""
        size = _size(item) + 2
        if self.items and self.size + size > MAX_RESPONSE:
            return False
        self.items.append(item)
        self.size += size
        return True


# -- the RPC methods ---------------------------------------------------------------------------------------------------


class Methods:
    """The RPC methods, each taking its parameters (see :data:`METHODS`) and answering a JSON-ready dict.

    ``may_reveal()``: whether this call may see hook tokens (the HTTP edge asks ``authorize(request,
    "reveal_token")``); without it, tokens in event data are hidden."""

    def __init__(self, wf: Workflows, may_reveal: Callable[[], bool] | None = None) -> None:
        self.wf = wf
        self.may_reveal = may_reveal or (lambda: False)

    def start(self, p: StartParams) -> dict[str, Any]:
        """Start a run, or find the one ``run_id`` names when the same workflow was started with the same arguments
        (``created`` false). Either answer holds only the run's id, workflow and status: a caller allowed only to
        start learns nothing else of a run. The id of a run of another workflow or with other arguments is a
        conflict (409) that names neither."""
        taken = EntityExists(f"run id {p.run_id!r} is already used by another run")
        try:
            view, created = self.wf.runtime.start(p.workflow, p.args, p.kwargs, run_id=p.run_id)
        except EntityExists:
            raise taken from None
        if not created:
            wdef = self.wf.runtime.registry.workflow(p.workflow)
            if view.workflow_name != p.workflow or view.input != wdef.signature.encode_args(p.args, p.kwargs):
                raise taken
        return {"run": start_json(view), "created": created}

    def get_run(self, p: GetRunParams) -> dict[str, Any]:
        world = self.wf.world
        view = world.wait_for_terminal(p.run_id, p.wait) if p.wait > 0 else world.get_run(p.run_id)
        run = run_json(view)
        successor = continued_as(world, view)
        if successor is not None:
            run["continued_as"] = successor  # the run handed over to it (continue_as_new): its result is the chain's
        # what it waits for (issue #30, item 5): hook tokens only for a caller who may see them
        run["waiting_on"] = (
            [] if view.status.terminal else waiting_json(run_waiting_on(world, view.run_id, reveal=self.may_reveal()))
        )
        return {"run": run}

    def list_runs(self, p: ListRunsParams) -> dict[str, Any]:
        """A page of at most ``limit`` runs and at most :data:`MAX_RESPONSE` bytes: a page over it is asked again
        with half the limit (the World's own cursor then points after its last run)."""
        limit, whole = p.limit, p.limit == 1
        while True:
            page = self.wf.world.list_runs(workflow=p.workflow, status=p.status, limit=limit, cursor=p.cursor)
            runs = [run_json(r, whole=whole) for r in page.items]
            if limit == 1 or _size(runs) <= MAX_RESPONSE:
                return {"runs": runs, "cursor": page.cursor}
            limit = max(1, limit // 2)

    def list_events(self, p: ListEventsParams) -> dict[str, Any]:
        """Events after ``after_slot``, at most ``limit`` and :data:`MAX_RESPONSE` bytes; ``cursor``: the
        ``after_slot`` of the next page (None at the end of the log)."""
        reveal, whole = self.may_reveal(), p.limit == 1
        out, after, more = _Page(), p.after_slot, False
        while not more:
            room = min(READ_BATCH, p.limit - len(out.items))
            batch = self.wf.world.list_events(p.run_id, after_slot=after, limit=room + 1)
            for ev in batch[:room]:
                if not out.add(event_json(ev, reveal=reveal, whole=whole)):
                    more = True
                    break
                after = ev.slot
            if len(batch) <= room:
                break
            more = more or len(out.items) >= p.limit
        return {"events": out.items, "cursor": after if more else None}

    def list_steps(self, p: ListStepsParams) -> dict[str, Any]:
        """The run's steps in the order they were created, after the step ``after`` names, at most ``limit`` and
        :data:`MAX_RESPONSE` bytes; ``cursor``: the ``after`` of the next page (None after the last step)."""
        steps = self.wf.world.list_steps(p.run_id)
        start = 0
        if p.after is not None:
            ids = [s.step_id for s in steps]
            if p.after not in ids:
                raise InvalidParams(f"after: run {p.run_id} has no step {p.after!r}")
            start = ids.index(p.after) + 1
        out, whole = _Page(), p.limit == 1
        for step in steps[start : start + p.limit]:
            if not out.add(step_json(step, whole=whole)):
                break
        end = start + len(out.items)
        return {"steps": out.items, "cursor": steps[end - 1].step_id if end < len(steps) and out.items else None}

    def get_step(self, p: GetStepParams) -> dict[str, Any]:
        """One step, every value whole."""
        return {"step": step_json(self.wf.world.get_step(p.run_id, p.step_id))}

    def cancel(self, p: CancelParams) -> dict[str, Any]:
        return {"run": run_json(self.wf.runtime.cancel(p.run_id, p.reason))}

    def resume_hook(self, p: ResumeHookParams) -> dict[str, Any]:
        hook = self.wf.runtime.resume_hook(p.token, p.payload, wait=p.wait)
        return {"hook": {"run_id": hook.run_id, "hook_id": hook.hook_id, "token": hook.token}}

    def read_stream(self, p: ReadStreamParams) -> dict[str, Any]:
        """Chunks from ``start``, at most ``limit`` and :data:`MAX_RESPONSE` bytes (waiting up to ``wait`` s for a
        first one); ``next_index``: the ``start`` of the next read; ``closed``: the stream is closed and this page
        holds its last chunk."""
        world = self.wf.world
        world.get_run(p.run_id)  # 404 for an unknown run rather than an empty stream
        out, whole = _Page(), p.limit == 1
        index, closed, wait = p.start, False, p.wait
        while len(out.items) < p.limit:
            room = min(READ_BATCH, p.limit - len(out.items))
            page = world.read_stream(p.run_id, p.name, start=index, limit=room, wait=wait)
            wait = 0.0
            full = True
            for chunk in page.chunks:
                if not out.add(chunk_json(chunk.index, chunk.data, whole=whole)):
                    full = False
                    break
                index = chunk.index + 1
            closed = full and page.closed
            if not full or len(page.chunks) < room:
                break
        return {"chunks": out.items, "closed": closed, "next_index": index}


METHODS: dict[str, type[Params]] = {
    "start": StartParams,
    "get_run": GetRunParams,
    "list_runs": ListRunsParams,
    "list_events": ListEventsParams,
    "list_steps": ListStepsParams,
    "get_step": GetStepParams,
    "cancel": CancelParams,
    "resume_hook": ResumeHookParams,
    "read_stream": ReadStreamParams,
}
