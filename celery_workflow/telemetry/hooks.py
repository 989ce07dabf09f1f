"""The hook points the runtime and the World call, and what they call when no telemetry is configured: nothing.

A :class:`Probe` is what ``Runtime.telemetry`` (and a World's ``telemetry``) holds. This base records nothing; its
``enabled`` is False and the decorators below then call the wrapped function straight away (one attribute read),
so a :class:`~celery_workflow.app.Workflows` without ``telemetry=`` pays nothing and imports neither OpenTelemetry
nor prometheus_client. :class:`celery_workflow.telemetry.Telemetry` is the probe that records.

Each hook is one decorator on the function it observes (:func:`started`, :func:`delivered`, :func:`attempted`,
:func:`appended`): the logic stays here, the runtime's modules carry one line each. A delivery's probe is also kept
in a context variable while the delivery runs (:func:`scope`), which is how a step attempt (run inline by a workflow
delivery or by its own step delivery) finds it, and where the log fields (:mod:`.logs`) come from.

This module imports nothing of celery_workflow: the runtime, the World side and the Worlds all import it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


class Mark:
    """What a hook's context manager yields: :meth:`done` hands the observed call's result over (and returns it).
    This one records nothing; it is its own context manager."""

    def done(self, value: T) -> T:
        return value

    def __enter__(self) -> Mark:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        return None


class Probe:
    """The hooks, recording nothing (``Workflows`` without ``telemetry=``)."""

    #: False: the decorators call the observed function without entering any hook.
    enabled: bool = False

    def traceparent(self) -> str | None:
        """The W3C ``traceparent`` of the current span (recorded in a new run's ``run_created``), or None."""
        return None

    def start(self, workflow: str) -> AbstractContextManager[Mark]:
        """Around ``Runtime.start``: ``done`` gets its ``(RunView, created)``."""
        return Mark()

    def delivery(
        self,
        runtime: Any,
        kind: str,
        run_id: str,
        *,
        name: str | None,
        step_id: str | None,
        delivery_id: str,
        attempts: int,
    ) -> AbstractContextManager[Mark]:
        """Around one workflow or step delivery (``kind``) that ``runtime`` handles: ``done`` gets what the handler
        returned."""
        return Mark()

    def attempt(
        self, *, run_id: str, workflow: str, step: str, step_id: str, attempt: int
    ) -> AbstractContextManager[Mark]:
        """Around one attempt of a step's body: ``done`` gets its ``StepOutcome``."""
        return Mark()

    def append(self, run_id: str, events: int) -> AbstractContextManager[Mark]:
        """Around one World append of ``events`` events: ``done`` gets its ``AppendResult``."""
        return Mark()


#: The probe of the delivery (or start) running in this context, and its log fields; None outside one.
_SCOPE: ContextVar[tuple[Probe, Mapping[str, Any]] | None] = ContextVar("celery_workflow_telemetry", default=None)


@contextmanager
def scope(probe: Probe, **fields: Any) -> Iterator[None]:
    """Make ``probe`` the current one and add ``fields`` (None values left out) to the current log fields."""
    outer = _SCOPE.get()
    merged = {**(outer[1] if outer is not None else {}), **{k: v for k, v in fields.items() if v is not None}}
    token = _SCOPE.set((probe, merged))
    try:
        yield
    finally:
        _SCOPE.reset(token)


def current_fields() -> Mapping[str, Any]:
    """The log fields of the delivery or attempt running in this context (empty outside one)."""
    found = _SCOPE.get()
    return found[1] if found is not None else {}


class _Observed(Protocol):
    telemetry: Probe


S = TypeVar("S", bound=_Observed)


def started(start: Callable[Concatenate[S, str, P], R]) -> Callable[Concatenate[S, str, P], R]:
    """``Runtime.start(workflow_name, ...)``: its span is current while the run is created (its traceparent is
    recorded with it)."""

    @functools.wraps(start)
    def observed(runtime: S, workflow_name: str, /, *args: P.args, **kwargs: P.kwargs) -> R:
        probe = runtime.telemetry
        if not probe.enabled:
            return start(runtime, workflow_name, *args, **kwargs)
        with probe.start(workflow_name) as mark:
            return mark.done(start(runtime, workflow_name, *args, **kwargs))

    return observed


def delivered(kind: str) -> Callable[[Callable[Concatenate[S, str, P], R]], Callable[Concatenate[S, str, P], R]]:
    """``Runtime.handle_workflow(run_id, ...)`` (``kind="workflow"``) or ``handle_step(run_id, step_id, ...)``."""

    def decorate(handle: Callable[Concatenate[S, str, P], R]) -> Callable[Concatenate[S, str, P], R]:
        @functools.wraps(handle)
        def observed(runtime: S, run_id: str, /, *args: P.args, **kwargs: P.kwargs) -> R:
            probe = runtime.telemetry
            if not probe.enabled:
                return handle(runtime, run_id, *args, **kwargs)
            claim = kwargs.get("claim")
            step_id = kwargs.get("step_id", args[0] if args else None) if kind == "step" else None
            hook = probe.delivery(
                runtime,
                kind,
                run_id,
                name=_opt_str(kwargs.get("workflow_name" if kind == "workflow" else "step_name")),
                step_id=_opt_str(step_id),
                delivery_id=str(kwargs.get("delivery_id")),
                attempts=int(getattr(claim, "attempts", 1)),
            )
            with hook as mark:
                return mark.done(handle(runtime, run_id, *args, **kwargs))

        return observed

    return decorate


def attempted(execute: Callable[P, R]) -> Callable[P, R]:
    """``steps.execute(world, sdef, *, run_id, workflow_name, step_id, attempt, ...)``: observed by the probe of the
    delivery running it (none outside a delivery)."""

    @functools.wraps(execute)
    def observed(*args: P.args, **kwargs: P.kwargs) -> R:
        found = _SCOPE.get()
        if found is None or not found[0].enabled:
            return execute(*args, **kwargs)
        hook = found[0].attempt(
            run_id=str(kwargs["run_id"]),
            workflow=str(kwargs["workflow_name"]),
            step=str(getattr(args[1], "name", "")),
            step_id=str(kwargs["step_id"]),
            attempt=int(kwargs["attempt"]),  # type: ignore[call-overload]
        )
        with hook as mark:
            return mark.done(execute(*args, **kwargs))

    return observed


class _Appending(Protocol):
    telemetry: Probe | None


W = TypeVar("W", bound=_Appending)


def appended(append: Callable[Concatenate[W, str, P], R]) -> Callable[Concatenate[W, str, P], R]:
    """A World's ``append(run_id, events, ...)``, observed by the probe the World was given (its ``telemetry``)."""

    @functools.wraps(append)
    def observed(world: W, run_id: str, /, *args: P.args, **kwargs: P.kwargs) -> R:
        probe = world.telemetry
        if probe is None or not probe.enabled:
            return append(world, run_id, *args, **kwargs)
        events = args[0] if args else kwargs.get("events", ())
        with probe.append(run_id, len(events) if isinstance(events, (list, tuple)) else 0) as mark:
            return mark.done(append(world, run_id, *args, **kwargs))

    return observed


def _opt_str(value: object) -> str | None:
    return None if value is None else str(value)
