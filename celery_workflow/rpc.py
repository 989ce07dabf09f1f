"""The RPC's vocabulary, without HTTP: the parameters each method takes (pydantic models, strict), the JSON views of
runs, events, steps and stream chunks it answers with, and the methods themselves over a
:class:`~celery_workflow.app.Workflows`.

:mod:`celery_workflow.api` serves them over Flask (``POST {prefix}/rpc``); the command line prints the same views.
"""

from __future__ import annotations

import base64
import json
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from celery_workflow import codec
from celery_workflow.events import Event, RunView, StepView
from celery_workflow.ids import isoformat
from celery_workflow.runtime.continuation import continued_as

if TYPE_CHECKING:
    from celery_workflow.app import Workflows

#: Longest a single RPC call may block (``wait`` of get_run / read_stream).
MAX_WAIT = 30.0
#: The largest ``list_runs`` answer: a page is cut short (with a cursor to the rest) rather than grow past it.
MAX_RESPONSE = 8 * 1_048_576


# -- params ------------------------------------------------------------------------------------------------------------


class Params(BaseModel):
    """Parameters of an RPC method: strict, and no field beyond those declared."""

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


class CancelParams(Params):
    run_id: Text = RunId
    reason: str | None = Field(default=None, max_length=1000)


class ResumeHookParams(Params):
    token: Text = Field(min_length=1, max_length=512)
    payload: Any = None


class ReadStreamParams(Params):
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


class Methods:
    """The RPC methods, each taking its parameters (see :data:`METHODS`) and answering a JSON-ready dict."""

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


METHODS: dict[str, type[Params]] = {
    "start": StartParams,
    "get_run": GetRunParams,
    "list_runs": ListRunsParams,
    "list_events": ListEventsParams,
    "list_steps": RunParams,
    "cancel": CancelParams,
    "resume_hook": ResumeHookParams,
    "read_stream": ReadStreamParams,
}
