"""Real ``celery worker`` and ``celery flower`` processes on plain Celery apps (no workflows), on both store-backed
transports: the same tests on SQLite and on Postgres.

For each transport, three workers start once (in parallel) on a broker of their own (a database file, or a Postgres
schema owned by a login role of its own when the server lets the tests create one): ``w1`` consumes the default queue
(prefork, 2 processes, task events on), ``w2`` only ``backfill`` (solo: a running task blocks the consuming thread) and
``w3`` only ``threads`` (a thread pool). Tasks record what they saw in a JSON-lines file. The Postgres-only tests at the
end kill every connection of the schema while ``w1`` works through a stream of tasks: once (transactions retry), then
for longer than the retries last (the schema's role is refused), until Celery itself reconnects.
"""

from __future__ import annotations

import fnmatch
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from celery import Celery
from psycopg.conninfo import make_conninfo

from celery_workflow.world_pg import PostgresWorld
from celery_workflow.world_sqlite import SQLiteWorld

from .workers import free_port, postgres_schema_named, wait_for

pytestmark = pytest.mark.acceptance

APP_MODULE = "cw_transport_app"
LEASE = 2.0
W1, W2, W3 = "w1@cwtest", "w2@cwtest", "w3@cwtest"
WORKERS = {
    W1: ("--pool=prefork", "-c", "2", "-E"),
    W2: ("--pool=solo", "-Q", "backfill"),
    W3: ("--pool=threads", "-c", "2", "-Q", "threads"),
}
POOLS = {"prefork": (W1, "celery"), "solo": (W2, "backfill"), "threads": (W3, "threads")}  # pool: worker, its queue

APP_SOURCE = """
import json, os, time
from celery import Celery

HERE = os.path.dirname(os.path.abspath(__file__))
app = Celery("{module}")
app.conf.update(
    broker_transport={transport!r},
    broker_url={url!r},
    broker_password=os.environ.get("CW_BROKER_PASSWORD") or None,
    broker_transport_options={options!r},
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
"""


# -- what differs between the backends ---------------------------------------------------------------------------------


class Broker:
    """One transport's broker: its URL and options, and the tests' look at what it stores, through its store's API
    (``peek``, ``queues``, ``consumers``, ``bindings``) on a store of the test process's own."""

    name: ClassVar[str]  # the test parameter
    transport: ClassVar[str]
    options: ClassVar[dict[str, Any]]

    def __init__(self, url: str, password: str | None = None) -> None:
        self.url = url
        self.password = password  # passed as broker_password, never in the URL (which Flower shows)

    @property
    def store(self) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        """Close what the test process opened on the broker."""

    def row_of(self, task_id: str) -> tuple[int, float | None] | None:
        """``(attempts, lease_until)`` of the stored message of a task, None once it is gone."""
        for message in self.store.peek():
            if json.loads(message.payload).get("headers", {}).get("id") == task_id:
                return message.attempts, message.leased_until
        return None

    def leases(self, queue: str) -> list[float | None]:
        """The lease of every message of ``queue``."""
        return [m.leased_until for m in self.store.peek([queue])]

    def messages(self, queue: str) -> int:
        return len(self.store.peek([queue]))

    def messages_containing(self, text: str) -> int:
        return sum(text.encode() in m.payload for m in self.store.peek())

    def declared_queues(self, pattern: str) -> list[str]:
        """The declared queues whose names match the shell-style ``pattern``."""
        return fnmatch.filter(self.store.queues(), pattern)

    def consumers(self) -> dict[str, int]:
        """How many live consumers each consumed queue has."""
        return dict(self.store.consumers())

    def bindings(self, exchange: str) -> int:
        return len(self.store.bindings(exchange))


class SQLiteBroker(Broker):
    """A database file in the module's directory."""

    name = "sqlite"
    transport = "celery_workflow.transport.sqlite:Transport"
    options: ClassVar[dict[str, Any]] = {"lease_seconds": LEASE}

    def __init__(self, path: Path) -> None:
        super().__init__(f"sqlite:///{path}")
        self.path = path
        self._world: SQLiteWorld | None = None

    @classmethod
    @contextmanager
    def open(cls, root: Path) -> Iterator[SQLiteBroker]:
        broker = cls(root / "broker.db")
        try:
            yield broker
        finally:
            broker.close()

    @property
    def store(self) -> Any:
        if self._world is None:
            self._world = SQLiteWorld.from_url(self.url)
        return self._world.store

    def close(self) -> None:
        if self._world is not None:
            self._world.close()


class PostgresBroker(Broker):
    """A schema of its own, owned by a login role of its own when the test user may create roles (so the database can
    be taken away from the workers); the connections of the workers carry the schema's name as application_name."""

    name = "postgres"
    transport = "celery_workflow.transport.postgres:Transport"
    options: ClassVar[dict[str, Any]] = {"lease_seconds": LEASE, "pool_timeout": 0.5}

    def __init__(self, url: str, schema: str, role: str | None = None, password: str | None = None) -> None:
        super().__init__(url, password)
        self.schema = schema
        self.role = role
        # another application_name: terminating the schema's connections leaves the test's observer alone
        self.observer = PostgresWorld.open(
            make_conninfo(url, application_name=f"{schema}_observer", password=password), concurrency=1
        )

    @property
    def store(self) -> Any:
        return self.observer.store

    @classmethod
    @contextmanager
    def open(cls, root: Path) -> Iterator[PostgresBroker]:
        role: str | None = None
        try:
            with postgres_schema_named() as schema:  # skips when the server is unreachable
                from tests.integration.pg_fixtures import admin_connection, schema_url

                with admin_connection() as admin:
                    created = _create_role(admin, schema, schema, schema_url(schema))
                if created is None:
                    broker = cls(schema_url(schema), schema)
                else:
                    role = schema
                    broker = cls(created[0], schema, role, created[1])
                try:
                    yield broker
                finally:
                    broker.close()
                    if role is not None:  # in case a test left it refused
                        with admin_connection() as admin:
                            admin.execute(f'ALTER ROLE "{role}" LOGIN')
        finally:
            if role is not None:
                from tests.integration.pg_fixtures import admin_connection

                with admin_connection() as admin:
                    admin.execute(f'DROP ROLE IF EXISTS "{role}"')

    def close(self) -> None:
        from celery_workflow.transport.postgres import close_store

        close_store(make_conninfo(self.url, password=self.password) if self.password else self.url)
        self.observer.close()


def _create_role(admin: psycopg.Connection[Any], name: str, schema: str, url: str) -> tuple[str, str] | None:
    """``(url, password)`` of a new login role owning ``schema``: ``url`` as the role, without the password; None
    when the test user may not create roles."""
    if "://" not in url:
        return None
    password = secrets.token_hex(12)
    try:
        admin.execute(f"CREATE ROLE \"{name}\" LOGIN PASSWORD '{password}'")
    except psycopg.errors.InsufficientPrivilege:
        return None
    admin.execute(f'ALTER SCHEMA "{schema}" OWNER TO "{name}"')
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{name}@{parts.netloc.rpartition('@')[2]}")), password


BROKERS: dict[str, type[SQLiteBroker] | type[PostgresBroker]] = {b.name: b for b in (SQLiteBroker, PostgresBroker)}


# -- the same for both -------------------------------------------------------------------------------------------------


class Env:
    """The app directory, the broker, the worker (and Flower) processes and the tasks' records."""

    def __init__(self, root: Path, broker: Broker) -> None:
        self.root = root
        self.broker = broker
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        source = APP_SOURCE.format(
            module=APP_MODULE, transport=broker.transport, url=broker.url, options=broker.options
        )
        (root / f"{APP_MODULE}.py").write_text(source)
        self.app = Celery(APP_MODULE, set_as_current=False)
        self.app.conf.update(
            broker_transport=broker.transport,
            broker_url=broker.url,
            broker_password=broker.password,
            broker_transport_options=broker.options,
        )

    @property
    def env(self) -> dict[str, str]:
        path = os.pathsep.join(p for p in (str(self.root), os.environ.get("PYTHONPATH", "")) if p)
        return {
            **os.environ,
            "PYTHONPATH": path,
            "CW_BROKER_PASSWORD": self.broker.password or "",
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

    def stop(self, *names: str, warm: bool = True) -> None:
        """SIGTERM the main processes (all at once: a worker takes seconds to stop), then SIGKILL the process groups,
        so nothing of them survives (pool children included); only the latter unless ``warm``."""
        procs = [p for p in (self.procs.pop(name, None) for name in names) if p is not None]
        for sig in (signal.SIGTERM, signal.SIGKILL) if warm else (signal.SIGKILL,):
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

    def done(self, prefix: str) -> set[str]:
        """Tags starting with ``prefix`` whose ``hold`` (or ``crash_once``) finished."""
        return {r["tag"] for r in self.results(prefix=prefix) if r.get("phase") == "done"}

    def send(self, task: str, *args: Any, **options: Any) -> Any:
        return self.app.send_task(f"{APP_MODULE}.{task}", args=list(args), **options)


@pytest.fixture(scope="module", params=list(BROKERS))
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    root = tmp_path_factory.mktemp(f"transport-{request.param}")
    with BROKERS[request.param].open(root) as broker:
        e = Env(root, broker)
        try:
            for name, args in WORKERS.items():
                e.start_worker(name, *args)
            for name in WORKERS:
                e.wait_ready(name)
            yield e
        finally:
            # no test looks at a warm shutdown, which takes a worker 4-7 s here (Celery's loop drains events for up
            # to 2 s once more after SIGTERM, then stops its pool)
            e.stop(*e.procs, warm=False)
            e.app.close()


def test_plain_task_runs_and_is_deleted(env: Env) -> None:
    result = env.send("record", "plain")
    (record,) = wait_for(lambda: env.results("plain"), 15, env.tail)
    assert record["attempts"] == 1 and record["receipt"]
    assert record["queue"] == "celery"
    assert record["hostname"] == W1
    wait_for(lambda: env.broker.row_of(result.id) is None, 10, env.tail)  # acked: the row is gone


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
    assert env.broker.declared_queues("*reply.celery.pidbox") == []  # the client's reply queue went away with it


def test_countdown_task_is_not_received_before_it_is_due(env: Env) -> None:
    sent = time.time()
    result = env.send("record", "countdown", countdown=2)
    due = sent + 2
    observations = []
    while not env.results("countdown"):
        observations.append((time.time(), env.broker.row_of(result.id)))
        assert time.time() < sent + 20, env.tail()
        time.sleep(0.05)
    early = [(at, row) for at, row in observations if at < due - 0.05]
    assert early, "the test never looked at the row before it was due"
    assert all(row is not None and row[0] == 0 and row[1] is None for _, row in early), early  # never claimed
    (record,) = env.results("countdown")
    assert record["at"] >= due - 0.01
    assert record["attempts"] == 1


def test_leases_are_extended_under_a_running_task(env: Env) -> None:
    """One task that outlives its lease three times on each pool at once: prefork (the consuming thread is free),
    solo (the task blocks it) and threads."""
    for pool, (_, queue) in POOLS.items():
        env.send("hold", f"long-{pool}", LEASE * 3, queue=queue)
    for pool, (worker, _) in POOLS.items():
        wait_for(lambda pool=pool: env.results(f"long-{pool}"), 15, lambda worker=worker: env.tail(worker))
    started = time.monotonic()
    wait_for(lambda: time.monotonic() - started > LEASE * 1.5, 10)  # every first lease has run out by now …
    now = time.time()
    for pool, (_, queue) in POOLS.items():
        leases = env.broker.leases(queue)
        assert len(leases) == 1 and (leases[0] or 0) > now, (pool, leases)  # … yet they are hidden: extended
    for pool, (worker, _) in POOLS.items():
        wait_for(lambda pool=pool: env.done(f"long-{pool}"), 30, lambda worker=worker: env.tail(worker))
        starts = [r for r in env.results(f"long-{pool}") if r.get("phase") == "start"]
        assert len(starts) == 1, starts  # no second delivery while it ran
        assert starts[0]["hostname"] == worker


def test_killed_pool_process_leads_to_redelivery(env: Env) -> None:
    env.send("crash_once", "crash")
    (start,) = wait_for(lambda: env.results("crash"), 15, env.tail)
    os.kill(start["pid"], signal.SIGKILL)
    done = wait_for(lambda: [r for r in env.results("crash") if r.get("phase") == "done"], 30, env.tail)
    assert done[0]["attempts"] == 2
    assert done[0]["receipt"] != start["receipt"]
    wait_for(lambda: env.broker.messages("celery") == 0, 10, env.tail)


def pool_children(pid: int) -> list[int]:
    """Pids of the live (not zombie) children of process ``pid``, from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            except (OSError, ValueError):
                continue
            if int(ppid) == pid and state != "Z":
                out.append(int(entry.name))
    return sorted(out)


def test_a_pool_whose_children_die_idle_goes_on(env: Env) -> None:
    """An idle prefork child waits for its next job holding the lock of the pool's job pipe; SIGKILL every child of a
    worker (so the holder dies with it) and the worker must still run the next task (billiard's own pool never did:
    the replacement children waited for that lock for ever).

    A worker of its own, stopped afterwards: when two children die at once, Celery's event loop can hand the second
    death's event to the replacement child that reused the first one's descriptor number, which then stays in the
    pool unwatched, and the worker's next reconnection stops it ("Unrecoverable error: ValueError('file descriptor is
    None')"; Celery's bug, on every broker: docs/design-notes.md). ``w1`` must reconnect in the tests below."""
    name = "w5@cwtest"
    env.start_worker(name, "--pool=prefork", "-c", "2", "-Q", "children")
    try:
        env.wait_ready(name)
        main = env.procs[name].pid
        tail = lambda: env.tail(name)  # noqa: E731
        children = wait_for(lambda: pool_children(main) if len(pool_children(main)) == 2 else None, 15, tail)
        for pid in children:
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: set(pool_children(main)).isdisjoint(children) and len(pool_children(main)) == 2, 15, tail)
        env.send("record", "after-kill", queue="children")
        (record,) = wait_for(lambda: env.results("after-kill"), 20, tail)
        assert record["hostname"] == name and record["pid"] not in children
    finally:
        env.stop(name, warm=False)


def test_sigterm_to_the_process_group_stops_a_worker_promptly(env: Env) -> None:
    """systemd's default stop (``KillMode=control-group``) sends SIGTERM to every process of the worker: the pool
    children die at once, the holder of the job pipe's lock among them; the main process must still finish its warm
    shutdown (it used to wait for that lock in its exit handler for ever)."""
    name = "term@cwtest"
    env.start_worker(name, "--pool=prefork", "-c", "2", "-Q", "term")
    env.wait_ready(name)
    proc = env.procs.pop(name)
    try:
        wait_for(lambda: len(pool_children(proc.pid)) == 2, 15, lambda: env.tail(name))
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)  # a hang fails here (seconds otherwise)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    assert proc.returncode == 0, env.tail(name)


def test_worker_heartbeats_reach_an_event_receiver_whose_queue_then_goes(env: Env) -> None:
    seen: list[dict[str, Any]] = []

    def heartbeat() -> bool:
        return any(e["type"] == "worker-heartbeat" and e.get("hostname") == W1 for e in seen)

    with env.app.connection_for_read() as conn:
        receiver = env.app.events.Receiver(conn, handlers={"*": seen.append})
        deadline = time.monotonic() + 15
        for _ in receiver.itercapture(limit=None, timeout=15, wakeup=False):
            if heartbeat() or time.monotonic() > deadline:
                break
    assert heartbeat(), env.tail()
    assert env.broker.declared_queues("celeryev.*") == []  # auto_delete: gone with its consumer
    assert env.broker.bindings("celeryev") == 0


def test_a_backfill_worker_serves_only_backfill(env: Env) -> None:
    for n in range(3):
        env.send("record", f"to-default-{n}")
        env.send("record", f"to-backfill-{n}", queue="backfill")
    wait_for(lambda: len(env.results(prefix="to-")) == 6, 15, lambda: env.tail(W2))
    by_tag = {r["tag"]: r for r in env.results(prefix="to-")}
    backfill = [by_tag[f"to-backfill-{n}"] for n in range(3)]
    default = [by_tag[f"to-default-{n}"] for n in range(3)]
    assert {r["hostname"] for r in backfill} == {W2}
    assert {r["queue"] for r in backfill} == {"backfill"}
    assert {r["hostname"] for r in default} == {W1}
    assert {r["attempts"] for r in default} == {1}  # the backfill worker never claimed one first
    assert {r["queue"] for r in env.results() if r["hostname"] == W2} == {"backfill"}
    # one consumer a queue: the backfill worker consumes backfill and its own pidbox, the default queue is w1's alone
    # (of the module's workers: one a test started and killed is still counted until its consumers time out)
    expected = {"celery": 1, "backfill": 1, "threads": 1, **{f"{w}.celery.pidbox": 1 for w in WORKERS}}
    consumers = env.broker.consumers()
    assert {q: consumers.get(q) for q in expected} == expected, consumers


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
            complete = all(found.get(w, {}).get(k) for w in WORKERS for k in ("registered", "stats", "conf"))
            return found if complete else None

        workers = wait_for(worker_pages, 30, lambda: env.tail("flower") + env.tail(W1))
        assert f"{APP_MODULE}.record" in workers[W1]["registered"]
        assert [q["name"] for q in workers[W2]["active_queues"]] == ["backfill"]
        assert [q["name"] for q in workers[W3]["active_queues"]] == ["threads"]
        assert workers[W1]["conf"]["broker_url"] == env.broker.url  # censored through the transport
        assert not env.broker.password or env.broker.password not in json.dumps(workers)  # kept out of sight
        sent = [env.send("record", f"flower-{n}").id for n in range(2)]

        def listed() -> dict[str, Any] | None:
            tasks = _api(port, "/api/tasks") or {}
            done = {tid: tasks[tid] for tid in sent if tasks.get(tid, {}).get("state") == "SUCCESS"}
            return done if len(done) == len(sent) else None

        tasks = wait_for(listed, 30, lambda: env.tail("flower"))
        assert {t["name"] for t in tasks.values()} == {f"{APP_MODULE}.record"}
        assert {t["worker"] for t in tasks.values()} == {W1}

        # an unregistered task is rejected by the worker and moved to the dead letters: Flower sees the move (the
        # transport's task-rejected event; the worker itself reports the failure, which outranks it as state). Celery
        # rejects the message before it sends task-failed, so Flower may hold the one event and not yet the other.
        lost = env.send("not_registered_anywhere").id

        def rejected() -> dict[str, Any] | None:
            info = _api(port, f"/api/task/info/{lost}") or {}
            return info if info.get("rejected") and info.get("exception") else None

        info = wait_for(rejected, 30, lambda: env.tail("flower") + env.tail(W1))
        assert info["state"] in ("REJECTED", "FAILURE") and "NotRegistered" in (info.get("exception") or "")
        assert "dead letter" in env.tail(W1)
    finally:
        env.stop("flower")


# -- Postgres only: a database server whose connections can be terminated and refused ----------------------------------


def postgres(env: Env) -> PostgresBroker:
    if not isinstance(env.broker, PostgresBroker):
        pytest.skip("Postgres only: a SQLite broker is a file, with no server connections to terminate or refuse")
    return env.broker


def test_workers_reconnect_when_every_connection_is_terminated(env: Env) -> None:
    pg = postgres(env)
    from tests.integration.pg_fixtures import admin_connection, terminate_backends

    total = 40
    for n in range(total):
        env.send("hold", f"stream-{n}", 0.1)

    def at_least(threshold: int) -> Callable[[], bool]:
        return lambda: len(env.done("stream-")) >= threshold

    killed = []
    for threshold in (5, 20):
        wait_for(at_least(threshold), 30, env.tail)
        assert len(env.done("stream-")) < total, "the stream was over before the connections were terminated"
        with admin_connection() as admin:
            killed.append(terminate_backends(admin, pg.schema))
    assert all(n >= 2 for n in killed), killed  # the workers' listeners at least, and some pool connections
    wait_for(lambda: len(env.done("stream-")) == total, 60, env.tail)
    wait_for(lambda: pg.messages_containing("stream-") == 0, 15, env.tail)
    # the workers still answer afterwards
    after = env.send("record", "after-restart")
    wait_for(lambda: env.results("after-restart"), 15, env.tail)
    wait_for(lambda: pg.row_of(after.id) is None, 10, env.tail)


def test_workers_reconnect_after_an_outage_longer_than_the_transaction_retries(env: Env) -> None:
    """The database refuses every connection until the worker gives up retrying its transactions and Celery itself
    reconnects (the connection error path); then it is back, and every task completes."""
    pg = postgres(env)
    from tests.integration.pg_fixtures import admin_connection, terminate_backends

    if pg.role is None:
        pytest.skip("the test user cannot create roles, so the database cannot be taken away from the workers")
    lost = b"Connection to broker lost"
    before = env.log(W1).read_bytes().count(lost)
    total = 20
    for n in range(total):
        env.send("hold", f"outage-{n}", 0.1)
    with admin_connection() as admin:
        admin.execute(f'ALTER ROLE "{pg.role}" NOLOGIN')  # new connections are refused ...
        try:
            terminate_backends(admin, pg.schema)  # ... and the existing ones go
            wait_for(lambda: env.log(W1).read_bytes().count(lost) > before, 45, env.tail)
        finally:
            admin.execute(f'ALTER ROLE "{pg.role}" LOGIN')
    wait_for(lambda: len(env.done("outage-")) == total, 60, env.tail)
    after = env.send("record", "after-outage")
    wait_for(lambda: env.results("after-outage"), 30, env.tail)
    wait_for(lambda: pg.row_of(after.id) is None, 10, env.tail)
