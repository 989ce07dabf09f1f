"""OpenTelemetry spans (imported only by a :class:`~celery_workflow.telemetry.Telemetry` whose spans are on, and only
when ``opentelemetry-api`` is installed).

The trace of a run is carried by its ``run_created``: ``Runtime.start`` records the W3C ``traceparent`` of its span
there, and every delivery of the run, in whatever process, starts its span as a child of it. So a run is one trace:
``start <workflow>`` → ``deliver workflow.<name>`` / ``deliver step.<name>`` → ``step <name>`` and
``world.append``. The API's tracer provider is used unless one is given: with only the API installed, spans are
the API's no-op spans.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

#: Span attribute names (all under ``celery_workflow.``).
RUN_ID = "celery_workflow.run_id"
WORKFLOW = "celery_workflow.workflow"
STEP = "celery_workflow.step"
STEP_ID = "celery_workflow.step_id"
ATTEMPT = "celery_workflow.attempt"
QUEUE = "celery_workflow.queue"
OUTCOME = "celery_workflow.outcome"
DELIVERY_ID = "celery_workflow.delivery_id"
KIND = "celery_workflow.kind"
EVENTS = "celery_workflow.events"
CREATED = "celery_workflow.created"

KINDS = {"start": SpanKind.PRODUCER, "delivery": SpanKind.CONSUMER, "attempt": SpanKind.INTERNAL}


class Tracing:
    """Opens the package's spans on a tracer of ``provider`` (the API's global provider when None)."""

    def __init__(self, provider: Any = None, *, version: str | None = None) -> None:
        self.tracer = trace.get_tracer("celery_workflow", version, tracer_provider=provider)
        self.propagator = TraceContextTextMapPropagator()

    def span(
        self, name: str, kind: str, attributes: Mapping[str, Any], *, traceparent: str | None = None
    ) -> AbstractContextManager[Any]:
        """A span made current while the context manager is open: a child of ``traceparent`` if given, else of the
        current span. An exception leaving it is recorded and sets the ERROR status."""
        parent = self.propagator.extract({"traceparent": traceparent}) if traceparent else None
        return self.tracer.start_as_current_span(
            name, context=parent, kind=KINDS.get(kind, SpanKind.CLIENT), attributes=dict(attributes)
        )

    def traceparent(self) -> str | None:
        """The ``traceparent`` of the current span, None when there is no valid one."""
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier)
        return carrier.get("traceparent")


def finish(span: Any, attributes: Mapping[str, Any], *, error: str | None = None) -> None:
    """Set ``attributes`` (None values left out) on ``span``; ``error``: its ERROR status description."""
    span.set_attributes({k: v for k, v in attributes.items() if v is not None})
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
