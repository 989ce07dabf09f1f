"""What runs wait for on the command line (issue #30, item 5): ``runs list --waiting``, ``runs show`` and ``runs
watch`` on a SQLite World (hook tokens stay hidden)."""

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

from celery_workflow import Run, Workflows, create_hook, sleep
from celery_workflow.cli import workflow
from celery_workflow.testing import LocalWorker

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "cli-secret-token"


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'waiting.sqlite3'}"


@pytest.fixture
def wf(url: str) -> Iterator[Workflows]:
    workflows = Workflows(Celery("cli-waiting"), world=url, broker="app")

    @workflows.workflow
    def approval() -> object:
        return create_hook(token=TOKEN).wait()

    @workflows.workflow
    def napping() -> str:
        sleep(timedelta(hours=1))
        return "awake"

    @workflows.workflow
    def quick() -> int:
        return 1

    yield workflows
    workflows.close()


def cli(url: str, *args: str) -> Result:
    result = CliRunner().invoke(workflow, ["--world", url, *args], catch_exceptions=False)
    assert "Traceback" not in result.output and result.exit_code == 0, result.output
    return result


def started(wf: Workflows) -> tuple[Run[object], Run[object], Run[object]]:
    hooked, napping, done = wf.start("approval"), wf.start("napping"), wf.start("quick")
    LocalWorker(wf).run_until_idle()
    return hooked, napping, done


def test_runs_list_waiting_shows_only_runs_in_progress_and_what_they_wait_for(wf: Workflows, url: str) -> None:
    hooked, napping, done = started(wf)
    text = cli(url, "runs", "list", "--waiting").stdout
    assert "WAITING ON" in text and done.id not in text and TOKEN not in text
    lines = {line.split()[0]: line for line in text.splitlines()[1:] if line.strip()}
    assert "hook hook:1 (token hidden)" in lines[hooked.id]
    assert "sleep until " in lines[napping.id]
    listed = json.loads(cli(url, "runs", "list", "--waiting", "--json").stdout)
    assert {r["run_id"]: [w["kind"] for w in r["waiting_on"]] for r in listed} == {
        hooked.id: ["hook"],
        napping.id: ["sleep"],
    }
    assert "waiting_on" not in json.loads(cli(url, "runs", "list", "--json").stdout)[0]
    assert cli(url, "runs", "list", "--waiting", "--workflow", "quick").stdout == "no runs waiting\n"


def test_runs_show_says_what_the_run_waits_for(wf: Workflows, url: str) -> None:
    hooked, _, done = started(wf)
    text = cli(url, "runs", "show", hooked.id).stdout
    assert "waiting on\n  hook hook:1 (token hidden)\n" in text and TOKEN not in text
    shown = json.loads(cli(url, "runs", "show", hooked.id, "--json").stdout)
    assert shown["waiting_on"][0]["kind"] == "hook" and shown["waiting_on"][0]["token"] is None
    assert "waiting on" not in cli(url, "runs", "show", done.id).stdout
    assert json.loads(cli(url, "runs", "show", done.id, "--json").stdout)["waiting_on"] == []


def test_runs_watch_shows_what_the_run_waits_for_until_it_ends(wf: Workflows, url: str) -> None:
    hooked, _, _ = started(wf)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [
        sys.executable,
        "-m",
        "celery_workflow.cli",
        "--world",
        url,
        "runs",
        "watch",
        hooked.id,
        "--interval",
        "0.05",
    ]
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            first = proc.stdout.readline()
            assert "running" in first and "waiting on hook hook:1 (token hidden)" in first, first
            wf.resume_hook(TOKEN, {"ok": True})
            LocalWorker(wf).run_until_complete(hooked)
            rest, errors = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:  # a failed check above: do not wait for a watch that never ends
                proc.kill()
    assert proc.returncode == 0, errors
    assert rest.splitlines()[-1] == 'output  {"ok": true}' and "waiting on" not in rest.splitlines()[-2]
