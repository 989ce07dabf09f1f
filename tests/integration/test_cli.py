"""`celery-workflow runs list | show | cancel` on a SQLite World, with clear errors."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

from celery_workflow import Workflows, create_hook
from celery_workflow.cli import main
from celery_workflow.testing import LocalWorker


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'cli.sqlite3'}"


@pytest.fixture
def wf(url: str) -> Iterator[Workflows]:
    workflows = Workflows(Celery("cli"), world=url, configure_broker=False)
    yield workflows
    workflows.close()


def cli(url: str, *args: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(["--world", url, *args], out=out)
    return code, out.getvalue()


def test_list_show_cancel(wf: Workflows, url: str, capsys: pytest.CaptureFixture[str]) -> None:
    @wf.step
    def double(x: int) -> int:
        return 2 * x

    @wf.workflow
    def doubler(x: int) -> int:
        return double(x)

    @wf.workflow
    def waiter() -> None:
        create_hook(token="cli-wait").wait()

    done = doubler.start(21)
    waiting = waiter.start()
    LocalWorker(wf).run_until_idle()
    assert done.status == "completed" and waiting.status == "running"

    code, out = cli(url, "runs", "list")
    assert code == 0
    assert done.id in out and waiting.id in out and "completed" in out
    code, out = cli(url, "runs", "list", "--status", "running")
    assert waiting.id in out and done.id not in out

    code, out = cli(url, "runs", "show", done.id)
    assert code == 0
    assert "output    42" in out and "step:double:1" in out and "run_completed" in out

    code, out = cli(url, "runs", "cancel", waiting.id)
    assert code == 0 and "cancelled" in out
    assert waiting.status == "cancelled"

    code, _ = cli(url, "runs", "cancel", done.id)
    assert code == 1
    assert "completed" in capsys.readouterr().err


def test_unknown_run_is_a_clear_error(wf: Workflows, url: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _ = cli(url, "runs", "show", "wrun_nope")
    assert code == 2
    assert "wrun_nope" in capsys.readouterr().err


def test_bad_world_url_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _ = cli("mysql://nowhere", "runs", "list")
    assert code == 2
    assert "unknown World URL scheme" in capsys.readouterr().err
