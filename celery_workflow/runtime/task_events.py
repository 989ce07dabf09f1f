"""Inline step attempts as Celery task events, so that a monitor (Flower, ``celery events``) lists them as tasks.

A step that runs inline (inside its workflow's delivery, not as a delivery of its own) is no Celery task: the worker
reports only the workflow delivery. :class:`InlineStepEvents` sends, for each inline attempt, the events the worker
would send for a task of its own: ``task-received`` and ``task-started`` when the attempt begins, then
``task-succeeded`` (its result and runtime), ``task-failed`` (the step failed for good) or ``task-retried`` (the step
runs again; also for an attempt cut short by an error of the World, whose delivery runs again).

Each attempt is a task with a uuid of its own, named ``step.<name>`` like a step's own deliveries, whose arguments
are ``[run_id, step_id]`` (as a step delivery's are), ``retries`` the attempts before it, and whose parent and root
are the workflow delivery it ran in. The fields are Celery's event vocabulary only: how they are sent (the worker's
event connection, and whether its task events are on at all) is the caller's (:mod:`celery_workflow.celery_tasks`);
this module knows nothing of Celery. A failure to send is logged and never fails the step.
"""

from __future__ import annotations

import logging
import reprlib
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from celery_workflow.task_names import step_task_name

__all__ = ["AttemptEvents", "EventSender", "InlineStepEvents"]

log = logging.getLogger("celery_workflow")

#: How much of a result a ``task-succeeded`` event shows (Flower shows the text as it is).
RESULT_REPR = 256


class EventSender(Protocol):
    """Sends one event: ``send("task-started", uuid=..., **fields)`` (Celery's ``EventDispatcher.send``)."""

    def __call__(self, type: str, **fields: Any) -> None: ...


_short = reprlib.Repr()
_short.maxstring = RESULT_REPR
_short.maxother = RESULT_REPR


def error_repr(error: Mapping[str, Any] | None) -> str:
    """A recorded error as Celery shows an exception in its events: ``Type('message')``."""
    error = error or {}
    return f"{error.get('type', 'Error')}({str(error.get('message', ''))!r})"


class AttemptEvents:
    """The events of one inline attempt, begun when it is made (``task-received``, ``task-started``)."""

    def __init__(self, owner: InlineStepEvents, task_id: str) -> None:
        self._owner = owner
        self.task_id = task_id
        self._began = owner.clock()

    def ended(self, verdict: str, *, result: Any = None, error: Mapping[str, Any] | None = None) -> None:
        """The attempt's outcome: ``verdict`` is :func:`~celery_workflow.runtime.steps.verdict`'s (``completed``,
        ``failed``, ``retrying``); ``result`` its JSON result, ``error`` its recorded error."""
        runtime = self._owner.clock() - self._began
        if verdict == "completed":
            self._owner.send("task-succeeded", uuid=self.task_id, result=_result_repr(result), runtime=runtime)
            return
        fields = {
            "uuid": self.task_id,
            "exception": error_repr(error),
            "traceback": str((error or {}).get("traceback", "")),
        }
        self._owner.send("task-failed" if verdict == "failed" else "task-retried", **fields)

    def interrupted(self, exc: BaseException) -> None:
        """The attempt raised past its outcome (an error of the World): its delivery runs again, and so does it."""
        kind = type(exc).__qualname__
        self._owner.send("task-retried", uuid=self.task_id, exception=f"{kind}({str(exc)!r})", traceback="")


class InlineStepEvents:
    """Sends the task events of the inline step attempts of one workflow delivery through ``send``.

    ``parent_id`` / ``root_id``: the workflow delivery's task id and root id (a monitor links the attempts to it).
    """

    def __init__(
        self,
        send: EventSender,
        *,
        parent_id: str | None,
        root_id: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        new_id: Callable[[], str] = lambda: str(uuid.uuid4()),
    ) -> None:
        self._send = send
        self.parent_id = parent_id
        self.root_id = root_id or parent_id
        self.clock = clock
        self.new_id = new_id

    def send(self, type: str, **fields: Any) -> None:
        try:
            self._send(type, **fields)
        except Exception as exc:  # a monitor's loss, never the step's
            log.debug("cannot send %s for an inline step: %s", type, exc)

    def attempt(self, step_name: str, run_id: str, step_id: str, attempt: int) -> AttemptEvents:
        """Announce an attempt that begins now; its :class:`AttemptEvents` reports how it ended."""
        task_id = self.new_id()
        self.send(
            "task-received",
            uuid=task_id,
            name=step_task_name(step_name),
            args=repr([run_id, step_id]),
            kwargs="{}",
            root_id=self.root_id,
            parent_id=self.parent_id,
            retries=max(0, attempt - 1),
            eta=None,
            expires=None,
        )
        self.send("task-started", uuid=task_id)
        return AttemptEvents(self, task_id)


def _result_repr(result: Any) -> str:
    """What Flower shows of a step's result (its JSON value): its ``repr``, cut to :data:`RESULT_REPR` characters."""
    try:
        return _short.repr(result)
    except Exception:
        return "<result>"
