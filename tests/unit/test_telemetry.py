"""Issue #30 item 6: telemetry. Spans of a run's start, deliveries, step attempts and World appends in one trace (the
trace context recorded in ``run_created``); Prometheus metrics, the scrape-time queue collector and the multiprocess
exporter; log fields around deliveries; nothing imported or recorded without ``telemetry=``."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry, generate_latest

from celery_workflow import RetryableError, Workflows
from celery_workflow.event_data import RunCreatedData
from celery_workflow.telemetry import JsonFormatter, LogFields, Telemetry
from celery_workflow.testing import LocalWorker, MemoryWorld
from celery_workflow.world import open_world

ROOT = Path(__file__).resolve().parents[2]


class Traced:
    """A Telemetry whose spans go to memory and whose metrics go to a registry of the test's own."""

    def __init__(self, **options: Any) -> None:
        self.exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.registry = CollectorRegistry()
        self.telemetry = Telemetry(tracer_provider=provider, registry=self.registry, **options)

    def spans(self, name_prefix: str = "") -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if s.name.startswith(name_prefix)]

    def value(self, name: str, **labels: str) -> float:
        found = self.registry.get_sample_value(name, labels)
        return 0.0 if found is None else found


@pytest.fixture
def traced() -> Traced:
    return Traced()


@pytest.fixture
def app(traced: Traced) -> Iterator[Workflows]:
    wf = Workflows(Celery("telemetry"), world=MemoryWorld(), broker="app", telemetry=traced.telemetry)
    yield wf
    wf.close()


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def register(wf: Workflows, flaky_failures: int = 0) -> Any:
    failures = {"left": flaky_failures}

    @wf.step
    def add(a: int, b: int) -> int:
        logging.getLogger("celery_workflow.test").info("adding %s and %s", a, b)
        return a + b

    @wf.step(retry_backoff=0)
    def flaky(a: int) -> int:
        if failures["left"]:
            failures["left"] -= 1
            raise RetryableError("not yet", retry_after=0)
        return a

    @wf.workflow
    def flow(n: int) -> int:
        queued = add.start(n, 1)  # its own step delivery
        return flaky(add(queued.result(), 2))  # inline steps in the workflow delivery

    return flow


def test_a_run_is_one_trace_from_start_to_its_steps(app: Workflows, traced: Traced) -> None:
    flow = register(app, flaky_failures=1)
    run = flow.start(1)
    LocalWorker(app).run_until_complete(run)
    assert run.result() == 4

    (start,) = traced.spans("start ")
    assert start.parent is None and start.name == "start flow"
    assert attrs(start)["celery_workflow.run_id"] == run.id and attrs(start)["celery_workflow.created"] is True
    trace_id = start.context.trace_id
    everything = traced.spans()
    assert {s.context.trace_id for s in everything} == {trace_id}  # one trace, start to steps

    # the trace context is recorded with the run, where any process's deliveries find it
    created = run.events()[0].body
    assert isinstance(created, RunCreatedData)
    assert created.traceparent is not None
    assert created.traceparent.startswith(f"00-{trace_id:032x}-{start.context.span_id:016x}-")

    deliveries = traced.spans("deliver ")
    assert {s.name for s in deliveries} == {"deliver workflow.flow", "deliver step.add", "deliver step.flaky"}
    assert all(s.parent is not None and s.parent.span_id == start.context.span_id for s in deliveries)
    step_delivery = next(s for s in deliveries if s.name == "deliver step.add")
    assert attrs(step_delivery) | {"celery_workflow.delivery_id": "?"} == {
        "celery_workflow.kind": "step",
        "celery_workflow.run_id": run.id,
        "celery_workflow.workflow": "flow",
        "celery_workflow.step": "add",
        "celery_workflow.step_id": "step:add:1",
        "celery_workflow.delivery_id": "?",
        "celery_workflow.attempt": 1,
        "celery_workflow.queue": "celery",
        "celery_workflow.outcome": "completed",
    }

    by_id = {s.context.span_id: s for s in everything}
    attempts = traced.spans("step ")
    # add (queued), add (inline), flaky twice: the first attempt failed and was retried in a step delivery
    assert sorted((attrs(s)["celery_workflow.step_id"], attrs(s)["celery_workflow.attempt"]) for s in attempts) == [
        ("step:add:1", 1),
        ("step:add:2", 1),
        ("step:flaky:1", 1),
        ("step:flaky:1", 2),
    ]
    for span in attempts:  # each attempt is a child of the delivery that ran it
        assert span.parent is not None and by_id[span.parent.span_id].name.startswith("deliver ")
    failed = next(s for s in attempts if attrs(s)["celery_workflow.outcome"] == "error")
    assert attrs(failed)["celery_workflow.error_type"] == "celery_workflow.errors.RetryableError"
    assert failed.status.is_ok is False

    appends = traced.spans("world.append")
    assert appends and all(s.parent is not None for s in appends)
    assert all(attrs(s)["celery_workflow.run_id"] == run.id for s in appends)


def test_a_delivery_in_another_process_continues_the_trace_recorded_at_start(traced: Traced) -> None:
    """The worker's telemetry has never seen the run: its delivery spans take the trace from ``run_created``."""
    world = MemoryWorld()
    client = Workflows(Celery("client"), world=world, broker="app", telemetry=traced.telemetry)
    other = Traced()
    worker_side = Workflows(Celery("worker"), world=world, broker="app", telemetry=other.telemetry)
    register(client)
    flow = register(worker_side)
    run = client.start("flow", 5)
    LocalWorker(worker_side).run_until_complete(run)
    assert run.result() == 8
    (start,) = traced.spans("start ")
    worker_spans = other.spans()
    assert worker_spans and not other.spans("start ")
    assert {s.context.trace_id for s in worker_spans} == {start.context.trace_id}
    assert all(s.parent is not None for s in worker_spans)
    assert flow.name == "flow"


def test_metrics_count_runs_attempts_deliveries_and_appends(app: Workflows, traced: Traced) -> None:
    flow = register(app, flaky_failures=1)

    @app.workflow
    def broken() -> None:
        raise ValueError("no")

    runs = [flow.start(1), flow.start(2), broken.start()]
    worker = LocalWorker(app)
    for run in runs:
        worker.run_until_complete(run)
    assert traced.value("celery_workflow_runs_started_total", workflow="flow") == 2
    assert traced.value("celery_workflow_runs_started_total", workflow="broken") == 1
    assert traced.value("celery_workflow_runs_ended_total", workflow="flow", status="completed") == 2
    assert traced.value("celery_workflow_runs_ended_total", workflow="broken", status="failed") == 1
    assert traced.value("celery_workflow_step_attempts_total", workflow="flow", step="add", outcome="ok") == 4
    # the flaky step failed once (one run), then succeeded in both
    assert traced.value("celery_workflow_step_attempts_total", workflow="flow", step="flaky", outcome="error") == 1
    assert traced.value("celery_workflow_step_attempts_total", workflow="flow", step="flaky", outcome="ok") == 2
    assert traced.value("celery_workflow_step_seconds_count", workflow="flow", step="flaky") == 3
    assert traced.value("celery_workflow_deliveries_total", kind="step", outcome="completed") >= 2
    assert traced.value("celery_workflow_delivery_seconds_count", kind="workflow") >= 3
    assert traced.value("celery_workflow_world_append_seconds_count", outcome="ok") >= 6
    # starting a run again by its id counts nothing
    flow.start(1, run_id=runs[0].id)
    assert traced.value("celery_workflow_runs_started_total", workflow="flow") == 2


def test_queue_depth_lag_and_dead_letters_are_read_when_scraped(tmp_path: Path) -> None:
    traced = Traced(spans=False)
    world = open_world(f"sqlite:///{tmp_path / 'w.sqlite3'}")
    wf = Workflows(Celery("queues"), world=world, broker="app", telemetry=traced.telemetry)
    try:
        flow = register(wf)
        flow.start(1)
        flow.start(2)
        assert traced.value("celery_workflow_queue_depth", queue="celery") == 2
        assert traced.value("celery_workflow_queue_lag_seconds", queue="celery") >= 0
        assert traced.value("celery_workflow_dead_letters", queue="celery") == 0
        (claimed,) = world.claim(["celery"], limit=1, lease=30)
        store: Any = getattr(world, "store")  # noqa: B009 - the SQLite World's queue store
        assert store.dead_letter(claimed.receipt, reason="test") is not None
        assert traced.value("celery_workflow_dead_letters", queue="celery") == 1
        assert traced.value("celery_workflow_queue_depth", queue="celery") == 1
    finally:
        wf.close()


def test_one_telemetry_for_two_apps_reads_both_worlds_queues(tmp_path: Path) -> None:
    traced = Traced(spans=False)
    first = Workflows(
        Celery("a"), world=f"sqlite:///{tmp_path / 'a.sqlite3'}", broker="app", telemetry=traced.telemetry
    )
    second = Workflows(
        Celery("b"), world=f"sqlite:///{tmp_path / 'b.sqlite3'}", broker="app", telemetry=traced.telemetry
    )
    try:
        register(first).start(1)
        second.route("flow", "bulk")  # the same workflow on the second app, on a queue of its own
        register(second).start(2)
        second.start("flow", 3)
        assert traced.value("celery_workflow_queue_depth", queue="celery") == 1
        assert traced.value("celery_workflow_queue_depth", queue="bulk") == 2
        assert traced.value("celery_workflow_runs_started_total", workflow="flow") == 3
        # one family per name in what is served (a second TYPE line would fail the whole scrape)
        text = generate_latest(traced.registry).decode()
        assert text.count("# TYPE celery_workflow_queue_depth gauge") == 1, text
    finally:
        first.close()
        second.close()


def test_log_records_carry_the_run_step_and_attempt(app: Workflows, traced: Traced) -> None:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    handler.addFilter(LogFields())
    package = logging.getLogger("celery_workflow")
    package.addHandler(handler)
    level = package.level
    package.setLevel(logging.INFO)
    try:
        flow = register(app)
        run = flow.start(3)
        LocalWorker(app).run_until_complete(run)
        app.runtime.handle_workflow("wrun_missing", delivery_id="dlv_x")  # the package warns: no such run
        logging.getLogger("celery_workflow.test").info("outside any delivery")
    finally:
        package.removeHandler(handler)
        package.setLevel(level)
    adding = [r for r in records if r.getMessage().startswith("adding")]
    assert [(r.run_id, r.workflow, r.step, r.step_id, r.attempt) for r in adding] == [  # type: ignore[attr-defined]
        (run.id, "flow", "add", "step:add:1", 1),
        (run.id, "flow", "add", "step:add:2", 1),
    ]
    (missing,) = [r for r in records if "does not exist" in r.getMessage()]
    assert missing.run_id == "wrun_missing" and missing.delivery_id == "dlv_x"  # type: ignore[attr-defined]
    assert missing.step_id is None  # type: ignore[attr-defined]
    (outside,) = [r for r in records if r.getMessage() == "outside any delivery"]
    assert outside.run_id is None  # type: ignore[attr-defined]
    line = json.loads(JsonFormatter().format(adding[0]))
    assert line["run_id"] == run.id and line["step_id"] == "step:add:1" and line["attempt"] == 1
    # Telemetry(log_fields=True) puts the filter on the package's logger itself: %(run_id)s works in any format
    assert any(isinstance(f, LogFields) for f in package.filters)


def _python(code: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(proc: subprocess.Popen[str]) -> str:
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    return out


RUN_ONE = """
    import sys
    from celery import Celery
    from celery_workflow import Workflows
    from celery_workflow.testing import LocalWorker, MemoryWorld
    {setup}
    wf = Workflows(Celery("t"), world={world}, broker="app"{options})

    @wf.step
    def double(x: int) -> int:
        return 2 * x

    @wf.workflow
    def flow(x: int) -> int:
        return double(x)

    run = flow.start(21)
    LocalWorker(wf).run_until_complete(run)
    assert run.result() == 42
    {check}
"""


def test_without_telemetry_nothing_is_imported() -> None:
    code = RUN_ONE.format(
        setup="",
        world="MemoryWorld()",
        options="",
        check="print(sorted(m for m in sys.modules if m.split('.')[0] in ('opentelemetry', 'prometheus_client')))",
    )
    assert _finish(_python(code)).strip() == "[]"


def test_without_opentelemetry_installed_metrics_still_work() -> None:
    code = RUN_ONE.format(
        setup="sys.modules['opentelemetry'] = None  # as if not installed\n"
        "    from celery_workflow.telemetry import Telemetry\n    telemetry = Telemetry()",
        world="MemoryWorld()",
        options=", telemetry=telemetry",
        check="print(telemetry.tracing, "
        "telemetry.registry.get_sample_value('celery_workflow_runs_started_total', {'workflow': 'flow'}))",
    )
    assert _finish(_python(code)).strip() == "None 1.0"


def test_prefork_children_are_summed_by_the_multiprocess_exporter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The supported prefork setup: every process writes to PROMETHEUS_MULTIPROC_DIR, the main one serves the sum
    (and reads the queues itself)."""
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    url = f"sqlite:///{tmp_path / 'w.sqlite3'}"
    code = RUN_ONE.format(
        setup="from celery_workflow.telemetry import Telemetry",
        world=repr(url),
        options=", telemetry=Telemetry(spans=False)",
        check="",
    )
    children = [_python(code, {"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}) for _ in range(2)]
    outputs = [(child.communicate(timeout=60)[0], child.returncode) for child in children]  # each one's pipe closed
    assert [rc for _, rc in outputs] == [0, 0], outputs
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(metrics_dir))
    telemetry = Telemetry(spans=False, registry=CollectorRegistry())
    wf = Workflows(Celery("main"), world=url, broker="app", telemetry=telemetry)
    server = telemetry.serve_prometheus(0, "127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10) as response:
            text = response.read().decode()
    finally:
        server.shutdown()
        server.server_close()
        wf.close()
    lines = set(text.splitlines())
    assert 'celery_workflow_runs_started_total{workflow="flow"} 2.0' in lines
    assert 'celery_workflow_step_attempts_total{outcome="ok",step="double",workflow="flow"} 2.0' in lines
    assert 'celery_workflow_queue_depth{queue="celery"} 0.0' in lines
