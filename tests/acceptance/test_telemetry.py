"""Issue #30 item 6, checked from outside on a real `celery worker` (prefork pool, SQLite World): the trace context
that start() records in the test process continues in the spans the worker's pool process exports, and the step
attempts it counts reach the multiprocess metrics directory the main process would serve."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from celery_workflow.event_data import RunCreatedData

from .workers import Worker, imported_app, wait_for

pytestmark = pytest.mark.acceptance


def spans_in(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_worker_continues_the_trace_started_in_the_client(tmp_path: Path) -> None:
    spans_file = tmp_path / "spans.jsonl"
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    env = {"CELERY_WORKFLOW_URL": f"sqlite:///{tmp_path / 'world.sqlite3'}", "SPANS_FILE": str(spans_file)}
    with imported_app("telemetryapp", env) as app:
        worker_env = {**env, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
        worker = Worker("telemetryapp", worker_env, tmp_path / "worker.log", ["-c", "1", "-P", "prefork"])
        worker.wait_ready()
        try:
            run = app.traced.start(5)
            assert run.result(timeout=30) == 20

            def worker_spans() -> list[dict[str, Any]]:
                found = [s for s in spans_in(spans_file) if s["pid"] != os.getpid()]
                finished = {s["name"] for s in found if s["name"].startswith("deliver ")}
                # the last workflow delivery's span ends just after the run's completion is written
                done = [s for s in found if s["attributes"].get("celery_workflow.outcome") == "completed"]
                return found if {"deliver workflow.traced", "deliver step.double"} <= finished and done else []

            spans = wait_for(worker_spans, 10, lambda: spans_file.read_text() if spans_file.exists() else "")
        finally:
            worker.stop()
        created = run.events()[0].body
    assert isinstance(created, RunCreatedData) and created.traceparent is not None
    _version, trace_id, start_span_id, _flags = created.traceparent.split("-")
    (start,) = [s for s in spans_in(spans_file) if s["name"] == "start traced"]
    assert start["pid"] == os.getpid() and (start["trace_id"], start["span_id"]) == (trace_id, start_span_id)
    assert {s["trace_id"] for s in spans} == {trace_id}  # the worker's spans continue the client's trace
    assert all(s["pid"] != worker.proc.pid for s in spans)  # written by the pool's child, not the main process
    deliveries = [s for s in spans if s["name"].startswith("deliver ")]
    assert deliveries and all(s["parent_id"] == start_span_id for s in deliveries)
    attempts = [s for s in spans if s["name"] == "step double"]
    assert sorted(s["attributes"]["celery_workflow.step_id"] for s in attempts) == ["step:double:1", "step:double:2"]
    # prefork: the child's counters are in the multiprocess directory, summed by what the main process serves
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(metrics_dir))  # type: ignore[no-untyped-call]
    labels = {"workflow": "traced", "step": "double", "outcome": "ok"}
    assert registry.get_sample_value("celery_workflow_step_attempts_total", labels) == 2
