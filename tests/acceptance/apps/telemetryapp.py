"""Telemetry on real workers: an OpenTelemetry SDK writing every finished span as a JSON line to $SPANS_FILE (each
process appends its own lines), and Prometheus metrics in multiprocess mode when $PROMETHEUS_MULTIPROC_DIR is set.
The World URL comes from CELERY_WORKFLOW_URL."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from celery import Celery
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from celery_workflow import Workflows
from celery_workflow.telemetry import Telemetry


class FileExporter(SpanExporter):
    """One JSON line per span: its name, ids, parent, attributes and the writing process."""

    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = [
            json.dumps(
                {
                    "name": s.name,
                    "trace_id": f"{s.context.trace_id:032x}",
                    "span_id": f"{s.context.span_id:016x}",
                    "parent_id": f"{s.parent.span_id:016x}" if s.parent is not None else None,
                    "attributes": dict(s.attributes or {}),
                    "pid": os.getpid(),
                }
            )
            for s in spans
        ]
        with open(self.path, "a", encoding="utf-8") as out:  # opened per export: safe across forked children
            out.write("".join(line + "\n" for line in lines))
        return SpanExportResult.SUCCESS


provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(FileExporter(os.environ["SPANS_FILE"])))

celery_app = Celery("telemetryapp")
wf = Workflows(celery_app, telemetry=Telemetry(tracer_provider=provider), transport_options={"lease_seconds": 60.0})


@wf.step
def double(x: int) -> int:
    return 2 * x


@wf.workflow
def traced(x: int) -> int:
    queued = double.start(x)  # a step delivery of its own
    return double(queued.result())  # and an inline step in the workflow delivery
