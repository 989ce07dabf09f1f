""":class:`Telemetry`: the probe that records spans, metrics and log fields for the ``Workflows`` it is given to."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from celery_workflow.events import EventType
from celery_workflow.telemetry import hooks, logs
from celery_workflow.telemetry.hooks import Mark, Probe

if TYPE_CHECKING:
    from celery_workflow.app import Workflows
    from celery_workflow.telemetry.metrics import Metrics
    from celery_workflow.telemetry.spans import Tracing

log = logging.getLogger("celery_workflow.telemetry")

T = TypeVar("T")

_RUN_ENDS = frozenset({EventType.RUN_COMPLETED, EventType.RUN_FAILED, EventType.RUN_CANCELLED})


@dataclass(frozen=True, slots=True)
class _RunFacts:
    """What a run's ``run_created`` says that its deliveries' spans need."""

    workflow: str
    queue: str | None
    traceparent: str | None


class _Hook(Mark):
    """One observed call: its log fields and span while it runs, then ``finish`` (span attributes, metrics)."""

    def __init__(
        self,
        telemetry: Telemetry,
        kind: str,
        name: str,
        attributes: dict[str, Any],
        finish: Callable[[_Hook], None],
        *,
        fields: Mapping[str, Any] | None = None,
        traceparent: str | None = None,
    ) -> None:
        self.telemetry = telemetry
        self.kind = kind
        self.name = name
        self.attributes = attributes
        self._finish = finish
        self._fields = fields
        self._traceparent = traceparent
        self._stack = ExitStack()
        self.span: Any = None
        self.value: Any = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        self._began = 0.0

    def __enter__(self) -> _Hook:
        if self._fields is not None:
            self._stack.enter_context(hooks.scope(self.telemetry, **self._fields))
        tracing = self.telemetry.tracing
        if tracing is not None:
            span = tracing.span(self.name, self.kind, self.attributes, traceparent=self._traceparent)
            self.span = self._stack.enter_context(span)
        self._began = time.perf_counter()
        return self

    def done(self, value: T) -> T:
        self.value = value
        return value

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        self.seconds = time.perf_counter() - self._began
        self.error = exc
        try:
            self._finish(self)
        except Exception as failed:  # telemetry never fails the call it observes
            log.warning("celery_workflow telemetry: %s not recorded (%s: %s)", self.kind, type(failed).__name__, failed)
        return self._stack.__exit__(kind, exc, tb)

    def annotate(self, attributes: Mapping[str, Any], *, error: str | None = None) -> None:
        if self.span is not None:
            from celery_workflow.telemetry import spans

            spans.finish(self.span, attributes, error=error)


class Telemetry(Probe):
    """Spans, Prometheus metrics and log fields for ``Workflows(..., telemetry=Telemetry(...))``.

    ``spans``: OpenTelemetry spans of starts, deliveries, step attempts and World appends, on ``tracer_provider``
    (the OpenTelemetry API's global provider when None); off when ``opentelemetry-api`` is not installed.
    ``metrics``: Prometheus metrics on ``registry`` (a registry of this object's own when None; see
    :meth:`serve_prometheus`); off when ``prometheus_client`` is not installed. ``log_fields``: run, step and attempt
    fields on log records (:mod:`celery_workflow.telemetry.logs`). ``dead_letter_limit``: how many dead letters a
    scrape counts at most. ``runs_cached``: how many runs' trace contexts a process keeps (a delivery of a run not
    kept reads its ``run_created`` once more).
    """

    enabled = True

    def __init__(
        self,
        *,
        spans: bool = True,
        tracer_provider: Any = None,
        metrics: bool = True,
        registry: Any = None,
        log_fields: bool = True,
        dead_letter_limit: int = 1000,
        runs_cached: int = 10_000,
    ) -> None:
        self.tracing: Tracing | None = _tracing(tracer_provider) if spans else None
        self.metrics: Metrics | None = _metrics(registry, dead_letter_limit) if metrics else None
        self.log_fields = log_fields
        self.dead_letter_limit = dead_letter_limit
        self.runs_cached = runs_cached
        self._runs: OrderedDict[str, _RunFacts] = OrderedDict()
        self._runs_lock = threading.Lock()  # a threads pool's deliveries share it

    # -- configuration ---------------------------------------------------------------------------------------------

    def bind(self, workflows: Workflows) -> None:
        """Observe ``workflows``: its runtime's hooks, its World's appends, its queues when scraped."""
        workflows.runtime.telemetry = self
        world = workflows.world
        if hasattr(world, "telemetry"):  # a World with the append template (every World of this package)
            world.telemetry = self
        if self.metrics is not None:
            from celery_workflow import worker_setup

            self.metrics.queues.add(world, lambda: worker_setup.known_queues(workflows))
        if self.log_fields:
            logs.install()

    @property
    def registry(self) -> Any:
        """The prometheus_client ``CollectorRegistry`` of this process's metrics (None with metrics off)."""
        return self.metrics.registry if self.metrics is not None else None

    def exposition_registry(self) -> Any:
        """The registry :meth:`serve_prometheus` answers with (every process's, in multiprocess mode)."""
        if self.metrics is None:
            from celery_workflow.errors import ConfigurationError

            raise ConfigurationError("telemetry metrics are off (or prometheus_client is not installed)")
        from celery_workflow.telemetry import metrics

        return metrics.exposition_registry(self.metrics.registry, self.metrics.queues)

    def serve_prometheus(self, port: int, addr: str = "0.0.0.0") -> Any:
        """Serve the metrics at ``http://addr:port/metrics`` from a daemon thread of this process; returns the HTTP
        server (``server_port``, ``shutdown()``). In a prefork worker call it in the main process (Celery's
        ``worker_init`` signal) with ``PROMETHEUS_MULTIPROC_DIR`` set (``docs/telemetry.md``)."""
        from celery_workflow.telemetry import metrics

        return metrics.serve(self.exposition_registry(), port, addr)

    # -- hooks -----------------------------------------------------------------------------------------------------

    def traceparent(self) -> str | None:
        return self.tracing.traceparent() if self.tracing is not None else None

    def start(self, workflow: str) -> AbstractContextManager[Mark]:
        from_spans = {"celery_workflow.workflow": workflow}
        return _Hook(self, "start", f"start {workflow}", from_spans, self._started, fields={"workflow": workflow})

    def _started(self, hook: _Hook) -> None:
        if hook.value is None:
            return
        view, created = hook.value
        hook.annotate(
            {
                "celery_workflow.run_id": view.run_id,
                "celery_workflow.created": created,
                "celery_workflow.queue": view.queue,
            }
        )
        if not created:
            return
        if self.metrics is not None:
            self.metrics.runs_started.labels(view.workflow_name).inc()
        if self.tracing is not None:
            self._remember(view.run_id, _RunFacts(view.workflow_name, view.queue, self.traceparent()))

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
        facts = self._facts(runtime.world, run_id) if self.tracing is not None else None
        workflow = name if kind == "workflow" else (facts.workflow if facts is not None else None)
        step = name if kind == "step" else None
        attributes = {
            "celery_workflow.kind": kind,
            "celery_workflow.run_id": run_id,
            "celery_workflow.workflow": workflow,
            "celery_workflow.step": step,
            "celery_workflow.step_id": step_id,
            "celery_workflow.delivery_id": delivery_id,
            "celery_workflow.attempt": attempts,
            "celery_workflow.queue": _queue(runtime, kind, name, facts),
        }
        fields = {"run_id": run_id, "workflow": workflow, "step": step, "step_id": step_id, "delivery_id": delivery_id}
        return _Hook(
            self,
            "delivery",
            f"deliver {kind}.{name}" if name else f"deliver {kind}",
            {k: v for k, v in attributes.items() if v is not None},
            self._delivered,
            fields=fields,
            traceparent=facts.traceparent if facts is not None else None,
        )

    def _delivered(self, hook: _Hook) -> None:
        kind = str(hook.attributes["celery_workflow.kind"])
        outcome = str(hook.value) if hook.error is None else "error"
        hook.annotate({"celery_workflow.outcome": outcome})
        if self.metrics is not None:
            self.metrics.deliveries.labels(kind, outcome).inc()
            self.metrics.delivery_seconds.labels(kind).observe(hook.seconds)

    def attempt(
        self, *, run_id: str, workflow: str, step: str, step_id: str, attempt: int
    ) -> AbstractContextManager[Mark]:
        attributes = {
            "celery_workflow.run_id": run_id,
            "celery_workflow.workflow": workflow,
            "celery_workflow.step": step,
            "celery_workflow.step_id": step_id,
            "celery_workflow.attempt": attempt,
        }
        fields = {"run_id": run_id, "workflow": workflow, "step": step, "step_id": step_id, "attempt": attempt}
        return _Hook(self, "attempt", f"step {step}", attributes, self._attempted, fields=fields)

    def _attempted(self, hook: _Hook) -> None:
        outcome, error = "raised", None
        if hook.error is None and hook.value is not None:
            outcome = "ok" if hook.value.ok else ("fatal" if hook.value.fatal else "error")
            error = str((hook.value.error or {}).get("type", "error")) if not hook.value.ok else None
        hook.annotate({"celery_workflow.outcome": outcome, "celery_workflow.error_type": error}, error=error)
        if self.metrics is not None:
            labels = (hook.attributes["celery_workflow.workflow"], hook.attributes["celery_workflow.step"])
            self.metrics.step_attempts.labels(*labels, outcome).inc()
            self.metrics.step_seconds.labels(*labels).observe(hook.seconds)

    def append(self, run_id: str, events: int) -> AbstractContextManager[Mark]:
        attributes = {"celery_workflow.run_id": run_id, "celery_workflow.events": events}
        return _Hook(self, "append", "world.append", attributes, self._appended)

    def _appended(self, hook: _Hook) -> None:
        result = hook.value
        outcome = "ok" if hook.error is None else "error"
        hook.annotate({"celery_workflow.outcome": outcome})
        if self.metrics is None:
            return
        self.metrics.append_seconds.labels(outcome).observe(hook.seconds)
        if result is not None and any(ev.event_type in _RUN_ENDS for ev in result.events):
            self.metrics.runs_ended.labels(result.run.workflow_name, result.run.status.value).inc()

    # -- runs' trace contexts --------------------------------------------------------------------------------------

    def _remember(self, run_id: str, facts: _RunFacts) -> None:
        with self._runs_lock:
            self._runs[run_id] = facts
            self._runs.move_to_end(run_id)
            while len(self._runs) > self.runs_cached:
                self._runs.popitem(last=False)

    def _facts(self, world: Any, run_id: str) -> _RunFacts | None:
        """The run's creation facts: kept from an earlier delivery or start here, else read from its first event
        (None when it cannot be read: the delivery's span then starts a trace of its own)."""
        with self._runs_lock:
            found = self._runs.get(run_id)
            if found is not None:
                self._runs.move_to_end(run_id)
                return found
        try:
            first = world.list_events(run_id, limit=1)
        except Exception:  # the handler reads the run itself and says what is wrong with it
            return None
        body = first[0].body if first else None
        workflow = getattr(body, "workflow_name", None)
        if workflow is None:
            return None
        facts = _RunFacts(str(workflow), getattr(body, "queue", None), getattr(body, "traceparent", None))
        self._remember(run_id, facts)
        return facts


def _queue(runtime: Any, kind: str, name: str | None, facts: _RunFacts | None) -> str | None:
    """The queue a delivery came from, as the runtime routes it (None when the run's facts were not read)."""
    if facts is None:
        return None
    run_queue = facts.queue or runtime.default_queue
    if kind == "step" and name is not None:
        sdef = runtime.registry.steps.get(name)
        return str(sdef.queue) if sdef is not None and sdef.queue else str(run_queue)
    return str(run_queue)


def _tracing(provider: Any) -> Tracing | None:
    try:
        from celery_workflow.telemetry.spans import Tracing
    except ImportError:
        log.info("celery_workflow telemetry: opentelemetry-api is not installed; no spans")
        return None
    return Tracing(provider)


def _metrics(registry: Any, dead_letter_limit: int) -> Metrics | None:
    try:
        from prometheus_client import CollectorRegistry

        from celery_workflow.telemetry.metrics import Metrics
    except ImportError:
        log.info("celery_workflow telemetry: prometheus_client is not installed; no metrics")
        return None
    return Metrics(registry if registry is not None else CollectorRegistry(), dead_letter_limit=dead_letter_limit)
