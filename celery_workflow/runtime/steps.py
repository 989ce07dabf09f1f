"""Running a step body: its context, its outcome, and the retry policy. Shared by inline and queued steps."""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from celery_workflow import codec
from celery_workflow.errors import (
    FatalError,
    InvalidWebhookResponse,
    PayloadError,
    RetryableError,
    StepTimedOut,
    WorldError,
)
from celery_workflow.event_data import StepCompletedData, StepFailedData, StepRetryingData
from celery_workflow.events import NewEvent
from celery_workflow.runtime import context
from celery_workflow.runtime.context import StepContext, StepMetadata
from celery_workflow.runtime.registry import StepDef
from celery_workflow.telemetry.hooks import attempted
from celery_workflow.world import DEFAULT_MAX_PAYLOAD, World

MAX_BACKOFF = 300.0


@dataclass(frozen=True, slots=True)
class StepOutcome:
    ok: bool
    result: Any = None
    error: dict[str, Any] | None = None
    fatal: bool = False
    retry_after: float | timedelta | datetime | None = None


def payload_limit(world: World) -> int:
    """The World's ``max_payload`` (:data:`DEFAULT_MAX_PAYLOAD` for a World that declares none)."""
    return int(getattr(world, "max_payload", DEFAULT_MAX_PAYLOAD))


def error_info(exc: BaseException) -> dict[str, Any]:
    """A JSON description of an exception: its type, message and traceback, cut to :data:`codec.MAX_ERROR_TYPE`,
    :data:`codec.MAX_ERROR_MESSAGE` and :data:`codec.MAX_TRACEBACK` bytes (the traceback keeps its tail). An
    exception whose ``str()`` fails is described as ``<TypeName: str() failed>``."""
    kind = type(exc)
    name = (
        kind.__qualname__ if kind.__module__ in ("builtins", "__main__") else f"{kind.__module__}.{kind.__qualname__}"
    )
    try:
        message = str(exc)
    except Exception:
        message = f"<{kind.__qualname__}: str() failed>"
    try:
        tb = "".join(traceback.format_exception(exc))
    except Exception:  # pragma: no cover - the traceback module guards str() itself
        tb = f"{name}: {message}"
    return {
        "type": codec.cut(name, codec.MAX_ERROR_TYPE),
        "message": codec.cut(message, codec.MAX_ERROR_MESSAGE),
        "traceback": codec.cut(tb, codec.MAX_TRACEBACK, keep_end=True),
    }


@attempted
def execute(
    world: World,
    sdef: StepDef,
    *,
    run_id: str,
    workflow_name: str,
    step_id: str,
    data_input: Any,
    attempt: int,
    started_at: datetime,
    timeout_errors: tuple[type[BaseException], ...] = (),
) -> StepOutcome:
    """Run the step body once in a step context. User exceptions become outcomes; BaseExceptions propagate, and so
    do World errors (a stream write that found the World unavailable): they are not the step's outcome; the delivery
    is retried with backoff and the step started again, as after a worker crash.

    A result the World cannot store (over its ``max_payload``) is a fatal :class:`PayloadTooLarge` outcome, checked
    here before anything is appended: the same code would return the same size, so it is not retried.

    A step with a ``timeout`` whose attempt ran past it, or raised one of ``timeout_errors`` (the worker's time limit
    interrupting it: Celery's SoftTimeLimitExceeded, which counts from when the worker started the task), fails with
    :class:`StepTimedOut`.
    """
    try:
        args, kwargs = sdef.signature.decode_args(data_input)
    except PayloadError as exc:
        return StepOutcome(ok=False, error=error_info(exc), fatal=True)
    meta = StepMetadata(step_id, sdef.name, attempt, run_id, workflow_name, started_at)
    token = context.enter_step(StepContext(world=world, metadata=meta))
    began = time.monotonic()
    try:
        value = sdef.func(*args, **kwargs)
        result = codec.to_json(value)
        codec.check_size(result, payload_limit(world), f"the result of step {sdef.name}")
    except FatalError as exc:
        return StepOutcome(ok=False, error=error_info(exc), fatal=True)
    except RetryableError as exc:
        return StepOutcome(ok=False, error=error_info(exc), retry_after=exc.retry_after)
    except (PayloadError, InvalidWebhookResponse) as exc:
        # the same code produces the same value (or the same malformed response, which the webhook's caller has
        # already been answered a 500 for): not retried
        return StepOutcome(ok=False, error=error_info(exc), fatal=True)
    except WorldError:
        raise
    except Exception as exc:  # Celery's SoftTimeLimitExceeded too: past the timeout, it is StepTimedOut
        late = _timed_out(sdef, attempt, began, exc, interrupted=isinstance(exc, timeout_errors))
        return StepOutcome(ok=False, error=error_info(late if late is not None else exc))
    finally:
        context.exit_step(token)
    late = _timed_out(sdef, attempt, began, None, interrupted=False)
    if late is not None:  # it returned, but too late: the attempt failed (its result is not recorded)
        return StepOutcome(ok=False, error=error_info(late))
    return StepOutcome(ok=True, result=result)


def _timed_out(
    sdef: StepDef, attempt: int, began: float, raised: Exception | None, *, interrupted: bool
) -> StepTimedOut | None:
    """StepTimedOut when an attempt of a step with a ``timeout`` ran past it (whether it then returned or raised) or
    was ``interrupted`` by the worker's time limit, else None."""
    if sdef.timeout is None:
        return None
    took = time.monotonic() - began
    limit = sdef.timeout.total_seconds()
    if took < limit and not interrupted:
        return None
    how = f"; it raised {type(raised).__name__}: {raised!r}" if raised is not None else ""
    return StepTimedOut(f"attempt {attempt} of step {sdef.name} ran {took:.3f} s, past its timeout of {limit:g} s{how}")


def exceeded_starts(sdef: StepDef, step_id: str, attempt: int) -> NewEvent | None:
    """``step_failed`` when a step was started more often than its retries allow (a crash loop), else None."""
    if attempt <= sdef.max_retries + 1:
        return None
    error = {
        "type": "MaxRetriesExceeded",
        "message": f"step {sdef.name} started {attempt} times; it has at most {sdef.max_retries} retries",
    }
    return NewEvent.of(StepFailedData(error=error), step_id)


def record(
    sdef: StepDef, step_id: str, outcome: StepOutcome, attempt: int, now: datetime
) -> tuple[NewEvent, datetime | None]:
    """The event that records an attempt's outcome, and, for ``step_retrying``, when the step runs again.

    Success is ``step_completed``; a FatalError or the last allowed attempt is ``step_failed``; anything else is
    ``step_retrying`` at :func:`retry_at`. Inline and queued steps both decide here.
    """
    kind = verdict(sdef, outcome, attempt)
    if kind == "completed":
        return NewEvent.of(StepCompletedData(result=outcome.result), step_id), None
    if kind == "failed":
        return NewEvent.of(StepFailedData(error=outcome.error or {}), step_id), None
    when = retry_at(sdef, outcome, attempt, now)
    return NewEvent.of(StepRetryingData(error=outcome.error or {}, retry_after=when), step_id), when


def verdict(sdef: StepDef, outcome: StepOutcome, attempt: int) -> Literal["completed", "failed", "retrying"]:
    """What an attempt's outcome makes of its step: ``completed``; ``failed`` for good (a FatalError, or the last
    allowed attempt); else ``retrying``."""
    if outcome.ok:
        return "completed"
    if outcome.fatal or attempt >= sdef.max_retries + 1:
        return "failed"
    return "retrying"


def retry_at(sdef: StepDef, outcome: StepOutcome, attempt: int, now: datetime) -> datetime:
    """When a failed attempt runs again: the error's ``retry_after``, else capped exponential backoff."""
    after = outcome.retry_after
    if isinstance(after, datetime):
        return max(after, now)
    if isinstance(after, timedelta):
        return now + max(after, timedelta(0))
    if isinstance(after, (int, float)):
        return now + timedelta(seconds=max(0.0, float(after)))
    delay = min(MAX_BACKOFF, sdef.retry_backoff * (2 ** max(0, attempt - 1)))
    return now + timedelta(seconds=delay)
