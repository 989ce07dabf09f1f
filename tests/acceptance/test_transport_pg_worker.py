"""Real ``celery worker`` and ``celery flower`` processes on the Postgres transport.

Two workers start once for the module (in parallel) on one schema of their own: ``w1`` consumes the default queue
(prefork, 2 processes, task events on) and ``w2`` consumes only ``backfill`` (threads). Tasks record what they saw in a
JSON-lines file. The last tests kill every connection of the schema while ``w1`` works through a stream of tasks:
once (transactions retry), then for longer than the retries last (the schema's own login role is refused), until
Celery itself reconnects.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from celery import Celery
from psycopg.conninfo import make_conninfo

from celery_workflow.transport.postgres import close_store
from tests.integration.pg_fixtures import DATABASE_URL, admin_connection, schema_url, terminate_backends

pytestmark = pytest.mark.acceptance

T = TypeVar("T")

APP_MODULE = "cw_pg_transport_app"
TRANSPORT = "celery_workflow.transport.postgres:Transport"
LEASE = 2.0
W1, W2 = "w1@cwpg", "w2@cwpg"

APP_SOURCE = f'''
import json, os, time
from celery import Celery

HERE = os.path.dirname(os.path.abspath(__file__))
app = Celery("{APP_MODULE}")
app.conf.update(
    broker_transport="{TRANSPORT}",
    broker_url=os.environ["CW_BROKER_URL"],
    broker_password=os.environ.get("CW_BROKER_PASSWORD") or None,
    broker_transport_options={{"lease_seconds": {LEASE}, "pool_timeout": 0.5}},
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
        "attempts": info.get("cw_attempts"), "queue": info.get("routing_key"), "hostname": task.request.hostname,
        **extra,
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


def wait_for(condition: Callable[[], T | None], timeout: float, describe: Callable[[], str] = str) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s\n{describe()}")
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Env:
    """The app directory, the schema, the worker processes and a way to look at the broker tables."""

    root: Path
    schema: str
    url: str
    role: str | None = None  # a login role of the module's own, when the server lets the tests create one
    password: str | None = None  # the role's, passed as broker_password (never in the URL, which Flower shows)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    app: Celery = field(init=False)
    observer: psycopg.Connection[Any] = field(init=False)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / f"{APP_MODULE}.py").write_text(APP_SOURCE)
        self.app = Celery(APP_MODULE, set_as_current=False)
        self.app.conf.update(broker_transport=TRANSPORT, broker_url=self.url, broker_password=self.password)
        # a different application_name: terminating the schema's connections leaves the test's observer alone
        observer = make_conninfo(self.url, application_name=f"{self.schema}_observer", password=self.password)
        self.observer = psycopg.connect(observer)
        self.observer.autocommit = True

    @property
    def env(self) -> dict[str, str]:
        path = os.pathsep.join(p for p in (str(self.root), os.environ.get("PYTHONPATH", "")) if p)
        return {
            **os.environ,
            "PYTHONPATH": path,
            "CW_BROKER_URL": self.url,
            "CW_BROKER_PASSWORD": self.password or "",
            "FLOWER_UNAUTHENTICATED_API": "1",
        }

    def log(self, name: str) -> Path:
        return self.root / f"{name}.log"

    def spawn(self, name: str, args: Sequence[str]) -> None:
        with self.log(name).open("ab") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", APP_MODULE, *args],
                cwd=self.root,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def start_worker(self, name: str, *args: str) -> None:
        self.spawn(name, ["worker", "-l", "INFO", "-n", name, *args])

    def wait_ready(self, name: str) -> None:
        log = self.log(name)
        wait_for(lambda: log.exists() and b"ready." in log.read_bytes(), 30, lambda: self.tail(name))

    def stop(self, *names: str) -> None:
        """SIGTERM the main processes (all at once: a synloop worker takes seconds to stop), then SIGKILL the process
        groups, so nothing of them survives (pool children included)."""
        procs = [p for p in (self.procs.pop(name, None) for name in names) if p is not None]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for proc in procs:
                try:
                    if sig == signal.SIGTERM:
                        proc.send_signal(sig)
                    else:
                        os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 10
            for proc in procs:
                try:
                    proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    pass

    def tail(self, name: str = W1) -> str:
        log = self.log(name)
        return log.read_text(errors="replace")[-4000:] if log.exists() else "(no log)"

    def results(self, tag: str | None = None, prefix: str | None = None) -> list[dict[str, Any]]:
        path = self.root / "results.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        found = [json.loads(line) for line in lines if line.strip()]
        return [
            r for r in found if (tag is None or r["tag"] == tag) and (prefix is None or r["tag"].startswith(prefix))
        ]

    def rows(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        return [tuple(r) for r in self.observer.execute(sql, params).fetchall()]

    def row_of(self, task_id: str) -> tuple[Any, ...] | None:
        found = self.rows(
            "SELECT attempts, lease_until, not_before FROM celery_workflow_queue"
            " WHERE convert_from(payload, 'UTF8')::jsonb -> 'headers' ->> 'id' = %s",
            task_id,
        )
        return found[0] if found else None

    def send(self, task: str, *args: Any, **options: Any) -> Any:
        return self.app.send_task(f"{APP_MODULE}.{task}", args=list(args), **options)


def _create_role(admin: psycopg.Connection[Any], name: str, schema: str) -> tuple[str, str] | None:
    """``(url, password)`` of a login role owning ``schema`` (so the database can be taken away from the workers), or
    None when the test user may not create roles."""
    if "://" not in DATABASE_URL:
        return None
    password = secrets.token_hex(12)
    try:
        admin.execute(f"CREATE ROLE \"{name}\" LOGIN PASSWORD '{password}'")
    except psycopg.errors.InsufficientPrivilege:
        return None
    admin.execute(f'ALTER SCHEMA "{schema}" OWNER TO "{name}"')
    parts = urlsplit(schema_url(schema))
    return urlunsplit(parts._replace(netloc=f"{name}@{parts.netloc.rpartition('@')[2]}")), password


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    schema = f"cw_test_{secrets.token_hex(6)}"
    with admin_connection() as admin:
        admin.execute(f'CREATE SCHEMA "{schema}"')
        role = _create_role(admin, schema, schema)
    if role is None:
        e = Env(tmp_path_factory.mktemp("pg_transport_worker"), schema, schema_url(schema))
    else:
        e = Env(tmp_path_factory.mktemp("pg_transport_worker"), schema, role[0], schema, role[1])
    try:
        e.start_worker(W1, "--pool=prefork", "-c", "2", "-E")
        e.start_worker(W2, "--pool=threads", "-c", "2", "-Q", "backfill")
        e.wait_ready(W1)
        e.wait_ready(W2)
        yield e
    finally:
        e.stop(*e.procs)
        e.app.close()
        close_store(e.url)
        e.observer.close()
        with admin_connection() as admin:
            if e.role:
                admin.execute(f'ALTER ROLE "{e.role}" LOGIN')
            terminate_backends(admin, schema)
            admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            if e.role:
                admin.execute(f'DROP ROLE IF EXISTS "{e.role}"')


def test_plain_task_runs_and_is_deleted(env: Env) -> None:
    result = env.send("record", "plain")
    (record,) = wait_for(lambda: env.results("plain"), 15, env.tail)
    assert record["attempts"] == 1 and record["receipt"]
    assert record["queue"] == "celery"
    assert record["hostname"] == W1
    wait_for(lambda: env.row_of(result.id) is None, 10, env.tail)  # acked: the row is gone


def test_inspect_ping_answers(env: Env) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", APP_MODULE, "inspect", "ping", "-d", W1, "--timeout", "5"],
        cwd=env.root,
        env=env.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "pong" in out.stdout, out.stdout + out.stderr + env.tail()
    # the client's reply queue went away with it
    assert env.rows("SELECT name FROM celery_workflow_broker_queues WHERE name LIKE '%%reply.celery.pidbox'") == []


def test_countdown_task_is_not_received_before_it_is_due(env: Env) -> None:
    sent = time.time()
    result = env.send("record", "countdown", countdown=2)
    due = sent + 2
    observations = []
    while not env.results("countdown"):
        row = env.row_of(result.id)
        observations.append((time.time(), row))
        assert time.time() < sent + 20, env.tail()
        time.sleep(0.05)
    early = [(at, row) for at, row in observations if at < due - 0.05]
    assert early, "the test never looked at the row before it was due"
    assert all(row is not None and row[0] == 0 and row[1] is None for _, row in early), early
    (record,) = env.results("countdown")
    assert record["at"] >= due - 0.01
    assert record["attempts"] == 1


def test_leases_are_extended_under_a_running_task(env: Env) -> None:
    env.send("hold", "long", LEASE * 1.75)
    wait_for(lambda: [r for r in env.results("long") if r.get("phase") == "done"], 20, env.tail)
    starts = [r for r in env.results("long") if r.get("phase") == "start"]
    assert len(starts) == 1, starts  # the lease never ran out: no second delivery while it ran


def test_killed_pool_process_leads_to_redelivery(env: Env) -> None:
    env.send("crash_once", "crash")
    (start,) = wait_for(lambda: env.results("crash"), 15, env.tail)
    os.kill(start["pid"], signal.SIGKILL)
    done = wait_for(lambda: [r for r in env.results("crash") if r.get("phase") == "done"], 30, env.tail)
    assert done[0]["attempts"] == 2
    assert done[0]["receipt"] != start["receipt"]
    wait_for(lambda: env.rows("SELECT COUNT(*) FROM celery_workflow_queue WHERE queue = 'celery'") == [(0,)], 10)


def test_a_backfill_worker_serves_only_backfill(env: Env) -> None:
    for n in range(3):
        env.send("record", f"to-default-{n}")
        env.send("record", f"to-backfill-{n}", queue="backfill")
    wait_for(lambda: len(env.results(prefix="to-")) == 6, 15, lambda: env.tail(W2))
    by_tag = {r["tag"]: r for r in env.results(prefix="to-")}
    assert {by_tag[f"to-backfill-{n}"]["hostname"] for n in range(3)} == {W2}
    assert {by_tag[f"to-backfill-{n}"]["queue"] for n in range(3)} == {"backfill"}
    assert {by_tag[f"to-default-{n}"]["hostname"] for n in range(3)} == {W1}
    assert {r["queue"] for r in env.results() if r["hostname"] == W2} == {"backfill"}


def _api(port: int, path: str) -> Any:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return json.loads(response.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
        return None


def test_flower_shows_workers_and_tasks(env: Env) -> None:
    port = free_port()
    env.spawn("flower", ["flower", "--address=127.0.0.1", f"--port={port}"])
    try:

        def worker_pages() -> dict[str, Any] | None:
            found = _api(port, "/api/workers?refresh=1") or {}
            complete = all(found.get(w, {}).get(k) for w in (W1, W2) for k in ("registered", "stats", "conf"))
            return found if complete else None

        workers = wait_for(worker_pages, 30, lambda: env.tail("flower") + env.tail(W1))
        assert f"{APP_MODULE}.record" in workers[W1]["registered"]
        assert [q["name"] for q in workers[W2]["active_queues"]] == ["backfill"]
        assert workers[W1]["conf"]["broker_url"] == env.url  # censored through the transport
        assert not env.password or env.password not in json.dumps(workers)  # broker_password stays out of sight
        sent = [env.send("record", f"flower-{n}").id for n in range(2)]

        def listed() -> dict[str, Any] | None:
            tasks = _api(port, "/api/tasks") or {}
            done = {tid: tasks[tid] for tid in sent if tasks.get(tid, {}).get("state") == "SUCCESS"}
            return done if len(done) == len(sent) else None

        tasks = wait_for(listed, 30, lambda: env.tail("flower"))
        assert {t["name"] for t in tasks.values()} == {f"{APP_MODULE}.record"}
        assert {t["worker"] for t in tasks.values()} == {W1}
    finally:
        env.stop("flower")


def test_workers_reconnect_when_every_connection_is_terminated(env: Env) -> None:
    total = 40
    for n in range(total):
        env.send("hold", f"stream-{n}", 0.1)

    def done() -> set[str]:
        return {r["tag"] for r in env.results(prefix="stream-") if r.get("phase") == "done"}

    def at_least(threshold: int) -> Callable[[], bool]:
        return lambda: len(done()) >= threshold

    killed = []
    for threshold in (5, 20):
        wait_for(at_least(threshold), 30, env.tail)
        assert len(done()) < total, "the stream was over before the connections were terminated"
        with admin_connection() as admin:
            killed.append(terminate_backends(admin, env.schema))
    assert all(n >= 2 for n in killed), killed  # both workers' listeners at least, and some pool connections
    wait_for(lambda: len(done()) == total, 60, env.tail)
    stream = "SELECT COUNT(*) FROM celery_workflow_queue WHERE convert_from(payload, 'UTF8') LIKE '%%stream-%%'"
    wait_for(lambda: env.rows(stream) == [(0,)], 15, env.tail)
    # the workers still answer afterwards
    after = env.send("record", "after-restart")
    wait_for(lambda: env.results("after-restart"), 15, env.tail)
    wait_for(lambda: env.row_of(after.id) is None, 10, env.tail)


def test_workers_reconnect_after_an_outage_longer_than_the_transaction_retries(env: Env) -> None:
    """The database refuses every connection until the worker gives up retrying its transactions and Celery itself
    reconnects (the connection error path); then it is back, and every task completes."""
    if env.role is None:
        pytest.skip("the test user cannot create roles, so the database cannot be taken away from the workers")
    lost = b"Connection to broker lost"
    before = env.log(W1).read_bytes().count(lost)
    total = 20
    for n in range(total):
        env.send("hold", f"outage-{n}", 0.1)
    with admin_connection() as admin:
        admin.execute(f'ALTER ROLE "{env.role}" NOLOGIN')  # new connections are refused ...
        try:
            terminate_backends(admin, env.schema)  # ... and the existing ones go
            wait_for(lambda: env.log(W1).read_bytes().count(lost) > before, 45, env.tail)
        finally:
            admin.execute(f'ALTER ROLE "{env.role}" LOGIN')

    def done() -> set[str]:
        return {r["tag"] for r in env.results(prefix="outage-") if r.get("phase") == "done"}

    wait_for(lambda: len(done()) == total, 60, env.tail)
    after = env.send("record", "after-outage")
    wait_for(lambda: env.results("after-outage"), 30, env.tail)
    wait_for(lambda: env.row_of(after.id) is None, 10, env.tail)
