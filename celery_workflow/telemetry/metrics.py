"""Prometheus metrics (imported only by a :class:`~celery_workflow.telemetry.Telemetry` whose metrics are on, and only
when ``prometheus_client`` is installed).

Counted where things happen, in the process they happen in: runs started and ended, deliveries, step attempts and
their durations, World appends and their latency. Read from the World when scraped (:class:`QueueCollector`):
each queue's depth and lag, and the dead letters.

**Prefork.** A Celery worker's prefork pool runs deliveries in child processes, each with its own counters; what the
main process serves would not see them. The supported way is prometheus_client's multiprocess mode: set
``PROMETHEUS_MULTIPROC_DIR`` to an empty directory in the worker's environment (before Python starts: the value
class is chosen when prometheus_client is imported); every process then writes its counters to files there, and
:func:`serve` (in the main process) answers with the sum of all files, plus the queue collector.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

log = logging.getLogger("celery_workflow.telemetry")

#: Histogram buckets (seconds) of step attempts and deliveries, and of World appends.
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
APPEND_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """The counters and histograms, registered on ``registry``."""

    def __init__(self, registry: CollectorRegistry, *, dead_letter_limit: int = 1000) -> None:
        self.registry = registry
        self.queues = QueueCollector(dead_letter_limit=dead_letter_limit)
        registry.register(self.queues)
        self.runs_started = Counter(
            "celery_workflow_runs_started", "Runs created by start()", ["workflow"], registry=registry
        )
        self.runs_ended = Counter(
            "celery_workflow_runs_ended",
            "Runs that ended (an append that wrote run_completed, run_failed or run_cancelled)",
            ["workflow", "status"],
            registry=registry,
        )
        self.deliveries = Counter(
            "celery_workflow_deliveries",
            "Workflow and step deliveries handled, by what the handler did",
            ["kind", "outcome"],
            registry=registry,
        )
        self.delivery_seconds = Histogram(
            "celery_workflow_delivery_seconds",
            "How long handling a delivery took",
            ["kind"],
            buckets=STEP_BUCKETS,
            registry=registry,
        )
        self.step_attempts = Counter(
            "celery_workflow_step_attempts",
            "Step attempts run (inline or as their own delivery), by outcome: ok, error (retried if retries are left) "
            "or fatal",
            ["workflow", "step", "outcome"],
            registry=registry,
        )
        self.step_seconds = Histogram(
            "celery_workflow_step_seconds",
            "How long a step attempt's body took",
            ["workflow", "step"],
            buckets=STEP_BUCKETS,
            registry=registry,
        )
        self.append_seconds = Histogram(
            "celery_workflow_world_append_seconds",
            "How long a World append took (ok, or error when it raised)",
            ["outcome"],
            buckets=APPEND_BUCKETS,
            registry=registry,
        )


#: The gauges :class:`QueueCollector` reads, with their help texts.
QUEUE_GAUGES = {
    "celery_workflow_queue_depth": "Deliveries stored on the queue",
    "celery_workflow_queue_lag_seconds": "How long the queue's oldest claimable delivery has been due (0: none waits)",
    "celery_workflow_dead_letters": "Dead letters kept for the queue (counted up to a limit)",
}


class QueueCollector(Collector):
    """Read at scrape time from the Worlds added (:meth:`add`): ``celery_workflow_queue_depth`` (deliveries stored,
    claimed or not), ``celery_workflow_queue_lag_seconds`` (how long the oldest claimable delivery has been waiting;
    0 when none is late) per queue each World's ``queues()`` names, and ``celery_workflow_dead_letters`` per queue
    (counted up to ``dead_letter_limit``). A World whose queue store cannot tell a figure leaves it out; a read that
    fails is logged and left out of that scrape. A queue named by two sources is read from the first."""

    def __init__(self, *, dead_letter_limit: int = 1000) -> None:
        self.sources: list[tuple[Any, Callable[[], list[str]]]] = []
        self.dead_letter_limit = dead_letter_limit

    def add(self, world: Any, queues: Callable[[], list[str]]) -> None:
        self.sources.append((world, queues))

    def describe(self) -> list[GaugeMetricFamily]:
        """The names it yields (so registering it reads no World)."""
        return [GaugeMetricFamily(name, text, labels=["queue"]) for name, text in QUEUE_GAUGES.items()]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = {family.name: family for family in self.describe()}
        read: dict[str, set[str]] = {name: set() for name in families}
        for world, queues in self.sources:
            store = getattr(world, "store", None)
            for reader in (self._depth, self._lag, self._dead_letters):
                try:
                    name, found = reader(world, store, queues())
                except Exception as exc:
                    log.warning(
                        "celery_workflow metrics: %s not read (%s: %s)", reader.__name__, type(exc).__name__, exc
                    )
                    continue
                for queue, value in found.items():
                    if queue not in read[name]:
                        read[name].add(queue)
                        families[name].add_metric([queue], value)
        yield from (family for name, family in families.items() if read[name])

    def _depth(self, world: Any, store: Any, names: list[str]) -> tuple[str, dict[str, float]]:
        size = getattr(store, "size", None)
        found = {name: float(size(name)) for name in names} if callable(size) else {}
        return "celery_workflow_queue_depth", found

    def _lag(self, world: Any, store: Any, names: list[str]) -> tuple[str, dict[str, float]]:
        due_times = getattr(store, "due_times", None)
        if not callable(due_times):
            return "celery_workflow_queue_lag_seconds", {}
        due: Mapping[str, float] = due_times(names)
        now = time.time()
        return "celery_workflow_queue_lag_seconds", {n: max(0.0, now - due[n]) if n in due else 0.0 for n in names}

    def _dead_letters(self, world: Any, store: Any, names: list[str]) -> tuple[str, dict[str, float]]:
        from celery_workflow import dead_letters
        from celery_workflow.errors import ConfigurationError

        try:
            letters = dead_letters.dead_letter_store(world)
        except ConfigurationError:
            return "celery_workflow_dead_letters", {}
        counts = dict.fromkeys(names, 0)
        after: int | str = 0
        seen = 0
        while seen < self.dead_letter_limit:
            page = letters.list_dead_letters(after=after, limit=min(100, self.dead_letter_limit - seen))
            for letter in page:
                counts[letter.queue] = counts.get(letter.queue, 0) + 1
            seen += len(page)
            if len(page) < 100:
                break
            after = page[-1].id
        return "celery_workflow_dead_letters", {name: float(count) for name, count in counts.items()}


def exposition_registry(own: CollectorRegistry, queues: Collector) -> CollectorRegistry:
    """What :func:`serve` answers with: ``own`` (this process's metrics and the ``queues`` collector registered on
    it), or, in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set), a registry reading every process's files plus
    ``queues``."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path:
        return own
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=path)  # type: ignore[no-untyped-call]
    registry.register(queues)
    return registry


def serve(registry: CollectorRegistry, port: int, addr: str = "0.0.0.0") -> Any:
    """Serve ``registry`` at ``http://addr:port/metrics`` from a daemon thread; the HTTP server (``server_port`` is
    the port bound when ``port`` is 0; ``shutdown()`` stops it)."""
    server, _thread = start_http_server(port, addr, registry=registry)
    return server
