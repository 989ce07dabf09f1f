"""Workflows over the app's own broker through the relay (issue #29, item 2), with real `celery worker` processes:
an app whose broker is RabbitMQ, and one whose broker is Redis (``apps/relayapp.py``).

What it shows, on each broker: a workflow with steps, a retried step, a hook and a durable sleep completes over that
broker while the app's plain tasks keep running on it; a worker killed mid-step loses nothing; a message the broker
lost (``celery purge`` of its queue: a broker restart cannot be done here) is published again when its lease in the
World runs out, and a sleep of three months is not in the broker at all, so a purge cannot lose it.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from urllib.parse import urlsplit

import pytest
from kombu import Connection

from tests.acceptance.workers import APPS, Worker, imported_app, wait_for

pytestmark = pytest.mark.timeout(180)

BROKERS = {
    "rabbitmq": os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//"),
    "redis": os.environ.get("RELAY_REDIS_URL", "redis://127.0.0.1:6379/14"),
}
LEASE = 3.0  # seconds a relayed delivery stays leased: a lost one comes back this fast


def _reachable(url: str) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 5672), timeout=3):
            return True
    except OSError:
        return False


@pytest.fixture(params=sorted(BROKERS))
def env(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, str]:
    url = BROKERS[request.param]
    if not _reachable(url):
        pytest.skip(f"{request.param} is not reachable at {url}")
    markers = tmp_path / "markers"
    markers.mkdir()
    return {
        "RELAY_BROKER_URL": url,
        "RELAY_QUEUE": f"cw-relay-{secrets.token_hex(4)}",
        "RELAY_OTHER_QUEUE": f"cw-relay-other-{secrets.token_hex(4)}",
        "CELERY_WORKFLOW_URL": f"sqlite:///{tmp_path / 'world.db'}",
        "CW_RELAY_LEASE": str(LEASE),
        "CW_MARKERS": str(markers),
    }


@pytest.fixture
def app(env: dict[str, str]) -> Iterator[ModuleType]:
    with imported_app("relayapp", env) as module:
        yield module
    _delete_queues(env["RELAY_BROKER_URL"], env["RELAY_QUEUE"], env["RELAY_OTHER_QUEUE"])


def _delete_queues(url: str, *queues: str) -> None:
    """Leave nothing on the shared broker: the test's queues deleted with their messages (in this process: a
    ``celery purge`` and ``celery amqp queue.delete`` per queue cost seconds of interpreter start each)."""
    with Connection(url) as conn:
        for queue in queues:
            conn.default_channel.queue_delete(queue)


def _celery(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "relayapp", *args],
        check=False,
        cwd=APPS,
        env={**os.environ, "PYTHONPATH": f"{APPS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def start_worker(env: dict[str, str], tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    started: list[Worker] = []

    def start(name: str = "w1", *queues: str) -> Worker:
        args = ["-c", "2", "-n", f"{name}@%h", *(["-Q", ",".join(queues)] if queues else [])]
        worker = Worker("relayapp", env, tmp_path / f"{name}.log", args)
        started.append(worker)
        worker.wait_ready(60)
        return worker

    yield start
    for worker in started:  # warm shutdowns side by side: each takes seconds of Celery's own pool shutdown
        worker.proc.send_signal(signal.SIGTERM)
    for worker in started:
        worker.stop()


def test_a_workflow_and_plain_tasks_run_over_the_apps_broker(
    app: ModuleType, env: dict[str, str], start_worker: Callable[..., Worker]
) -> None:
    start_worker()
    markers = Path(env["CW_MARKERS"])
    run = app.order.start("o-1", 1.5)
    app.plain.delay("plain-1", "still here")  # an ordinary task of the app, on the same broker
    app.wf.resume_hook("approve:o-1", {"ok": True}, wait=60)
    result = run.result(timeout=60)
    assert result == {"receipt": "rcpt-o-1@2", "decision": {"ok": True}, "shipped": "shipped-o-1"}
    assert (markers / "charge-o-1-1").exists() and (markers / "charge-o-1-2").exists()  # retried once
    wait_for((markers / "plain-1").exists, 30)
    assert (markers / "plain-1").read_text() == "still here"
    types = [e.event_type for e in run.events()]
    assert "step_retrying" in types and "wait_completed" in types and "hook_received" in types
    wait_for(lambda: app.wf.world.store.peek() == [], 30, lambda: repr(app.wf.world.store.peek()))  # all acked
    pong = _celery(env, "inspect", "ping", "-t", "5")  # remote control: the app's broker, as before
    assert pong.returncode == 0 and "pong" in pong.stdout, pong.stdout + pong.stderr


def test_a_worker_relays_the_queues_it_consumes(
    app: ModuleType, env: dict[str, str], start_worker: Callable[..., Worker]
) -> None:
    start_worker("w1", env["RELAY_QUEUE"])
    routed = app.elsewhere.start(41)
    assert app.adding.start(3).result(timeout=60) == 3  # w1 relays and runs its own queue...
    (waiting,) = app.wf.world.store.peek([env["RELAY_OTHER_QUEUE"]])
    assert (waiting.run_id, waiting.attempts) == (routed.id, 0)  # ...but not a queue it does not consume
    start_worker("w2", env["RELAY_OTHER_QUEUE"])
    assert routed.result(timeout=60) == 42


def test_a_worker_killed_mid_step_loses_nothing(
    app: ModuleType, env: dict[str, str], start_worker: Callable[..., Worker]
) -> None:
    markers = Path(env["CW_MARKERS"])
    first = start_worker("w1")
    run = app.killable.start("k")
    wait_for((markers / "slow-k-started-1").exists, 60)
    first.kill()  # SIGKILL, pool and all, mid-step
    start_worker("w2")
    wait_for(lambda: any(markers.glob("slow-k-started-[2-9]")), 60, lambda: str(sorted(markers.iterdir())))
    (markers / "slow-k-release").touch()
    assert run.result(timeout=60).startswith("k@")
    steps = [s for s in run.steps() if s.step_name == "slow_once"]
    assert len(steps) == 1 and steps[0].status == "completed"


def test_a_message_the_broker_lost_is_published_again_and_a_long_sleep_is_not_in_the_broker(
    app: ModuleType, env: dict[str, str], start_worker: Callable[..., Worker]
) -> None:
    run = app.adding.start(3)
    once = _celery(env, "workflow", "relay", "--once")
    assert once.returncode == 0 and "published 1 deliveries" in once.stdout, once.stdout + once.stderr
    purged = _celery(env, "purge", "-f", "-Q", env["RELAY_QUEUE"])
    assert purged.returncode == 0 and "1 message" in purged.stdout, purged.stdout + purged.stderr  # lost
    start_worker()
    assert run.result(timeout=60) == 3  # published again when its lease ran out
    # a sleep of three months: the run suspends, its wake-up waits in the World with its due time
    sleeper = app.order.start("o-2", timedelta(days=90).total_seconds())
    app.wf.resume_hook("approve:o-2", {"ok": True}, wait=60)
    wait_for(lambda: app.wf.world.store.delayed([env["RELAY_QUEUE"]]), 60)
    assert _celery(env, "purge", "-f", "-Q", env["RELAY_QUEUE"]).returncode == 0
    (held,) = app.wf.world.store.delayed([env["RELAY_QUEUE"]])
    assert held.run_id == sleeper.id and held.due > time.time() + 89 * 86400  # still due in three months
    assert sleeper.status == "running"


def _waiting(env: dict[str, str], app: ModuleType) -> int:
    """Messages waiting on the test's queue in the app's broker (0 while the broker has no such queue)."""
    with app.celery_app.connection_for_write() as conn:
        try:
            return int(conn.default_channel.queue_declare(env["RELAY_QUEUE"], passive=True).message_count)
        except conn.channel_errors:
            return 0


def test_the_relay_alone_publishes_until_stopped(
    app: ModuleType, env: dict[str, str], start_worker: Callable[..., Worker], tmp_path: Path
) -> None:
    log = (tmp_path / "relay.log").open("w")
    relay = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "relayapp", "workflow", "relay", "--queue", env["RELAY_QUEUE"]],
        cwd=APPS,
        env={**os.environ, "PYTHONPATH": f"{APPS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **env},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        run = app.adding.start(4)
        wait_for(lambda: _waiting(env, app) == 1, 30, (tmp_path / "relay.log").read_text)
    finally:
        relay.terminate()
        relay.wait(timeout=15)
        log.close()
    assert relay.returncode == 0
    assert "stopped after publishing 1 deliveries" in (tmp_path / "relay.log").read_text()
    start_worker()
    assert run.result(timeout=60) == 6


def test_the_relay_command_refuses_what_it_cannot_relay(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{APPS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env["CELERY_WORKFLOW_URL"] = f"sqlite:///{tmp_path / 'world.db'}"
    world_app = subprocess.run(  # wfapp's Workflows uses broker="world": its workers consume the World themselves
        [sys.executable, "-m", "celery", "-A", "wfapp", "workflow", "relay", "--once"],
        cwd=APPS, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert world_app.returncode == 2 and "broker='world'" in world_app.stderr, world_app.stderr
    no_app = subprocess.run(
        [sys.executable, "-m", "celery_workflow.cli", "--world", env["CELERY_WORKFLOW_URL"], "relay", "--once"],
        cwd=APPS, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert no_app.returncode == 2 and "relay needs the Celery app" in no_app.stderr, no_app.stderr


def test_on_a_postgres_world_over_rabbitmq(tmp_path: Path) -> None:
    """The same workflow with the Postgres World: its LISTEN/NOTIFY wakes the relay, its tables hold the election."""
    url = BROKERS["rabbitmq"]
    if not _reachable(url):
        pytest.skip(f"rabbitmq is not reachable at {url}")
    from tests.acceptance.workers import postgres_schema

    markers = tmp_path / "markers"
    markers.mkdir()
    with postgres_schema() as world_url:
        env = {
            "RELAY_BROKER_URL": url,
            "RELAY_QUEUE": f"cw-relay-{secrets.token_hex(4)}",
            "RELAY_OTHER_QUEUE": f"cw-relay-other-{secrets.token_hex(4)}",
            "CELERY_WORKFLOW_URL": world_url,
            "CW_RELAY_LEASE": str(LEASE),
            "CW_MARKERS": str(markers),
        }
        worker = Worker("relayapp", env, tmp_path / "w1.log", ["-c", "2", "-n", "pg@%h"])
        try:
            with imported_app("relayapp", env) as app:
                worker.wait_ready(60)
                run = app.order.start("o-pg", 1.0)
                app.wf.resume_hook("approve:o-pg", {"ok": True}, wait=60)
                assert run.result(timeout=60)["receipt"] == "rcpt-o-pg@2"
                assert app.adding.start(5).result(timeout=60) == 10
        finally:
            worker.stop()
            _delete_queues(url, env["RELAY_QUEUE"])
