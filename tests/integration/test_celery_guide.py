"""The guide "Coming from an existing Celery app" (docs/coming-from-celery.md) as written (issue #29, item 4): its
refusal block raises the message it shows, and its migrated RabbitMQ app runs on a real ``celery worker`` with the
worker command, the Python and the commands the page gives, on the RabbitMQ at 127.0.0.1:5672.

The page marks its code with HTML comments: ``<!-- celery-guide:refused -->`` before the block that is refused,
``<!-- celery-guide:message -->`` before the message it shows, ``<!-- celery-guide:file NAME -->`` before the app
module, ``<!-- celery-guide:shell -->`` before the worker command, ``<!-- celery-guide:python -->`` before the code
that starts a run and ``<!-- celery-guide:command -->`` before commands run one per line.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from celery_workflow.errors import ConfigurationError

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "coming-from-celery.md"
MARKED = re.compile(
    r"^<!-- celery-guide:(?P<kind>\w+)(?: (?P<arg>\S+))? -->\n```(?P<lang>\w+)\n(?P<code>.*?)^```$", re.S | re.M
)


@dataclass(frozen=True)
class Block:
    kind: str
    arg: str | None
    code: str


def blocks(kind: str) -> list[Block]:
    return [Block(m["kind"], m["arg"], m["code"]) for m in MARKED.finditer(GUIDE.read_text()) if m["kind"] == kind]


def test_the_guide_marks_its_blocks() -> None:
    kinds = [m["kind"] for m in MARKED.finditer(GUIDE.read_text())]
    assert kinds == ["refused", "message", "file", "command", "shell", "python", "command"], kinds
    for kind in ("refused", "file", "python"):
        for block in blocks(kind):
            compile(block.code, f"{GUIDE.name}:{kind}", "exec")


def test_the_refusal_is_the_one_the_guide_shows(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)
    ((refused,), (message,)) = blocks("refused"), blocks("message")
    with pytest.raises(ConfigurationError) as caught:
        exec(compile(refused.code, GUIDE.name, "exec"), {"__name__": "guide"})
    assert f"{type(caught.value).__module__}.{type(caught.value).__name__}: {caught.value}\n" == message.code


def _rabbitmq() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=3):
            return True
    except OSError:
        return False


def _run(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=90, check=False)


def _celery(line: str) -> list[str]:
    words = shlex.split(line, comments=True)
    assert words[0] == "celery", line
    return [sys.executable, "-m", *words]


@pytest.fixture
def guide_dir(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    """The guide's directory: its app module written, its commands run, its worker command running there."""
    if not _rabbitmq():
        pytest.skip("RabbitMQ is not reachable at 127.0.0.1:5672")
    env = {k: v for k, v in os.environ.items() if k not in ("CELERY_WORKFLOW_URL", "CELERY_BROKER_URL")}
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env.get('PYTHONPATH', '')}"
    ((module,),) = (blocks("file"),)
    assert module.arg
    (tmp_path / module.arg).write_text(module.code)
    migrate = blocks("command")[0].code.strip()
    done = _run(_celery(migrate), tmp_path, env)
    assert done.returncode == 0, done.stdout + done.stderr
    ((shell,),) = (blocks("shell"),)
    command = _celery(shell.code.strip())
    assert command[4:6] == ["billing", "worker"], command
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*command, "--without-heartbeat", "--loglevel=INFO"],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        while b"ready." not in log.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the guide's worker did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.05)
        yield tmp_path, env
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        _run([sys.executable, "-m", "celery", "-A", "billing", "purge", "-f", "-Q", "billing"], tmp_path, env)
        _run([sys.executable, "-m", "celery", "-A", "billing", "amqp", "queue.delete", "billing"], tmp_path, env)


@pytest.mark.acceptance
def test_the_migrated_rabbitmq_app_runs_as_written(guide_dir: tuple[Path, dict[str, str]]) -> None:
    cwd, env = guide_dir
    ((code,),) = (blocks("python"),)
    done = _run([sys.executable, "-c", code.code], cwd, env)
    log = (cwd / "worker.log").read_text()
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n--- worker log ---\n{log[-3000:]}"
    assert done.stdout == "{'receipt': 'rcpt-acme-1200', 'approved': True}\n"
    # the plain task the workflow started ran on RabbitMQ, beside the workflow's tasks
    deadline = time.monotonic() + 30
    while "send_invoice" not in log or "succeeded" not in log.split("billing.send_invoice", 1)[-1]:
        assert time.monotonic() < deadline, log[-3000:]
        time.sleep(0.1)
        log = (cwd / "worker.log").read_text()
    for name in ("workflow.renew", "step.charge"):  # a step runs as its own task when retried (else inline)
        assert f"Task {name}[" in log
    for line in blocks("command")[1].code.strip().splitlines():
        ran = _run(_celery(line), cwd, env)
        assert ran.returncode == 0, f"{line}: {ran.stdout}{ran.stderr}"
        if "runs list" in line:
            assert "renew" in ran.stdout and "completed" in ran.stdout, ran.stdout
        if "relay --once" in line:
            assert "published 0 deliveries" in ran.stdout, ran.stdout  # nothing waits
