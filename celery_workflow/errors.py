"""The exception tree of celery_workflow.

Every error the library raises derives from :class:`CeleryWorkflowError`::

    CeleryWorkflowError
    ├── ConfigurationError          bad setup: unknown queue in a route, duplicate names, bad World URL
    │   ├── InvalidWebhookResponse  ``create_webhook(respond_with=...)`` given a malformed fixed response
    │   └── InvalidSchedule         ``wf.schedule(...)``: a bad cron expression, time zone, overlap or catch-up
    ├── PayloadError                a value that cannot be encoded or decoded as a payload
    │   └── PayloadTooLarge
    ├── WorldError                  a storage or driver failure (the driver error is ``__cause__``)
    │   └── SchemaVersionError      the database was migrated by a newer celery_workflow
    │       └── EventUnreadable     a stored event does not fit this version's event data (newer, or damaged)
    │           └── UnknownEventType  of a type this version does not know (also a ValueError)
    ├── EventRejected               a transition rule refused an append; nothing was written
    │   ├── EventInvalid            malformed or oversized event (400)
    │   │   └── EventTooLarge       event data over the size limit (also a PayloadTooLarge)
    │   ├── NotFound                (404)
    │   │   ├── RunNotFound, StepNotFound, HookNotFound, WaitNotFound
    │   ├── EventConflict           (409)
    │   │   ├── RunTerminal         the run has ended
    │   │   ├── EntityExists        the step, hook or wait was already created
    │   │   ├── EntityTerminal      the step or wait already has its terminal event
    │   │   ├── StaleLog            the append expected another event count
    │   │   └── WebhookUsed         a webhook that answers once has already received its request
    │   └── TooEarly                a step's retry delay has not passed (425)
    ├── WorkflowNotFound            no workflow registered under that name
    ├── DeadLetterNotFound          no dead letter with that id
    ├── ScheduleNotFound            no schedule with that id
    ├── InvalidCursor               a list_runs cursor that no listing returned (also a ValueError)
    ├── DeadLettered                a run's delivery was moved to the dead letters (the cause of its failure)
    ├── ReplayDivergence            the event log does not match the workflow code
    ├── HookConflict                a hook's token is owned by another live hook
    ├── StepFailed                  raised inside a workflow when a step failed for good
    ├── WorkflowFailed              raised by ``Run.result`` for a failed run
    │   └── RunTimedOut             the run passed its deadline (``@wf.workflow(timeout=...)``)
    ├── RunCancelled                raised by ``Run.result`` for a cancelled run
    ├── ResultTimeout               ``Run.result(timeout=...)`` ran out of time
    ├── FatalError                  raised by user code: fail the step without retrying
    ├── RetryableError              raised by user code: retry the step, optionally after a delay
    ├── StepTimedOut                a step attempt ran past its ``timeout`` (a failed attempt, retried)
    └── TickFailed                  every part of a Lambda tick invocation failed (schedules and outbox sweep)

The class docstring is the default message.

Recorded errors: an exception that fails a step or a run is recorded in the event log as its type name, its message
cut to :data:`celery_workflow.codec.MAX_ERROR_MESSAGE` (8 KiB) and its traceback to
:data:`celery_workflow.codec.MAX_TRACEBACK` (32 KiB, the tail kept), each cut marked ``… [truncated N bytes]``; an
exception whose ``str()`` fails is recorded as ``"<TypeName: str() failed>"``. A step result, run output or input
larger than the World's ``max_payload`` is :class:`PayloadTooLarge`, raised where the value is produced: a step fails
with it at once (no retry: the same code returns the same size) and the workflow sees a :class:`StepFailed` whose
``error`` names it; a workflow's output fails the run with it.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any


class CeleryWorkflowError(Exception):
    """A celery_workflow error."""

    def __init__(self, message: str | None = None, *args: Any) -> None:
        super().__init__(message or (self.__doc__ or "").strip().splitlines()[0], *args)

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class ConfigurationError(CeleryWorkflowError):
    """Invalid configuration."""


class InvalidWebhookResponse(ConfigurationError):
    """The fixed response given to ``create_webhook(respond_with=...)`` is malformed."""


class PayloadError(CeleryWorkflowError):
    """The value cannot be encoded or decoded as a payload."""


class PayloadTooLarge(PayloadError):
    """The payload is larger than the World accepts."""


class WorldError(CeleryWorkflowError):
    """The World's storage failed."""


class WorldUnavailable(WorldError):
    """The World's store is unavailable for now (throttled, unreachable, failing): nothing was lost; retry later."""


class SchemaVersionError(WorldError):
    """The database schema is newer than this version of celery_workflow."""


class EventUnreadable(SchemaVersionError):
    """A stored event does not fit this version's event data (written by a newer celery_workflow, or damaged)."""


class UnknownEventType(EventUnreadable, ValueError):
    """The event type is not one this version of celery_workflow knows."""


class EventRejected(CeleryWorkflowError):
    """The event was rejected by a transition rule; nothing was written."""

    status: int = 400


class EventInvalid(EventRejected):
    """The event is malformed."""

    status = 400


class EventTooLarge(EventInvalid, PayloadTooLarge):
    """The event's data is larger than a World stores."""

    status = 413


class NotFound(EventRejected, LookupError):
    """Not found."""

    status = 404


class RunNotFound(NotFound):
    """No such run."""


class StepNotFound(NotFound):
    """No such step."""


class HookNotFound(NotFound):
    """No live hook with that token or id."""


class WaitNotFound(NotFound):
    """No such wait."""


class EventConflict(EventRejected):
    """The event conflicts with the run's current state."""

    status = 409


class RunTerminal(EventConflict):
    """The run has already ended."""


class EntityExists(EventConflict):
    """The step, hook or wait already exists."""


class EntityTerminal(EventConflict):
    """The step or wait already has its terminal event."""


class StaleLog(EventConflict):
    """The run's event count is not the one the append expected."""


class WebhookUsed(EventConflict):
    """The webhook answers once and has already received its request."""


class TooEarly(EventRejected):
    """The step may not start before its retry time."""

    status = 425

    def __init__(self, message: str | None = None, *, retry_after: datetime) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class WorkflowNotFound(CeleryWorkflowError, LookupError):
    """No workflow is registered under that name."""


class DeadLetterNotFound(CeleryWorkflowError, LookupError):
    """No dead letter has that id (it was redriven or purged, or never existed)."""


class InvalidCursor(CeleryWorkflowError, ValueError):
    """The cursor was not returned by a listing of runs."""


class DeadLettered(CeleryWorkflowError):
    """A delivery of the run was moved to the dead letters: no consumer could process it."""


class ReplayDivergence(CeleryWorkflowError):
    """The run's event log does not match what the workflow code does."""


class HookConflict(CeleryWorkflowError):
    """The hook's token is owned by another live hook."""

    def __init__(self, message: str | None = None, *, token: str = "", conflicting_run_id: str | None = None) -> None:
        # the default message names no token (it may be recorded as a run's error, which readers see without it)
        super().__init__(message or f"the hook's token is owned by run {conflicting_run_id}")
        self.token = token
        self.conflicting_run_id = conflicting_run_id


class StepFailed(CeleryWorkflowError):
    """A step failed for good."""

    def __init__(
        self, message: str | None = None, *, step_id: str = "", step_name: str = "", error: dict[str, Any] | None = None
    ) -> None:
        err = error or {}
        super().__init__(
            message or f"step {step_name or step_id} failed: {err.get('type', 'Error')}: {err.get('message', '')}"
        )
        self.step_id = step_id
        self.step_name = step_name
        self.error = err

    @property
    def error_type(self) -> str:
        return str(self.error.get("type", ""))


class WorkflowFailed(CeleryWorkflowError):
    """The run failed."""

    def __init__(self, message: str | None = None, *, run_id: str = "", error: dict[str, Any] | None = None) -> None:
        err = error or {}
        super().__init__(message or f"run {run_id} failed: {err.get('type', 'Error')}: {err.get('message', '')}")
        self.run_id = run_id
        self.error = err


class RunCancelled(CeleryWorkflowError):
    """The run was cancelled."""

    def __init__(self, message: str | None = None, *, run_id: str = "") -> None:
        super().__init__(message or f"run {run_id} was cancelled")
        self.run_id = run_id


class ResultTimeout(CeleryWorkflowError, TimeoutError):
    """The run did not finish in time."""


class FatalError(CeleryWorkflowError):
    """The step failed and must not be retried."""


class RetryableError(CeleryWorkflowError):
    """The step failed and should be retried."""

    def __init__(self, message: str | None = None, *, retry_after: float | timedelta | datetime | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


# -- issue #30, item 4: deadlines ------------------------------------------------------------------------------------


class RunTimedOut(WorkflowFailed):
    """The run passed its deadline (``@wf.workflow(timeout=...)``): it failed, and its steps are no longer run.

    Raised by ``Run.result`` for a run whose recorded error is this type (see :func:`run_failure`)."""


class StepTimedOut(CeleryWorkflowError):
    """A step attempt ran past its ``timeout``: a failed attempt, retried like any other until ``max_retries``."""


def run_failure(run_id: str, error: dict[str, Any]) -> WorkflowFailed:
    """The exception ``Run.result`` raises for a failed run with the recorded ``error``: :class:`RunTimedOut` for a
    run that passed its deadline, :class:`WorkflowFailed` for any other failure."""
    if error.get("type") == f"{__name__}.{RunTimedOut.__qualname__}":
        return RunTimedOut(run_id=run_id, error=error)
    return WorkflowFailed(run_id=run_id, error=error)


# -- issue #30, item 3: schedules ------------------------------------------------------------------------------------


class InvalidSchedule(ConfigurationError, ValueError):
    """A schedule that cannot be kept: a malformed cron expression, an unknown time zone, an unknown overlap
    policy, a negative catch-up window, an id a run id cannot carry, or a cron expression no date ever matches."""


class ScheduleNotFound(CeleryWorkflowError, LookupError):
    """No schedule with that id in the World."""


# -- issue #29, item 3: what a delivery reports to Celery (and so to Flower) -----------------------------------------


class DeliveryReport(CeleryWorkflowError):
    """Raised by a workflow or step task (``celery_workflow.celery_tasks``) after its delivery's outcome is in the
    World, so that Celery reports the delivery as it went: its message is the recorded error (``type: message``).
    The World already holds everything (the delivery is acked by that write): Celery acks the message too and never
    retries it (see ``DeliveryRequest``). Not raised outside a Celery task."""


class RunFailedReport(DeliveryReport):
    """This workflow delivery failed its run (it appended ``run_failed``): the task's state is FAILURE."""


class StepFailedReport(DeliveryReport):
    """This step delivery's attempt failed the step for good (``step_failed``): the task's state is FAILURE."""


class StepAttemptFailed(DeliveryReport):
    """This step delivery's attempt failed and the step will run again (``step_retrying``, its retry delivery
    written): the cause Celery's ``Retry`` carries, so the task's state is RETRY and ``task-retried`` names it."""


# -- Lambda-only deployments: the tick handler -------------------------------------------------------------------


class TickFailed(CeleryWorkflowError):
    """Every part of a Lambda tick invocation failed (the schedules' ticker and the outbox sweep: see
    :func:`celery_workflow.aws_lambda.tick_handler`); the message names each part's error, the last one is the
    ``__cause__``. Raised so that Lambda records the invocation as failed."""
