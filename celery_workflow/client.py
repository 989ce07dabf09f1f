"""Handles on runs from outside a workflow: :class:`Run`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from celery_workflow import codec
from celery_workflow.errors import ResultTimeout, RunCancelled, WorkflowFailed
from celery_workflow.events import Event, RunStatus, RunView, StepView

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
    def workflow_name(self) -> str:
        return self.view().workflow_name

    @property
    def created_at(self) -> datetime:
        return self.view().created_at

    def result(self, timeout: float | None = None) -> R:
        """Wait for the run to end; return its output or raise WorkflowFailed / RunCancelled / ResultTimeout."""
        view: RunView = self._world.wait_for_terminal(self.id, timeout)
        if view.status is RunStatus.COMPLETED:
            returns = self._returns
            if returns is _ANY:
                wdef = self._runtime.registry.workflows.get(view.workflow_name)
                returns = wdef.signature.returns if wdef else _ANY
            value: R = codec.from_json(view.output, returns) if returns is not _ANY else view.output
            return value
        if view.status is RunStatus.FAILED:
            raise WorkflowFailed(run_id=self.id, error=dict(view.error or {}))
        if view.status is RunStatus.CANCELLED:
            raise RunCancelled(run_id=self.id)
        raise ResultTimeout(f"run {self.id} is still {view.status} after {timeout} s")

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
        deadline = None if timeout is None else time.monotonic() + timeout
        index = start
        world = self._world
        while True:
            wait = world.poll_interval * 20 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            page = world.read_stream(self.id, name, start=index, wait=wait)
            for chunk in page.chunks:
                yield codec.loads(chunk.data)
            index = page.next_index
            if page.closed and not page.chunks:
                return
            if not page.chunks and world.get_run(self.id).status.terminal:
                last = world.read_stream(self.id, name, start=index)
                if not last.chunks:
                    return
            if deadline is not None and time.monotonic() >= deadline and not page.chunks:
                raise ResultTimeout(f"stream {name!r} of run {self.id} did not end within {timeout} s")

    def __repr__(self) -> str:
        return f"<Run {self.id}>"
