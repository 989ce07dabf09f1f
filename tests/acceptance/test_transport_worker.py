"""Real ``celery worker`` processes on the SQLite transport: plain tasks, inspect, countdown, worker loss, -Q.

Two workers start once for the module (in parallel): ``w1`` consumes the default queue (prefork, 2 processes) and
``w2`` consumes only ``backfill``, each on its own database file. Tasks record what they saw in a JSON-lines file.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from celery import Celery

pytestmark = pytest.mark.acceptance

T = TypeVar("T")

APP_MODULE = "cw_transport_app"
TRANSPORT = "celery_workflow.transport.sqlite:Transport"
LEASE = 2.0

APP_SOURCE = f'''
import json, os, time
from celery import Celery

HERE = os.path.dirname(os.path.abspath(__file__))
app = Celery("{APP_MODULE}")
app.conf.update(
    broker_transport="{TRANSPORT}",
    broker_url="sqlite:///" + os.path.join(HERE, "broker.db"),
    broker_transport_options={{"lease_seconds": {LEASE}}},
    broker_connection_retry_on_startup=True,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    worker_lost_wait=1.0,
)


def _record(task, tag, **extra):
    info = (task.request.properties or {{}}).get("delivery_info") or {{}}
    line = {{
        "tag": tag, "pid": os.getpid(), "at": time.time(), "receipt": info.get("cw_receipt"),
        "attempts": info.get("cw_attempts"), "queue": info.get("routing_key"), **extra,
    }}
    with open(os.path.join(HERE, "results.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\\n")


@app.task(bind=True)
def record(self, tag):
    _record(self, tag)


@app.task(bind=True)
def hold(self, tag, seconds):
    _record(self, tag, phase="start")
    time.sleep(seconds)
    _record(self, tag, phase="done")


@app.task(bind=True)
def crash_once(self, tag):
    _record(self, tag, phase="start")
    if (self.request.properties.get("delivery_info") or {{}}).get("cw_attempts") == 1:
        time.sleep(60)  # killed here by the test
    _record(self, tag, phase="done")
'''


@dataclass
class Env:
    """One app directory with its database, results file and worker."""

    root: Path
    name: str
    proc: subprocess.Popen[bytes] | None = None
    app: Celery = field(init=False)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / f"{APP_MODULE}.py").write_text(APP_SOURCE)
        self.app = Celery(APP_MODULE, set_as_current=False)
        self.app.conf.update(
            broker_transport=TRANSPORT,
            broker_url=f"sqlite:///{self.root / 'broker.db'}",
            broker_transport_options={"lease_seconds": LEASE},
        )

    @property
    def env(self) -> dict[str, str]:
        path = os.pathsep.join(p for p in (str(self.root), os.environ.get("PYTHONPATH", "")) if p)
        return {**os.environ, "PYTHONPATH": path}

    @property
    def log(self) -> Path:
        return self.root / "worker.log"

    def start(self, *args: str) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", APP_MODULE, "worker", "-l", "INFO", "-n", self.name, *args],
                cwd=self.root,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_ready(self) -> None:
        wait_for(lambda: b"ready." in self.log.read_bytes() if self.log.exists() else False, 30, self.tail)

    def terminate(self) -> None:
        """Ask for a warm shutdown of the worker's process group."""
        self.app.close()
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)

    def reap(self) -> None:
        """Wait briefly for the worker to exit, then SIGKILL its whole process group."""
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=8)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # pool children too, whatever the main process did
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else "(no log)"

    def results(self, tag: str | None = None) -> list[dict[str, Any]]:
        path = self.root / "results.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [r for r in map(json.loads, lines) if tag is None or r["tag"] == tag]

    def rows(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        with sqlite3.connect(self.root / "broker.db", timeout=30) as conn:
            return [tuple(r) for r in conn.execute(sql, params).fetchall()]

    def row_of(self, task_id: str) -> tuple[Any, ...] | None:
        found = self.rows(
            "SELECT attempts, lease_until, not_before FROM celery_workflow_queue"
            " WHERE json_extract(CAST(payload AS TEXT), '$.headers.id') = ?",
            task_id,
        )
        return found[0] if found else None


def wait_for(condition: Callable[[], T], timeout: float, describe: Callable[[], str] = str) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s\n{describe()}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Env, Env]]:
    base = tmp_path_factory.mktemp("transport_worker")
    default, backfill = Env(base / "default", "w1@cwtest"), Env(base / "backfill", "w2@cwtest")
    try:
        default.start("--pool=prefork", "-c", "2")
        backfill.start("--pool=solo", "-Q", "backfill")  # solo: a running task blocks the consuming thread
        default.wait_ready()
        backfill.wait_ready()
        yield default, backfill
    finally:
        for env in (default, backfill):
            env.terminate()
        for env in (default, backfill):
            env.reap()


@pytest.fixture
def w1(workers: tuple[Env, Env]) -> Env:
    return workers[0]


def test_plain_task_runs_and_is_deleted(w1: Env) -> None:
    result = w1.app.send_task(f"{APP_MODULE}.record", args=["plain"])
    (record,) = wait_for(lambda: w1.results("plain"), 15, w1.tail)
    assert record["attempts"] == 1 and record["receipt"]
    assert record["queue"] == "celery"
    wait_for(lambda: w1.row_of(result.id) is None, 10, w1.tail)  # acked: the row is gone


def test_inspect_ping_answers(w1: Env) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", APP_MODULE, "inspect", "ping", "-d", "w1@cwtest", "--timeout", "5"],
        cwd=w1.root,
        env=w1.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "pong" in out.stdout, out.stdout + out.stderr + w1.tail()
    # the client's reply queue went away with it
    assert w1.rows("SELECT name FROM celery_workflow_broker_queues WHERE name LIKE '%reply.celery.pidbox'") == []


def test_countdown_task_is_not_received_before_it_is_due(w1: Env) -> None:
    sent = time.time()
    result = w1.app.send_task(f"{APP_MODULE}.record", args=["countdown"], countdown=2)
    due = sent + 2
    observations = []
    while not w1.results("countdown"):
        row = w1.row_of(result.id)
        observations.append((time.time(), row))
        assert time.time() < sent + 20, w1.tail()
        time.sleep(0.05)
    early = [(at, row) for at, row in observations if at < due - 0.05]
    assert early, "the test never looked at the row before it was due"
    assert all(row is not None and row[0] == 0 and row[1] is None for _, row in early), early
    (record,) = w1.results("countdown")
    assert record["at"] >= due - 0.01
    assert record["attempts"] == 1


@pytest.mark.parametrize("pool", ["prefork", "solo"])
def test_leases_are_extended_under_a_running_task(workers: tuple[Env, Env], pool: str) -> None:
    env, queue = (workers[0], "celery") if pool == "prefork" else (workers[1], "backfill")
    tag = f"long-{pool}"
    env.app.send_task(f"{APP_MODULE}.hold", args=[tag, LEASE * 3], queue=queue)
    wait_for(lambda: env.results(tag), 15, env.tail)
    started = time.monotonic()
    wait_for(lambda: time.monotonic() - started > LEASE * 1.5, 10, env.tail)  # the first lease has run out by now …
    leases = env.rows(f"SELECT lease_until FROM celery_workflow_queue WHERE queue = '{queue}'")
    assert leases and leases[0][0] > time.time() * 1e6, leases  # … yet the row is still hidden: it was extended
    wait_for(lambda: [r for r in env.results(tag) if r.get("phase") == "done"], 30, env.tail)
    starts = [r for r in env.results(tag) if r.get("phase") == "start"]
    assert len(starts) == 1, starts  # no second delivery while it ran


def test_killed_pool_process_leads_to_redelivery(w1: Env) -> None:
    w1.app.send_task(f"{APP_MODULE}.crash_once", args=["crash"])
    (start,) = wait_for(lambda: w1.results("crash"), 15, w1.tail)
    os.kill(start["pid"], signal.SIGKILL)
    done = wait_for(lambda: [r for r in w1.results("crash") if r.get("phase") == "done"], 30, w1.tail)
    assert done[0]["attempts"] == 2
    assert done[0]["receipt"] != start["receipt"]
    assert w1.rows("SELECT COUNT(*) FROM celery_workflow_queue WHERE queue = 'celery'") == [(0,)]


def test_worker_heartbeats_reach_an_event_receiver_whose_queue_then_goes(w1: Env) -> None:
    seen: list[dict[str, Any]] = []
    with w1.app.connection_for_read() as conn:
        receiver = w1.app.events.Receiver(conn, handlers={"*": seen.append})
        deadline = time.monotonic() + 15
        for _ in receiver.itercapture(limit=None, timeout=15, wakeup=False):
            if any(e.get("hostname") == "w1@cwtest" for e in seen) or time.monotonic() > deadline:
                break
    assert any(e["type"] == "worker-heartbeat" and e["hostname"] == "w1@cwtest" for e in seen), w1.tail()
    leftover = "SELECT COUNT(*) FROM celery_workflow_broker_queues WHERE name LIKE 'celeryev.%'"
    assert w1.rows(leftover) == [(0,)]  # auto_delete: gone with its consumer
    assert w1.rows("SELECT COUNT(*) FROM celery_workflow_broker_bindings WHERE exchange = 'celeryev'") == [(0,)]


def test_worker_on_backfill_leaves_the_default_queue_alone(workers: tuple[Env, Env]) -> None:
    _, w2 = workers
    default = w2.app.send_task(f"{APP_MODULE}.record", args=["default"])
    w2.app.send_task(f"{APP_MODULE}.record", args=["backfill"], queue="backfill")
    (record,) = wait_for(lambda: w2.results("backfill"), 15, w2.tail)
    assert record["queue"] == "backfill"
    consumed = {q for (q,) in w2.rows("SELECT DISTINCT queue FROM celery_workflow_broker_consumers")}
    assert consumed == {"backfill", "w2@cwtest.celery.pidbox"}
    assert w2.results("default") == []
    assert w2.row_of(default.id) is not None and w2.row_of(default.id)[0] == 0  # never claimed
