"""The examples run end to end (in-process worker, embedded SQLite World)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from celery_workflow import WorkflowFailed
from celery_workflow.testing import LocalWorker

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setenv("CELERY_WORKFLOW_URL", f"sqlite:///{tmp_path / 'world.sqlite3'}")
    monkeypatch.setenv("TASKS_DB", str(tmp_path / "tasks.sqlite3"))
    monkeypatch.setenv("TASK_WAIT_SECONDS", "0.1")
    monkeypatch.setenv("REDRIVE_POLL_SECONDS", "0.01")
    monkeypatch.syspath_prepend(str(ROOT))
    loaded: list[str] = []

    def _load(name: str) -> ModuleType:
        sys.modules.pop(f"examples.{name}", None)
        loaded.append(f"examples.{name}")
        return importlib.import_module(f"examples.{name}")

    yield _load
    for name in loaded:
        module = sys.modules.pop(name, None)
        if module is not None:
            module.wf.close()


def test_shop(load: Any) -> None:
    shop = load("shop")
    run = shop.fulfil.start("o-1", 1200)
    worker = LocalWorker(shop.wf)
    worker.run_until_idle()
    shop.wf.resume_hook("approve:o-1", {"ok": False})
    worker.run_until_complete(run)
    assert run.result() == {"status": "rejected"}


def test_task_status(load: Any) -> None:
    example = load("task_status")
    run = example.track_task.start("Breakfast")
    worker = LocalWorker(example.wf)
    worker.run_until_idle()
    ts = example.tasks()
    result_before = run.status
    assert result_before == "running"  # waiting out the "long running task"
    worker.run_until_complete(run)
    out = run.result()
    assert out["status"] == "Done"
    assert ts.get("Breakfast", out["timestamp"])["status"] == "Done"


class FakeSQS:
    def __init__(self, statuses: list[str]) -> None:
        self.statuses = statuses
        self.started: list[str] = []

    def start_message_move_task(self, SourceArn: str) -> dict[str, str]:
        self.started.append(SourceArn)
        return {"TaskHandle": "h-1"}

    def list_message_move_tasks(self, SourceArn: str, MaxResults: int) -> dict[str, Any]:
        status = self.statuses.pop(0)
        return {"Results": [] if status == "NOT_FOUND" else [{"Status": status}]}


@pytest.mark.parametrize(
    ("statuses", "expected"),
    [(["RUNNING", "RUNNING", "COMPLETED"], "COMPLETED"), (["NOT_FOUND"], "UNKNOWN"), (["RUNNING", "FAILED"], None)],
)
def test_sqs_redrive(load: Any, monkeypatch: pytest.MonkeyPatch, statuses: list[str], expected: str | None) -> None:
    example = load("sqs_redrive")
    sqs = FakeSQS(statuses)
    monkeypatch.setattr(example, "sqs_client", lambda: sqs)
    run = example.redrive.start("arn:aws:sqs:eu-west-1:1:sample-dlq")
    LocalWorker(example.wf).run_until_complete(run)
    if expected is None:
        with pytest.raises(WorkflowFailed, match="ended FAILED"):
            run.result()
    else:
        assert run.result()["status"] == expected
    assert sqs.started == ["arn:aws:sqs:eu-west-1:1:sample-dlq"]
    assert sqs.statuses == []
