"""The README's deployment blocks, run as written: the "Embedded" block line by line (its worker in the background,
in a directory of its own), and the "PostgreSQL" block after the embedded block's exports, then its start and show commands.

What the test changes, and why: `pip install` lines are skipped (the suite runs on the installed checkout), the
Postgres URL points at a schema of the test's own, and ``TASK_WAIT_SECONDS=1`` shortens the example's 30 s wait."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from .workers import Worker, postgres_schema, wait_for

pytestmark = pytest.mark.acceptance

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def sh_block(heading: str) -> list[list[str]]:
    """The commands of the first ``sh`` block under ``### <heading>``, without comments."""
    section = README.split(f"\n### {heading}\n", 1)[1]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    return [shlex.split(line, comments=True) for line in block.splitlines() if shlex.split(line, comments=True)]


class Shell:
    """Runs README commands in ``cwd`` with an environment of its own; ``celery … worker`` goes to the background."""

    def __init__(self, cwd: Path, env: dict[str, str], overrides: dict[str, str]) -> None:
        self.cwd = cwd
        self.env = {**env, "PYTHONPATH": f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"}
        self.overrides = overrides
        self.stack = ExitStack()

    def run(self, words: list[str]) -> str:
        if words[:2] == ["pip", "install"]:
            return ""  # the suite runs on the checkout its own command installed
        if words[0] == "export":
            for assignment in words[1:]:
                key, value = assignment.split("=", 1)
                self.env[key] = self.overrides.get(key, value)
            return ""
        if words[:2] == ["celery", "-A"] and "worker" in words:
            worker = Worker(words[2], self.env, self.cwd / "worker.log", words[4:], cwd=self.cwd)
            self.stack.callback(worker.kill)
            worker.wait_ready()
            return ""
        program = {"python": [sys.executable], "celery-workflow": self._cli()}.get(words[0], [words[0]])
        done = subprocess.run(
            [*program, *words[1:]], cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 0, f"{shlex.join(words)} failed:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    @staticmethod
    def _cli() -> list[str]:
        found = shutil.which("celery-workflow")
        return [found] if found else [sys.executable, "-m", "celery_workflow.cli"]


@contextmanager
def shell(tmp_path: Path, **overrides: str) -> Iterator[Shell]:
    base = {k: v for k, v in os.environ.items() if k not in ("CELERY_WORKFLOW_URL", "TASKS_DB", "TASKS_TABLE")}
    sh = Shell(tmp_path, {**base, "TASK_WAIT_SECONDS": "1"}, overrides)
    with sh.stack:
        yield sh


def shows_done(sh: Shell) -> bool:
    return '"Status": "Done"' in sh.run(["python", "-m", "examples.task_status", "show", "Breakfast"])


def test_embedded_block(tmp_path: Path) -> None:
    commands = sh_block("Embedded: SQLite, no servers")
    with shell(tmp_path) as sh:
        outputs = [sh.run(words) for words in commands]
        assert '"taskId": "Breakfast"' in outputs[3]  # start
        wait_for(lambda: shows_done(sh), 30, lambda: (tmp_path / "worker.log").read_text()[-3000:])
        assert "track_task" in sh.run(commands[-1])  # celery-workflow runs list
    assert (tmp_path / "celery_workflow.sqlite3").exists()  # the embedded default, in the working directory
    assert (tmp_path / "tasks.sqlite3").exists()


def test_postgres_block(tmp_path: Path) -> None:
    embedded = sh_block("Embedded: SQLite, no servers")
    with postgres_schema() as url, shell(tmp_path, CELERY_WORKFLOW_URL=url) as sh:
        for words in [w for w in embedded if w[0] == "export"] + sh_block("PostgreSQL"):  # "as above"
            sh.run(words)
        assert sh.env["CELERY_WORKFLOW_URL"] == url
        assert '"taskId": "Breakfast"' in sh.run(next(w for w in embedded if w[-2:] == ["start", "Breakfast"]))
        wait_for(lambda: shows_done(sh), 30, lambda: (tmp_path / "worker.log").read_text()[-3000:])
    assert not (tmp_path / "celery_workflow.sqlite3").exists()  # the run went to Postgres
