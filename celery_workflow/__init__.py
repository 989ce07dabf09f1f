"""celery_workflow: durable workflows on Celery."""

from __future__ import annotations

__version__ = "0.1.0"
