"""Testing helpers: an in-memory World and an in-process worker.

* :class:`MemoryWorld`: a complete World in process memory (storage, queue, streams), for fast unit tests.
* :class:`LocalWorker`: claims and handles deliveries in the test process, without Celery workers.
* ``celery_workflow.testing.conformance.WorldConformance``: the test suite every World passes (needs pytest).
"""

from __future__ import annotations

from celery_workflow.testing.driver import LocalWorker, decode_task
from celery_workflow.testing.memory import MemoryWorld

__all__ = ["LocalWorker", "MemoryWorld", "decode_task"]
