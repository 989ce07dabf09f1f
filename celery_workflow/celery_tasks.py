"""The Celery tasks of a :class:`~celery_workflow.app.Workflows` app: what a worker runs for a delivery, and what it
reports to Celery (and so to Flower and ``celery events``).

Each workflow gets a task named ``workflow.<name>`` and each step ``step.<name>``; a delivery message carries the
run id (and step id) as task arguments, and the delivery id as the task id. Tasks are ``acks_late`` with
``reject_on_worker_lost`` and do not ack on failure: an infrastructure error (the World unreachable, say) puts the
delivery back with a backoff and the error in its history (:func:`put_back`), until its queue's delivery limit
dead-letters it (:mod:`celery_workflow.dead_letters`). Step retries and failures are recorded in the World, never
left to Celery.

**What Celery is told** (issue #29, item 3). Once a delivery's outcome is in the World (the write that acks it), the
task reports it as it went (:func:`report`):

* a workflow delivery that failed its run raises :class:`~celery_workflow.errors.RunFailedReport`, and a step
  delivery whose step failed for good :class:`~celery_workflow.errors.StepFailedReport`, each with the recorded
  error as its message: the task's state is FAILURE and its ``task-failed`` event names the error;
* a step attempt that failed and will run again raises Celery's ``Retry`` (its ``when`` the retry's due time, its
  ``exc`` a :class:`~celery_workflow.errors.StepAttemptFailed`): state RETRY, event ``task-retried``. Raised
  directly, not through ``task.retry()``, it publishes nothing: the World already holds the retry delivery.

:class:`DeliveryRequest` (the tasks' Celery ``Request``) acks the message of such a failure instead of rejecting it
(a reject would dead-letter it on a broker with a dead-letter exchange, or back it off on our transports), and these
exceptions are the tasks' ``throws`` (logged without a traceback: they are outcomes, not errors of the worker). A
``Retry`` is acked by Celery itself (``acks_late``).

**Inline steps** are reported as tasks of their own (:mod:`celery_workflow.runtime.task_events`) when the worker
sends task events (``-E``, ``worker_send_task_events``, or ``celery control enable_events``): the worker's main
process reads its event dispatcher when it receives a delivery and tells the task (:data:`TASK_EVENTS`, a field of
the task's request); the task then sends the attempts' events through a dispatcher of its own process (a producer
of the app's pool, taken for each event). With task events off nothing is opened or sent.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from billiard.einfo import ExceptionWithTraceback
from celery.exceptions import Retry
from celery.worker.request import Request

from celery_workflow.errors import DeliveryReport, RunFailedReport, StepAttemptFailed, StepFailedReport
from celery_workflow.runtime.handled import Handled, error_text
from celery_workflow.runtime.task_events import InlineStepEvents
from celery_workflow.task_names import python_identifier, step_task_name, workflow_task_name
from celery_workflow.transport.store import backoff
from celery_workflow.world import Claim, World

if TYPE_CHECKING:
    from celery_workflow.app import Workflows
    from celery_workflow.runtime.registry import StepDef, WorkflowDef

__all__ = [
    "HARD_LIMIT_GRACE",
    "TASK_EVENTS",
    "DeliveryRequest",
    "claim_of",
    "put_back",
    "register_step_task",
    "register_workflow_task",
    "report",
    "task_events_on",
]

log = logging.getLogger("celery_workflow")

#: Seconds between a step's soft time limit (its ``timeout``: the body gets SoftTimeLimitExceeded) and its hard time
#: limit (the pool process is killed; the delivery comes back when its lease ends and the attempt counts as started).
HARD_LIMIT_GRACE = 10.0
#: The request field that tells a task its worker sends task events, and as which node (the worker's event
#: dispatcher's hostname; None: task events are off): set by :class:`DeliveryRequest`.
TASK_EVENTS = "celery_workflow_task_events"


def task_events_on(dispatcher: Any) -> bool:
    """Whether a worker's event dispatcher sends task events: enabled, and its groups (none: all) take ``task``."""
    if dispatcher is None or not getattr(dispatcher, "enabled", False):
        return False
    groups = getattr(dispatcher, "groups", None)
    return not groups or "task" in groups


class DeliveryRequest(Request):  # type: ignore[misc]  # Celery is untyped
    """The worker's request of a workflow or step delivery (made in the worker's main process).

    It tells the task whether the worker sends task events (:data:`TASK_EVENTS`, read from the dispatcher as the
    delivery is received), and acks the message of a task that raised a :class:`DeliveryReport`: its outcome is in
    the World, which acked the delivery with it; Celery must neither redeliver nor dead-letter the message."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the dispatcher's hostname (the worker's node name, which a pool's request may not carry): None when off
        self._request_dict[TASK_EVENTS] = self._eventer.hostname if task_events_on(self._eventer) else None

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> Any:
        exc = exc_info.exception
        if isinstance(exc, ExceptionWithTraceback):  # as a prefork child's exception arrives
            exc = exc.exc
        if isinstance(exc, DeliveryReport):
            self.acknowledge()  # before Celery's reject (acks_on_failure is off), which then does nothing
        return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)


def report(handled: Handled, *, step: bool) -> None:
    """Raise what Celery reports for ``handled`` (see the module docstring); nothing for a delivery that went on."""
    if handled.retry_at is not None:
        cause = StepAttemptFailed(error_text(handled.error))
        raise Retry(error_text(handled.error), exc=cause, when=handled.retry_at)
    if handled.failure is not None:
        kind = StepFailedReport if step else RunFailedReport
        raise kind(error_text(handled.failure))


class _EventSender:
    """Sends events on a dispatcher of this process: Celery's ``default_dispatcher``, on a producer of the app's pool
    (the broker the worker's own events use), taken for each event and given back at once, so that a delivery never
    holds one while its steps publish tasks of their own (a pool of threads could otherwise drain the producers)."""

    def __init__(self, celery_app: Any, hostname: str) -> None:
        self._app = celery_app
        self._hostname = hostname

    def __call__(self, type: str, **fields: Any) -> None:
        with self._app.events.default_dispatcher(hostname=self._hostname) as dispatcher:
            dispatcher.send(type, **fields)


def task_options() -> dict[str, Any]:
    return {
        "bind": True,
        "acks_late": True,
        "reject_on_worker_lost": True,
        "acks_on_failure_or_timeout": False,
        "ignore_result": True,
        "typing": False,
        "Request": DeliveryRequest,
        "throws": (DeliveryReport,),
        # a workflow's tasks belong to its app: a shared task would be built into every Celery app the process
        # finalizes, under names (and with a World) that app knows nothing of
        "shared": False,
    }


def register_workflow_task(wf: Workflows, wdef: WorkflowDef) -> None:
    """Register ``workflow.<name>``: one workflow delivery (:meth:`Runtime.handle_workflow`)."""
    runtime = wf.runtime

    def run_workflow(task: Any, run_id: str) -> str:
        claim = claim_of(task)
        node = getattr(task.request, TASK_EVENTS, None)
        events = None
        if node:  # the worker sends task events: this delivery's inline steps are tasks too
            sender = _EventSender(task.app, str(node))
            events = InlineStepEvents(sender, parent_id=task.request.id, root_id=task.request.root_id)
        try:
            handled = runtime.handle_workflow(
                run_id, delivery_id=str(task.request.id), claim=claim, workflow_name=wdef.name, task_events=events
            )
        except Exception as exc:
            put_back(wf.world, claim, exc)
            raise
        report(handled, step=False)
        return handled.kind

    task_name = workflow_task_name(wdef.name)
    run_workflow.__name__ = run_workflow.__qualname__ = python_identifier(task_name)
    wf.celery_app.task(name=task_name, **task_options())(run_workflow)


def register_step_task(wf: Workflows, sdef: StepDef) -> None:
    """Register ``step.<name>``: one step delivery (:meth:`Runtime.handle_step`), under the step's time limits."""
    runtime = wf.runtime

    def run_step(task: Any, run_id: str, step_id: str) -> str:
        claim = claim_of(task)
        try:
            handled = runtime.handle_step(
                run_id, step_id, delivery_id=str(task.request.id), claim=claim, step_name=sdef.name
            )
        except Exception as exc:
            put_back(wf.world, claim, exc)
            raise
        report(handled, step=True)
        return handled.kind

    task_name = step_task_name(sdef.name)
    run_step.__name__ = run_step.__qualname__ = python_identifier(task_name)
    limits: dict[str, float] = {}
    if sdef.timeout is not None:  # the body gets SoftTimeLimitExceeded; one that ignores it is killed
        soft = sdef.timeout.total_seconds()
        limits = {"soft_time_limit": soft, "time_limit": soft + HARD_LIMIT_GRACE}
    wf.celery_app.task(name=task_name, **task_options(), **limits)(run_step)


def put_back(world: World, claim: Claim | None, exc: Exception) -> None:
    """A delivery whose handling failed (the World unreachable, a bug): due again after a backoff, with the error
    recorded in its history. Celery then rejects it, which changes nothing any more (its receipt is stale);
    after the queue's delivery limit the transport moves it to the dead letters and fails its run."""
    if claim is None:
        return
    try:
        error = f"{type(exc).__name__}: {exc}"
    except Exception:
        error = f"{type(exc).__name__}: <str() failed>"
    try:
        world.retry_later(claim.receipt, backoff(claim.attempts), error=error)
    except Exception as again:
        log.warning("cannot put delivery %s back (%s); it returns when its lease runs out", claim.receipt, again)


def claim_of(task: Any) -> Claim | None:
    """The transport's claim of the delivery a task is handling (None when it did not come from our transports).

    Our transports put it in ``delivery_info``; Celery keeps that in the request's message properties (it rebuilds
    ``request.delivery_info`` itself). The relay (``Workflows(broker="app")``) puts it in the message's headers.
    """
    properties = getattr(task.request, "properties", None) or {}
    found = Claim.from_delivery_info(properties.get("delivery_info"))
    # a message the relay published on the app's broker carries it in its headers (request attributes, to a task)
    return found if found is not None else Claim.from_attributes(task.request)
