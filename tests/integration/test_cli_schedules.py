"""``workflow schedules list | show | pause | resume | delete`` on a SQLite World (issue #30, item 3), in process
with ``--world`` and as ``celery -A cliapp workflow schedules …`` (the app's own World)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from celery import Celery
from click.testing import CliRunner, Result

from celery_workflow import Workflows
from celery_workflow.cli import workflow
from celery_workflow.world_sqlite import SQLiteWorld

APPS = Path(__file__).resolve().parents[1] / "acceptance" / "apps"
ROOT = Path(__file__).resolve().parents[2]


def invoke(*args: str, code: int = 0) -> Result:
    result = CliRunner().invoke(workflow, list(args), catch_exceptions=False)
    assert "Traceback" not in result.output
    assert result.exit_code == code, result.output
    return result


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    world_url = f"sqlite:///{tmp_path / 'world.sqlite3'}"
    wf = Workflows(Celery("cli-schedules"), SQLiteWorld(tmp_path / "world.sqlite3"), broker="app")

    @wf.workflow(name="reports.nightly")
    def nightly(day: str) -> str:
        return day

    wf.schedule(nightly, cron="0 3 * * *", id="nightly", args=["today"], timezone="Europe/Paris")
    wf.schedule(
        "reports.nightly", cron="*/5 * * * *", id="often", args=["now"], overlap="allow", catch_up=timedelta(minutes=10)
    )
    yield world_url
    wf.close()


def test_schedules_list_and_show(url: str) -> None:
    listed = json.loads(invoke("--world", url, "schedules", "list", "--json").output)
    assert [s["schedule_id"] for s in listed] == ["nightly", "often"]
    assert listed[0]["cron"] == "0 3 * * *" and listed[0]["timezone"] == "Europe/Paris"
    assert listed[0]["input"] == {"args": ["today"], "kwargs": {}} and listed[1]["catch_up"] == 600.0
    text = invoke("--world", url, "schedules", "list").output
    assert "nightly" in text and "Europe/Paris" in text and "active" in text
    shown = invoke("--world", url, "schedules", "show", "often").output
    assert "overlap:    allow" in shown and "catch up:   600 s" in shown and "next tick:" in shown
    assert json.loads(invoke("--world", url, "schedules", "show", "nightly", "--json").output)["overlap"] == "skip"


def test_schedules_pause_resume_and_delete(url: str) -> None:
    assert invoke("--world", url, "schedules", "pause", "nightly").output == "nightly paused\n"
    assert "paused" in invoke("--world", url, "schedules", "list").output
    assert json.loads(invoke("--world", url, "schedules", "show", "nightly", "--json").output)["paused"] is True
    assert invoke("--world", url, "schedules", "resume", "nightly").output.startswith("nightly active, next tick ")
    assert json.loads(invoke("--world", url, "schedules", "show", "nightly", "--json").output)["paused"] is False
    assert invoke("--world", url, "schedules", "delete", "often").output == "often deleted\n"
    assert [s["schedule_id"] for s in json.loads(invoke("--world", url, "schedules", "list", "--json").output)] == [
        "nightly"
    ]


def test_an_unknown_schedule_exits_1(url: str) -> None:
    for command in ("show", "pause", "resume", "delete"):
        result = invoke("--world", url, "schedules", command, "nope", code=1)
        assert "no schedule nope" in result.output


def test_no_schedules(tmp_path: Path) -> None:
    SQLiteWorld(tmp_path / "empty.sqlite3").close()
    assert invoke("--world", f"sqlite:///{tmp_path / 'empty.sqlite3'}", "schedules", "list").output == "no schedules\n"


def test_celery_subcommand_lists_and_pauses_the_apps_schedules(url: str) -> None:
    env = {
        **os.environ,
        "CELERY_WORKFLOW_URL": url,
        "PYTHONPATH": os.pathsep.join([str(APPS), str(ROOT)]),
    }

    def celery(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", "cliapp", "workflow", "schedules", *args],
            cwd=APPS, env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip

    listed = celery("list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [s["schedule_id"] for s in json.loads(listed.stdout)] == ["nightly", "often"]
    paused = celery("pause", "often")
    assert (paused.returncode, paused.stdout) == (0, "often paused\n"), paused.stderr
    assert celery("show", "missing").returncode == 1
