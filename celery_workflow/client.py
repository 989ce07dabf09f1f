"""Handles on runs from outside a workflow: :class:`Run` (in-process) and :class:`HTTPClient` / :class:`HTTPRun`."""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from celery_workflow import codec
from celery_workflow.errors import (
    CeleryWorkflowError,
    EventConflict,
    EventInvalid,
    HookNotFound,
    NotFound,
    PayloadTooLarge,
    ResultTimeout,
    RunCancelled,
    RunNotFound,
    WorkflowNotFound,
    WorldError,
    run_failure,
)
from celery_workflow.events import Event, RunStatus, RunView, StepView
from celery_workflow.runtime.continuation import continued_as
from celery_workflow.waiting_on import Waiting, run_waiting_on, waiting_of_json

if TYPE_CHECKING:
    from celery_workflow.runtime.handlers import Runtime

R = TypeVar("R")
_ANY: Any = object()


class Run(Generic[R]):
    """A workflow run. Attributes read the World each time, so they are always current."""

    def __init__(self, runtime: Runtime, run_id: str, *, returns: Any = _ANY) -> None:
        self._runtime = runtime
        self.id = run_id
        self._returns = returns

    @property
    def _world(self) -> Any:
        return self._runtime.world

    def view(self) -> RunView:
        """The run's current view (status, input, output, error, times)."""
        view: RunView = self._world.get_run(self.id)
        return view

    @property
    def status(self) -> RunStatus:
        return self.view().status

    @property
    def waiting_on(self) -> list[Waiting]:
        """What the run waits for now (empty once it has ended): sleeps, hooks (tokens hidden), step retries, queued
        or running steps, queues no worker consumes (see :mod:`celery_workflow.waiting_on`)."""
        return self.waiting(reveal_tokens=False)

    def waiting(self, *, reveal_tokens: bool = False) -> list[Waiting]:
        """:attr:`waiting_on`, with the hooks' tokens when ``reveal_tokens``."""
        return run_waiting_on(self._world, self.id, reveal=reveal_tokens)

    @property
    def workflow_name(self) -> str:
        return self.view().workflow_name

    @property
    def created_at(self) -> datetime:
        return self.view().created_at

    def result(self, timeout: float | None = None, *, follow: bool = True) -> R:
        """Wait for the run to end; return its output or raise WorkflowFailed / RunCancelled / ResultTimeout.

        A run that handed over (``continue_as_new``) is followed to its successors' end (``follow=False``: its own
        output, None); the errors then name the run of the chain that failed or was cancelled."""
        deadline = None if timeout is None else time.monotonic() + timeout
        run_id = self.id
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            view: RunView = self._world.wait_for_terminal(run_id, left)
            successor = continued_as(self._world, view)
            if successor is None:
                return self._outcome(view, timeout)
            if not follow:
                none: R = None  # type: ignore[assignment]  # a run that handed over has no output of its own
                return none
            run_id = successor

    @property
    def continued_as(self) -> str | None:
        """The run this one handed over to with ``continue_as_new``, if it did."""
        return continued_as(self._world, self.view())

    def _outcome(self, view: RunView, timeout: float | None) -> R:
        if view.status is RunStatus.COMPLETED:
            returns = self._returns
            if returns is _ANY:
                wdef = self._runtime.registry.workflows.get(view.workflow_name)
                returns = wdef.signature.returns if wdef else _ANY
            value: R = codec.from_json(view.output, returns) if returns is not _ANY else view.output
            return value
        if view.status is RunStatus.FAILED:
            raise run_failure(view.run_id, dict(view.error or {}))
        if view.status is RunStatus.CANCELLED:
            raise RunCancelled(run_id=view.run_id)
        raise ResultTimeout(f"run {view.run_id} is still {view.status} after {timeout} s")

    def cancel(self, reason: str | None = None) -> None:
        """Cancel the run: no further steps start; a step already running may still finish."""
        self._runtime.cancel(self.id, reason)

    def events(self) -> list[Event]:
        events: list[Event] = self._world.list_events(self.id)
        return events

    def steps(self) -> list[StepView]:
        steps: list[StepView] = self._world.list_steps(self.id)
        return steps

    def stream(self, name: str = "default", start: int = 0, *, timeout: float | None = None) -> Iterator[Any]:
        """Yield the stream's values from index ``start`` as they are written, until it is closed.

        Also stops once the run has ended and every chunk written so far has been read (a stream nobody closed),
        and raises ResultTimeout if ``timeout`` seconds pass without the stream ending.
        """
        world = self._world

        def read(index: int, wait: float) -> tuple[list[Any], bool, int]:
            page = world.read_stream(self.id, name, start=index, wait=wait)
            return [codec.loads(c.data) for c in page.chunks], page.closed, page.next_index

        return _follow(
            read,
            lambda: bool(world.get_run(self.id).status.terminal),
            start,
            timeout=timeout,
            idle_wait=world.poll_interval * 20,
            what=f"stream {name!r} of run {self.id}",
        )

    def __repr__(self) -> str:
        return f"<Run {self.id}>"


def _follow(
    read: Callable[[int, float], tuple[list[Any], bool, int]],
    ended: Callable[[], bool],
    start: int,
    *,
    timeout: float | None,
    idle_wait: float,
    what: str,
) -> Iterator[Any]:
    """Values of a stream from ``start`` as they are written, until it closes or its run has ended and every chunk
    written so far has been read; ResultTimeout if ``timeout`` seconds pass without the stream ending.

    ``read(index, wait)`` returns ``(values, closed, next_index)``, waiting up to ``wait`` s for a first value.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    index = start
    while True:
        wait = idle_wait if deadline is None else max(0.0, min(idle_wait, deadline - time.monotonic()))
        values, closed, index = read(index, wait)
        yield from values
        if values:
            continue
        if closed or ended():
            values, _, index = read(index, 0.0)  # a last look: chunks written just before the end
            if not values:
                return
            yield from values
            continue
        if deadline is not None and time.monotonic() >= deadline:
            raise ResultTimeout(f"{what} did not end within {timeout} s")


# -- over HTTP ---------------------------------------------------------------------------------------------------------

_ERRORS: dict[str, type[CeleryWorkflowError]] = {
    "workflow_not_found": WorkflowNotFound,
    "run_not_found": RunNotFound,
    "hook_not_found": HookNotFound,
    "not_found": NotFound,
    "conflict": EventConflict,
    "too_early": EventConflict,
    "payload_too_large": PayloadTooLarge,
    "invalid_params": EventInvalid,
    "invalid_request": EventInvalid,
    "method_not_found": EventInvalid,
    "unavailable": WorldError,
}


class HTTPClient:
    """The outside calls of :class:`~celery_workflow.Workflows` over the RPC endpoint of ``api.blueprint``.

    ``base_url`` is where the blueprint is mounted, e.g. ``https://workflows.example.com/v1/workflow``. Errors come
    back as the same typed exceptions the in-process API raises. ``headers`` are sent with every call (auth).
    """

    def __init__(self, base_url: str, *, timeout: float = 60.0, headers: Mapping[str, str] | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.headers = dict(headers or {})

    def call(self, method: str, params: Mapping[str, Any] | None = None, *, timeout: float | None = None) -> Any:
        body = json.dumps({"method": method, "params": dict(params or {})}).encode()
        req = urllib.request.Request(
            f"{self.base_url}/rpc",
            data=body,
            method="POST",
            headers={"content-type": "application/json", **self.headers},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as resp:
                return json.loads(resp.read())["result"]
        except urllib.error.HTTPError as exc:
            raise _http_error(exc) from None
        except (urllib.error.URLError, OSError) as exc:
            raise WorldError(f"cannot reach {self.base_url}: {exc}") from exc

    def start(self, workflow: str, *args: Any, run_id: str | None = None, **kwargs: Any) -> HTTPRun:
        params: dict[str, Any] = {
            "workflow": workflow,
            "args": codec.to_json(list(args)),
            "kwargs": codec.to_json(kwargs),
        }
        if run_id is not None:
            params["run_id"] = run_id
        result = self.call("start", params)
        return HTTPRun(self, result["run"]["run_id"])

    def get_run(self, run_id: str) -> HTTPRun:
        self.call("get_run", {"run_id": run_id})
        return HTTPRun(self, run_id)

    def list_runs(
        self, workflow: str | None = None, status: RunStatus | str | None = None, limit: int = 100
    ) -> list[HTTPRun]:
        params: dict[str, Any] = {"limit": limit}
        if workflow is not None:
            params["workflow"] = workflow
        if status is not None:
            params["status"] = str(RunStatus(status).value)
        return [HTTPRun(self, r["run_id"]) for r in self.call("list_runs", params)["runs"]]

    def cancel(self, run_id: str, reason: str | None = None) -> None:
        self.call("cancel", {"run_id": run_id, **({"reason": reason} if reason else {})})

    def resume_hook(self, token: str, payload: Any = None, *, wait: float = 0.0) -> dict[str, Any]:
        """As :meth:`Workflows.resume_hook` (``wait``: seconds the server keeps looking for the hook)."""
        params: dict[str, Any] = {"token": token, "payload": codec.to_json(payload)}
        if wait:
            params["wait"] = wait
        hook: dict[str, Any] = self.call("resume_hook", params)["hook"]
        return hook


def _http_error(exc: urllib.error.HTTPError) -> CeleryWorkflowError:
    try:
        err = json.loads(exc.read())["error"]
        code, message = str(err["code"]), str(err["message"])
    except (ValueError, KeyError, TypeError):
        return WorldError(f"HTTP {exc.code} from the workflow endpoint")
    return _ERRORS.get(code, CeleryWorkflowError)(message)


class HTTPRun:
    """A run seen over HTTP: the same reads as :class:`Run` (results come back as plain JSON)."""

    def __init__(self, client: HTTPClient, run_id: str) -> None:
        self._client = client
        self.id = run_id

    def view(self, wait: float = 0.0) -> dict[str, Any]:
        run: dict[str, Any] = self._client.call(
            "get_run", {"run_id": self.id, "wait": wait}, timeout=wait + self._client.timeout
        )["run"]
        return run

    @property
    def status(self) -> RunStatus:
        return RunStatus(self.view()["status"])

    @property
    def workflow_name(self) -> str:
        return str(self.view()["workflow_name"])

    @property
    def waiting_on(self) -> list[Waiting]:
        """What the run waits for, as RPC ``get_run`` answers it, typed as :attr:`Run.waiting_on` is (a hook's token
        only when the server lets this caller see tokens, else None); empty once it has ended. Items of a kind this
        version does not know (a newer server's) are left out; ``view()["waiting_on"]`` has them all as JSON."""
        found = (waiting_of_json(item) for item in self.view().get("waiting_on") or [])
        return [item for item in found if item is not None]

    def result(self, timeout: float | None = None, *, follow: bool = True) -> Any:
        """Wait for the run to end (long-polling); return its output or raise like :meth:`Run.result` (following
        the runs it handed over to, unless ``follow=False``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        current = self
        while True:
            left = 25.0 if deadline is None else max(0.0, min(25.0, deadline - time.monotonic()))
            run = current.view(wait=left)
            status = RunStatus(run["status"])
            if status is RunStatus.COMPLETED and follow and run.get("continued_as"):
                current = HTTPRun(self._client, str(run["continued_as"]))
                continue
            if status is RunStatus.COMPLETED:
                return run["output"]
            if status is RunStatus.FAILED:
                raise run_failure(current.id, dict(run["error"] or {}))
            if status is RunStatus.CANCELLED:
                raise RunCancelled(run_id=current.id)
            if deadline is not None and time.monotonic() >= deadline:
                raise ResultTimeout(f"run {current.id} is still {status} after {timeout} s")

    def cancel(self, reason: str | None = None) -> None:
        self._client.cancel(self.id, reason)

    def events(self) -> list[dict[str, Any]]:
        """Every event, each whole (one a page left out for its size is read again alone)."""
        out: list[dict[str, Any]] = []
        after = 0
        while True:
            page = self._client.call("list_events", {"run_id": self.id, "after_slot": after})
            for event in page["events"]:
                whole = event
                if event.get("truncated"):
                    params = {"run_id": self.id, "after_slot": int(event["slot"]) - 1, "limit": 1}
                    whole = self._client.call("list_events", params)["events"][0]
                out.append(whole)
            if page["cursor"] is None:
                return out
            after = int(page["cursor"])

    def steps(self) -> list[dict[str, Any]]:
        """Every step in the order they were created, each whole (see :meth:`events`)."""
        out: list[dict[str, Any]] = []
        params: dict[str, Any] = {"run_id": self.id}
        while True:
            page = self._client.call("list_steps", params)
            for step in page["steps"]:
                whole = step
                if step.get("truncated"):
                    whole = self._client.call("get_step", {"run_id": self.id, "step_id": step["step_id"]})["step"]
                out.append(whole)
            if page.get("cursor") is None:
                return out
            params = {"run_id": self.id, "after": page["cursor"]}

    def stream(self, name: str = "default", start: int = 0, *, timeout: float | None = None) -> Iterator[Any]:
        """Yield the stream's values from ``start`` as they are written, until it closes (or the run ends)."""
        client = self._client

        def whole(chunk: dict[str, Any]) -> dict[str, Any]:
            if not chunk.get("truncated"):
                return chunk
            params = {"run_id": self.id, "name": name, "start": int(chunk["index"]), "limit": 1}
            first: dict[str, Any] = client.call("read_stream", params)["chunks"][0]
            return first

        def read(index: int, wait: float) -> tuple[list[Any], bool, int]:
            params = {"run_id": self.id, "name": name, "start": index, "wait": wait}
            page = client.call("read_stream", params, timeout=wait + client.timeout)
            chunks = [whole(c) for c in page["chunks"]]
            values = [base64.b64decode(c["bytes_b64"]) if "bytes_b64" in c else c["value"] for c in chunks]
            return values, bool(page["closed"]), int(page["next_index"])

        return _follow(
            read,
            lambda: self.status.terminal,
            start,
            timeout=timeout,
            idle_wait=10.0,
            what=f"stream {name!r} of run {self.id}",
        )

    def __repr__(self) -> str:
        return f"<HTTPRun {self.id}>"
