"""The vocabulary a replay and its delivery handler share: the control-flow exceptions that unwind a replay
(:class:`Suspend`, :class:`Restart`, :class:`WorldFault`, :class:`Refused`, :class:`Diverged`), the
:class:`Effects` protocol through which a replay does all its I/O, and the :class:`Outcome` it ends with.

Kept apart from :mod:`.replay` (the replay engine itself) so a handler can name them without the engine.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, Protocol, TypeVar

from celery_workflow.errors import EventInvalid, PayloadError, WorldError
from celery_workflow.events import Event, NewEvent
from celery_workflow.runtime.registry import StepDef, WorkflowDef
from celery_workflow.runtime.steps import StepOutcome
from celery_workflow.world import Delivery

T = TypeVar("T")


def brief(value: Any, limit: int = 200) -> str:
    """A JSON value for a divergence message, cut at ``limit`` characters (messages are stored in the log)."""
    text = json.dumps(value, sort_keys=True, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 1] + "…"


class Suspend(BaseException):
    """Unwinds the workflow function: the run waits for something not in the log yet."""


class Restart(BaseException):
    """The log moved under this replay (another writer appended): reload it and replay from the top."""


class WorldFault(BaseException):
    """The World failed under this replay (unavailable, throttled, a driver error): not the workflow's outcome.

    A ``BaseException``, so a workflow's ``except Exception`` cannot catch it (nor see it as a step's failure): the
    handler re-raises :attr:`error` and the delivery is retried with backoff, the run untouched."""

    def __init__(self, error: WorldError) -> None:
        super().__init__(str(error))
        self.error = error


class TimedOut(BaseException):
    """The run is past its deadline: the replay stops where it is and the run fails with RunTimedOut (a
    ``BaseException``, so the workflow's ``except Exception`` cannot keep it going)."""


class Refused(BaseException):
    """The World refused a write of this replay as malformed (:class:`EventInvalid`, a value it cannot store): the
    same write would be refused again, so the run fails at once with :attr:`error` as its cause (no retries)."""

    def __init__(self, error: EventInvalid | PayloadError) -> None:
        super().__init__(str(error))
        self.error = error


def guarded(call: Callable[[], T]) -> T:
    """Run a World call made under a replay, turning its infrastructure errors into :class:`WorldFault` and its
    refusals of bad data into :class:`Refused`, neither of which the workflow's code can catch."""
    try:
        return call()
    except WorldError as exc:
        raise WorldFault(exc) from exc
    except (EventInvalid, PayloadError) as exc:
        raise Refused(exc) from exc


class Diverged(BaseException):
    """The code and the event log disagree: the replay stops and the run is reported as diverged."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Effects(Protocol):
    """The I/O a replay needs, provided by the delivery handler."""

    delivery_id: str
    #: write step completions (and a pending run's start) with the delivery's next write instead of on their own
    defer_writes: bool

    def append(
        self, events: Sequence[NewEvent], deliveries: Sequence[Delivery], *, conditional: bool, final: bool = False
    ) -> list[Event]:
        """Append at the replay's event count (``conditional``: raise Restart if it moved) or at the next slot.

        ``final``: the delivery's last write, durable and acking the delivery; earlier writes need not be durable.
        """
        ...

    def wall_now(self) -> datetime: ...

    def inline_allowed(self) -> bool: ...

    def step_delivery(self, sdef: StepDef, step_id: str, not_before: datetime | None) -> Delivery: ...

    def take_token(self, token: str) -> None:
        """Take ``token`` from the live hook of another run that owns it (a forced claim): that hook is disposed in
        its own run's log (``hook_disposed`` with ``taken_by``) and its run woken, so its ``wait()`` raises
        HookConflict. Nothing when no other run's live hook owns the token."""
        ...

    def execute_step(
        self, sdef: StepDef, step_id: str, input: Any, attempt: int, started_at: datetime
    ) -> StepOutcome: ...

    def start_child(self, wdef: WorkflowDef, run_id: str, data_input: Any, correlation_id: str) -> None:
        """Create child run ``run_id`` of workflow ``wdef`` (its ``run_created`` linking it to this run's
        ``correlation_id``) with its first delivery; nothing when this run's child ``run_id`` exists already.
        EntityExists when the id belongs to a run that is not this run's child."""
        ...

    def may_hold_start(self, sdef: StepDef) -> bool:
        """Whether a new inline step of a run this delivery is the first to write may start unwritten: its
        ``step_created`` and ``step_started`` ride with the delivery's next write, beside the run's start. True
        only where no other delivery can reach the step meanwhile and the step is known to be quick (see
        :meth:`Replay._run_inline`)."""
        ...

    def may_batch_start(self, sdef: StepDef, unwritten: Sequence[NewEvent], oldest: datetime | None) -> bool:
        """Whether a new inline step may start unwritten beside ``unwritten`` (the replay's deferred events, the
        step's creation and start last), the oldest held start at ``oldest`` (None: none held): only on a World that
        wants batched appends, for a step known to be quick, within the batch's window and size (see
        :mod:`.holding`, which says what a crash or a duplicate delivery then re-runs)."""
        ...


@dataclass(slots=True)
class Outcome:
    kind: Literal["completed", "failed", "suspended", "diverged", "continued"]
    output: Any = None
    error: Mapping[str, Any] | None = None
    code: str | None = None  # a failure's code in ``run_failed`` (RUN_TIMED_OUT)
