"""What one delivery did: :class:`Handled`, as :meth:`~.handlers.Runtime.handle_workflow` and
:meth:`~.handlers.Runtime.handle_step` return it, and what a worker reports to Celery for it
(:mod:`celery_workflow.celery_tasks`)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

__all__ = ["Handled", "error_text"]


class Handled(str):
    """What one delivery did, as :meth:`Runtime.handle_workflow` and :meth:`Runtime.handle_step` return it.

    It is the ``str`` of its kind (``"completed"``, ``"suspended"``, ``"failed"``, ``"retrying"``, ``"ended"`` …),
    so logs and callers comparing it with a string see just that, and it says what a worker reports for it (Celery's
    task state, :mod:`celery_workflow.celery_tasks`): ``failure`` is the error this delivery recorded as final
    (``run_failed`` for a workflow delivery, ``step_failed`` for a step delivery), ``retry_at`` when a step attempt
    that failed with ``error`` runs again (its retry delivery is written).
    """

    failure: dict[str, Any] | None
    error: dict[str, Any] | None
    retry_at: datetime | None

    def __new__(
        cls,
        kind: str,
        *,
        failure: Mapping[str, Any] | None = None,
        error: Mapping[str, Any] | None = None,
        retry_at: datetime | None = None,
    ) -> Handled:
        handled = super().__new__(cls, kind)
        handled.failure = dict(failure) if failure is not None else None
        handled.error = dict(error) if error is not None else handled.failure
        handled.retry_at = retry_at
        return handled

    @property
    def kind(self) -> str:
        return str.__str__(self)

    def __repr__(self) -> str:
        extra = f", failure={self.failure!r}" if self.failure is not None else ""
        extra += f", retry_at={self.retry_at!r}" if self.retry_at is not None else ""
        return f"Handled({self.kind!r}{extra})"

    def __reduce__(self) -> tuple[Any, ...]:
        return _handled, (self.kind, self.failure, self.error, self.retry_at)


def _handled(
    kind: str, failure: dict[str, Any] | None, error: dict[str, Any] | None, retry_at: datetime | None
) -> Handled:
    return Handled(kind, failure=failure, error=error, retry_at=retry_at)


def error_text(error: Mapping[str, Any] | None) -> str:
    """A recorded error as one line: ``type: message``."""
    error = error or {}
    return f"{error.get('type', 'Error')}: {error.get('message', '')}"
