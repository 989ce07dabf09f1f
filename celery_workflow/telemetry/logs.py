"""Structured log fields: the run, workflow, step, attempt and delivery a log line was written for.

While a delivery runs with telemetry configured, its fields live in a context variable (:mod:`.hooks`):
``run_id``, ``workflow``, ``delivery_id`` and, for a step delivery or a step attempt, ``step_id``, ``step`` and
``attempt``. :class:`LogFields` is a :class:`logging.Filter` that copies them onto each record as attributes (None
when the record was written outside a delivery, or the field does not apply), so a formatter can show them::

    logging.config.dictConfig({
        "version": 1,
        "filters": {"workflow": {"()": "celery_workflow.telemetry.LogFields"}},
        "formatters": {"json": {"()": "celery_workflow.telemetry.JsonFormatter"}},
        "handlers": {"console": {"class": "logging.StreamHandler", "filters": ["workflow"], "formatter": "json"}},
        "root": {"handlers": ["console"], "level": "INFO"},
    })

A filter on a handler sees every record that reaches the handler, whatever logger wrote it (a logger's own filters
see only the records written to that very logger). ``Telemetry(log_fields=True)`` also puts one on each of the
package's loggers that exist when the ``Workflows`` is created (:func:`install`), so ``%(run_id)s`` works in a format
string of any handler.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from celery_workflow.telemetry.hooks import current_fields

#: The attributes :class:`LogFields` sets on every record.
FIELDS = ("run_id", "workflow", "step_id", "step", "attempt", "delivery_id")


class LogFields(logging.Filter):
    """Adds :data:`FIELDS` to each record (an attribute the record already has, e.g. from ``extra=``, is kept)."""

    def filter(self, record: logging.LogRecord) -> bool:
        fields = current_fields()
        for name in FIELDS:
            if not hasattr(record, name):
                setattr(record, name, fields.get(name))
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, the :data:`FIELDS` that are set, and the
    exception's traceback if any. An example to start from; any JSON formatter that reads record attributes works."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                out[name] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def install(prefix: str = "celery_workflow") -> int:
    """Put a :class:`LogFields` on the logger ``prefix`` and on every existing logger under it that has none; return
    how many were added."""
    names = [prefix, *(n for n in logging.root.manager.loggerDict if n.startswith(prefix + "."))]
    added = 0
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, LogFields) for f in logger.filters):
            logger.addFilter(LogFields())
            added += 1
    return added
