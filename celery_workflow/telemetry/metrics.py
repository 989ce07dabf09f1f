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

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
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


class QueueCollector(Collector):
    """Read at scrape time from the World: ``celery_workflow_queue_depth`` (deliveries stored, claimed or not),
    ``celery_workflow_queue_lag_seconds`` (how long the oldest claimable delivery has been waiting; 0 when none is
    late) per queue ``queues()`` names, and ``celery_workflow_dead_letters`` per queue (counted up to
    ``dead_letter_limit``). A World whose queue store cannot tell a figure leaves it out; a read that fails is
    logged and its family left out of that scrape."""

    def __init__(self, world: Any, queues: Callable[[], list[str]], *, dead_letter_limit: int = 1000) -> None:
        self.world = world
        self.queues = queues
        self.dead_letter_limit = dead_letter_limit

    def collect(self) -> Iterator[GaugeMetricFamily]:
        store = getattr(self.world, "store", None)
        names = self.queues()
        for family in (self._depth, self._lag, self._dead_letters):
            try:
                found = family(store, names)
            except Exception as exc:
                log.warning("celery_workflow metrics: %s not read (%s: %s)", family.__name__, type(exc).__name__, exc)
                continue
            if found is not None:
                yield found

    def _depth(self, store: Any, names: list[str]) -> GaugeMetricFamily | None:
        size = getattr(store, "size", None)
        if not callable(size):
            return None
        family = GaugeMetricFamily("celery_workflow_queue_depth", "Deliveries stored on the queue", labels=["queue"])
        for name in names:
            family.add_metric([name], float(size(name)))
        return family

    def _lag(self, store: Any, names: list[str]) -> GaugeMetricFamily | None:
        due_times = getattr(store, "due_times", None)
        if not callable(due_times):
            return None
        due: Mapping[str, float] = due_times(names)
        now = time.time()
        family = GaugeMetricFamily(
            "celery_workflow_queue_lag_seconds",
            "How long the queue's oldest claimable delivery has been due (0: none is waiting)",
            labels=["queue"],
        )
        for name in names:
            family.add_metric([name], max(0.0, now - due[name]) if name in due else 0.0)
        return family

    def _dead_letters(self, store: Any, names: list[str]) -> GaugeMetricFamily | None:
        from celery_workflow import dead_letters
        from celery_workflow.errors import ConfigurationError

        try:
            letters = dead_letters.dead_letter_store(self.world)
        except ConfigurationError:
            return None
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
        family = GaugeMetricFamily(
            "celery_workflow_dead_letters", "Dead letters kept for the queue (counted up to a limit)", labels=["queue"]
        )
        for name, count in counts.items():
            family.add_metric([name], float(count))
        return family


def exposition_registry(own: CollectorRegistry, collectors: list[Collector]) -> CollectorRegistry:
    """What :func:`serve` answers with: ``own`` (this process's metrics, the collectors registered on it), or, in
    multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set), a registry reading every process's files plus
    ``collectors``."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path:
        return own
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=path)  # type: ignore[no-untyped-call]
    for collector in collectors:
        registry.register(collector)
    return registry


def serve(registry: CollectorRegistry, port: int, addr: str = "0.0.0.0") -> Any:
    """Serve ``registry`` at ``http://addr:port/metrics`` from a daemon thread; the HTTP server (``server_port`` is
    the port bound when ``port`` is 0; ``shutdown()`` stops it)."""
    server, _thread = start_http_server(port, addr, registry=registry)
    return server
