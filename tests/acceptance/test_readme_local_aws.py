"""The README's "AWS on your machine" block, run as written by bash from the repository's root: the emulator in the
background, ``celery-workflow provision``, a Celery worker on the SQS transport in the background, a run started and
watched until it completed, then the worker and the emulator stopped.

What the test changes, and why: the ``pip install`` line is left out (the suite runs on the installed checkout), and
the emulator's port 4566 becomes a free one (parallel tests, a developer's own emulator). Nothing else: the commands
come from README.md, so the README cannot drift from what works."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.acceptance

ROOT = Path(__file__).resolve().parents[2]
HEADING = "### AWS on your machine"


def readme_block() -> str:
    """The first ``sh`` block under the heading, as written."""
    section = (ROOT / "README.md").read_text().split(f"\n{HEADING}\n", 1)[1]
    return section.split("```sh\n", 1)[1].split("```", 1)[0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_the_block_is_the_newcomers_path() -> None:
    """The commands the README promises are there: the emulator, provision, a worker, a run watched to the end."""
    block = readme_block()
    for command in (
        "python -m celery_workflow.testing.moto_server --port 4566 &",
        "celery-workflow provision workflow --queue backfill",
        "celery -A examples.local_aws worker -Q celery,backfill &",
        'celery-workflow runs watch "$run"',
    ):
        assert command in block


def test_readme_local_aws_block_runs_as_written(tmp_path: Path) -> None:
    lines = [line for line in readme_block().splitlines() if not line.startswith("pip install")]
    script = "set -eo pipefail\n" + "\n".join(lines).replace("4566", str(free_port())) + "\n"
    (tmp_path / "walkthrough.sh").write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "WORKFLOW_", "CELERY_WORKFLOW"))}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    started = time.monotonic()
    shell = subprocess.Popen(
        ["bash", str(tmp_path / "walkthrough.sh")],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = shell.communicate(timeout=60)
    finally:
        try:
            os.killpg(shell.pid, signal.SIGKILL)  # whatever the script left behind (nothing, when it passed)
        except ProcessLookupError:
            pass
        shell.wait(10)
    took = time.monotonic() - started
    assert shell.returncode == 0, out
    assert "completed" in out, out
    assert 'output  {"n": 4, "sum": 30}' in out, out
    assert "step:total:1" in out, out  # the step on the backfill queue ran, as `runs show` lists it
    assert took < 45, f"the walkthrough took {took:.0f} s"
