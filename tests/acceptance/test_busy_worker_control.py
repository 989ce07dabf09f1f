"""A real ``celery worker -c 1`` (Celery's default prefork pool) with its pool full answers remote control and honours
revokes, on the SQLite, Postgres and SQS transports (issue #33, item 2; issue #28: our transports on Celery's event
loop). On the blocking loop the consumer waited in the pool's put-lock for a free process and read no control
message meanwhile: ``ping`` went unanswered, ``inspect`` timed out, and a task revoked while it sat in the worker ran.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from tests.integration.aws_fixtures import moto_fixture  # noqa: F401

from .test_transport_workers import PostgresBroker, SQLiteBroker
from .workers import Worker, aws_environment, wait_for

pytestmark = pytest.mark.acceptance

NAME = "busy@cwtest"
SLEEP = 3.0

APP_SOURCE = """
import json, os, time
from celery import Celery

HERE = os.path.dirname(os.path.abspath(__file__))
app = Celery("busyapp")
app.conf.update(
    broker_transport={transport!r},
    broker_url={url!r},
    broker_password=os.environ.get("CW_BROKER_PASSWORD") or None,
    broker_transport_options={options!r},
    broker_connection_retry_on_startup=True,
    task_acks_late=True,
)  # Celery's default prefetch (4 per process): the worker holds queued tasks while its one process is busy


def _record(tag, phase):
    with open(os.path.join(HERE, "results.jsonl"), "a") as f:
        f.write(json.dumps({{"tag": tag, "phase": phase, "at": time.time()}}) + "\\n")


@app.task
def sleeper(tag, seconds):
    _record(tag, "start")
    time.sleep(seconds)
    _record(tag, "done")


@app.task
def record(tag):
    _record(tag, "done")
"""


class Setup:
    """The app directory, the worker's environment and a client app of the test process's own."""

    def __init__(self, root: Path, transport: str, url: str, options: dict[str, Any], env: dict[str, str]) -> None:
        self.root = root
        self.env = env
        (root / "busyapp.py").write_text(APP_SOURCE.format(transport=transport, url=url, options=options))
        self.app = Celery("busyapp", set_as_current=False)
        self.app.conf.update(
            broker_transport=transport,
            broker_url=url,
            broker_password=env.get("CW_BROKER_PASSWORD") or None,
            broker_transport_options=options,
        )

    def results(self, tag: str, phase: str) -> list[dict[str, Any]]:
        path = self.root / "results.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [r for r in map(json.loads, lines) if r["tag"] == tag and r["phase"] == phase]

    def send(self, task: str, *args: Any) -> Any:
        return self.app.send_task(f"busyapp.{task}", args=list(args))


@pytest.fixture(params=["sqlite", "postgres", "sqs"])
def setup(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Setup]:
    with ExitStack() as stack:
        if request.param == "sqs":
            aws = stack.enter_context(aws_environment(request.getfixturevalue("moto")))
            for key, value in aws.items():
                monkeypatch.setenv(key, value)  # the client's AWS World (AWSWorld.from_env) too
            options: dict[str, Any] = {"wait_time_seconds": 1}
            setup = Setup(tmp_path, "celery_workflow.transport.sqs:Transport", "aws://", options, dict(aws))
        else:
            kind = SQLiteBroker if request.param == "sqlite" else PostgresBroker
            broker = stack.enter_context(kind.open(tmp_path))
            env = {"CW_BROKER_PASSWORD": broker.password or ""}
            setup = Setup(tmp_path, broker.transport, broker.url, dict(broker.options), env)
        stack.callback(setup.app.close)
        yield setup


def test_a_full_pool_answers_ping_and_inspect_and_honours_a_revoke(setup: Setup) -> None:
    worker = Worker("busyapp", setup.env, setup.root / "worker.log", ("-c", "1", "-n", NAME), cwd=setup.root)
    tail = lambda: worker.log.read_text(errors="replace")[-4000:]  # noqa: E731
    try:
        worker.wait_ready()
        for i in range(3):
            setup.send("sleeper", f"s{i}", SLEEP)
        victim = setup.send("record", "victim")
        wait_for(lambda: setup.results("s0", "start"), 30, tail)  # the pool's one process is busy
        setup.app.control.revoke(victim.id)
        replies = setup.app.control.ping([NAME], timeout=1)
        assert replies and NAME in replies[0], (replies, tail())
        active = setup.app.control.inspect([NAME], timeout=1).active()
        assert active and [t["name"] for t in active[NAME]] == ["busyapp.sleeper"], (active, tail())
        stats = setup.app.control.inspect([NAME], timeout=5).stats()
        assert stats and stats[NAME]["pool"]["implementation"] == "celery.concurrency.prefork:TaskPool", stats
        wait_for(lambda: setup.results("s2", "done"), 60, tail)
        setup.send("record", "after")  # received after the victim was: done once the victim was dealt with
        wait_for(lambda: setup.results("after", "done"), 30, tail)
        assert setup.results("victim", "done") == [], tail()  # revoked while it waited in the worker: never ran
    finally:
        worker.stop()
