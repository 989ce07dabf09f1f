"""Telemetry: OpenTelemetry spans, Prometheus metrics and structured log fields (``docs/telemetry.md``).

``Workflows(celery_app, ..., telemetry=Telemetry())`` turns them on for that app; without it nothing is recorded and
neither ``opentelemetry`` nor ``prometheus_client`` is imported. Both are optional (``pip install
'celery-workflow[telemetry]'``): a :class:`Telemetry` leaves out what is not installed.
"""

from __future__ import annotations

from celery_workflow.telemetry.core import Telemetry
from celery_workflow.telemetry.hooks import Probe
from celery_workflow.telemetry.logs import FIELDS, JsonFormatter, LogFields

__all__ = ["FIELDS", "JsonFormatter", "LogFields", "Probe", "Telemetry"]
