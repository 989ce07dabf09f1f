"""Issue #30 item 1, checked from outside on a real `celery worker` (prefork pool) on the SQLite World: a parent
with 100 child runs completes (each child a run of its own with a step, the parent suspended in between, woken by
its children's ends), and a child's failure reaches its parent as WorkflowFailed."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from celery_workflow import RunStatus
from celery_workflow.events import EventType

from .workers import Worker, imported_app

pytestmark = pytest.mark.acceptance


def test_a_parent_with_100_children_on_a_real_worker(tmp_path: Path) -> None:
    env = {"CELERY_WORKFLOW_URL": f"sqlite:///{tmp_path / 'world.sqlite3'}"}
    with imported_app("childrenapp", env) as app:
        worker = Worker("childrenapp", env, tmp_path / "worker.log", ["-c", "2", "-P", "prefork"])
        worker.wait_ready()
        try:
            began = time.monotonic()
            run = app.parent.start(100, run_id="fan")
            careful = app.careful.start(-1, run_id="careful")
            total = run.result(timeout=20)
            elapsed = time.monotonic() - began
            caught = careful.result(timeout=30)
        finally:
            worker.stop()
        assert total == sum(n * n for n in range(100))
        kinds = [e.event_type for e in run.events()]
        assert kinds.count(EventType.CHILD_STARTED) == kinds.count(EventType.CHILD_ENDED) == 100
        children = [c for c in app.wf.list_runs(workflow="child", limit=200) if c.id.startswith("fan!")]
        assert len(children) == 100
        assert all(c.status is RunStatus.COMPLETED for c in children)
        assert caught == "child careful!1 failed"
        print(f"100 children: {elapsed:.2f} s start to result")
        assert elapsed < 15, elapsed
