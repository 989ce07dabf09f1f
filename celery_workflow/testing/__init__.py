"""Testing helpers: an in-memory World, an in-process worker, and a replayer of recorded runs.

* :class:`MemoryWorld`: a complete World in process memory (storage, queue, streams), for fast unit tests.
* :class:`LocalWorker`: claims and handles deliveries in the test process, without Celery workers.
* :class:`History` and :func:`replay_history`: a run's event log as a checked-in JSON file, and a replay of it with
  the current workflow code that raises :class:`~celery_workflow.errors.ReplayDivergence` when the code no longer
  reproduces the recorded run (the way to keep runs in flight safe across upgrades).
* ``celery_workflow.testing.conformance.WorldConformance``: the test suite every World passes (needs pytest).
"""

from __future__ import annotations

from celery_workflow.testing.driver import LocalWorker, decode_task
from celery_workflow.testing.memory import MemoryWorld
from celery_workflow.testing.replayer import History, ReplayResult, replay_history

__all__ = ["History", "LocalWorker", "MemoryWorld", "ReplayResult", "decode_task", "replay_history"]
