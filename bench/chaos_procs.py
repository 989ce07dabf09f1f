"""The processes ``python -m bench.chaos`` drives: Celery workers in process groups of their own (started, SIGKILLed,
sent SIGTERM and timed), and the PostgreSQL it restarts (a private throwaway cluster, or a schema on a shared server)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
APP = "bench.chaos_app"


def log(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def group_alive(pgid: int) -> bool:
    """Whether any process is left in process group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def group_members(pgid: int) -> list[int]:
    """Pids of the processes of group ``pgid`` (from /proc; zombies included)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after the command: state, ppid, pgrp, ...
            out.append(int(entry.name))
    return sorted(out)


def dump_stacks(pids: Sequence[int], out: Path) -> bool:
    """Append ``py-spy dump`` of each pid to ``out``; False when py-spy is not installed."""
    spy = shutil.which("py-spy")
    if spy is None:
        return False
    with out.open("a") as f:
        for pid in pids:
            f.write(f"===== py-spy dump --pid {pid} ({time.strftime('%H:%M:%S')})\n")
            f.flush()
            try:
                done = subprocess.run(
                    [spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30, check=False
                )
                f.write(done.stdout + done.stderr + "\n")
            except subprocess.TimeoutExpired:
                f.write("(py-spy timed out)\n")
    return True


# -- workers -----------------------------------------------------------------------------------------------------------


class Worker:
    """A ``celery -A bench.chaos_app worker`` subprocess in a process group of its own."""

    def __init__(
        self, name: str, env: dict[str, str], logdir: Path, concurrency: int = 2, kind: str = "celery"
    ) -> None:
        self.name = name
        self.kind = kind  # "celery", or "lambda": bench.chaos_lambda (an SQS event source mapping and its function)
        self.log = logdir / f"worker-{name}.log"
        self._log_file = self.log.open("ab")
        self.started = time.monotonic()
        celery = ["-m", "celery", "-A", APP, "worker", "-c", str(concurrency), "--loglevel=INFO"]
        command = (
            ["-m", "bench.chaos_lambda"] if kind == "lambda" else [*celery, "--without-heartbeat", "-n", f"{name}@%h"]
        )
        self.proc = subprocess.Popen(
            [sys.executable, *command],
            cwd=ROOT,
            env={**os.environ, **env, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pgid(self) -> int:
        return self.proc.pid  # start_new_session: the main process leads its group

    def wait_ready(self, timeout: float = 60.0) -> bool:
        """Wait for Celery's ``ready.`` line; False when the worker exited or ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        while b"ready." not in self.log.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def kill(self) -> None:
        """SIGKILL the whole process group: the main process and its pool children."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self._log_file.close()

    def terminate(self, target: str) -> None:
        """SIGTERM to the process group (``target="group"``: main process and pool children alike, as
        ``kill -TERM -PGID`` or a terminal's Ctrl-C-like broadcast does) or to the main process only (``"main"``)."""
        with contextlib.suppress(ProcessLookupError):
            if target == "group":
                os.killpg(self.pgid, signal.SIGTERM)
            else:
                self.proc.send_signal(signal.SIGTERM)

    def close(self) -> None:
        self._log_file.close()


@dataclass
class Stop:
    """How a worker stopped after SIGTERM: seconds until its main process exited (None: not within the wait), until
    its whole process group was gone, and its exit code."""

    name: str
    uptime: float
    main_exit: float | None
    group_exit: float | None
    returncode: int | None


def stop_workers(workers: Sequence[Worker], target: str, wait: float, logdir: Path) -> list[Stop]:
    """SIGTERM every worker at once and time each one's exit; dump the stacks of those left after ``wait`` seconds
    and SIGKILL them."""
    t0 = time.monotonic()
    uptimes = {w.name: t0 - w.started for w in workers}
    for w in workers:
        w.terminate(target)
    main_exit: dict[str, float] = {}
    group_exit: dict[str, float] = {}
    while time.monotonic() - t0 < wait and len(group_exit) < len(workers):
        now = time.monotonic() - t0
        for w in workers:
            if w.name not in main_exit and w.proc.poll() is not None:
                main_exit[w.name] = now
            if w.name not in group_exit and w.name in main_exit and not group_alive(w.pgid):
                group_exit[w.name] = now
        time.sleep(0.05)
    stuck = [w for w in workers if w.name not in group_exit]
    if stuck:
        dumps = logdir / "stuck-stacks.txt"
        pids = [pid for w in stuck for pid in group_members(w.pgid)]
        log(f"{len(stuck)} worker(s) still there {wait:.0f} s after SIGTERM: pids {pids}")
        if dump_stacks(pids, dumps):
            log(f"their stacks: {dumps}")
        for w in stuck:
            w.kill()
    for w in workers:
        w.close()
    return [
        Stop(w.name, uptimes[w.name], main_exit.get(w.name), group_exit.get(w.name), w.proc.returncode) for w in workers
    ]


# -- the database ------------------------------------------------------------------------------------------------------


def pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for candidate in sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), reverse=True):
        return str(candidate)
    return None


class PrivateCluster:
    """A throwaway PostgreSQL cluster: ``initdb`` into a temporary folder (as the ``postgres`` OS user when this runs
    as root: initdb refuses root), listening on 127.0.0.1 at a free port, removed afterwards."""

    kind = "private cluster (pg_ctl restart -m immediate)"

    def __init__(self, mode: str = "immediate") -> None:
        self.mode = mode
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="cw-chaos-pg-"))
        self.data = self.dir / "data"
        self.logfile = self.dir / "postgres.log"
        initdb, pg_ctl = pg_bin("initdb"), pg_bin("pg_ctl")
        if initdb is None or pg_ctl is None:
            raise RuntimeError("initdb / pg_ctl not found")
        self.pg_ctl = pg_ctl
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
            self.as_user = ["runuser", "-u", "postgres", "--"]
        self._run([initdb, "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"])
        self._ctl("start", "-w", "-t", "60", "-l", str(self.logfile), "-o", self._options())
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _options(self) -> str:
        return (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.dir} -c max_connections=200"
            " -c shared_buffers=32MB -c log_min_messages=warning"
        )

    def _run(self, argv: list[str]) -> None:
        done = subprocess.run([*self.as_user, *argv], capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:2])} failed: {done.stdout}{done.stderr}")

    def _ctl(self, *args: str) -> None:
        self._run([self.pg_ctl, "-D", str(self.data), *args])

    def restart(self) -> None:
        self._ctl("restart", "-m", self.mode, "-w", "-t", "60", "-l", str(self.logfile), "-o", self._options())

    def close(self, keep: bool = False) -> None:
        """Stop the server; remove its folder unless ``keep`` (then say how to look at it)."""
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self._ctl("stop", "-m", "fast", "-w", "-t", "30")
        if keep:
            log(
                f"cluster kept for a post-mortem: {' '.join(self.as_user)} {self.pg_ctl} -D {self.data}"
                f" -o '{self._options()}' start; psql -h 127.0.0.1 -p {self.port} -U postgres"
            )
        else:
            shutil.rmtree(self.dir, ignore_errors=True)


class SharedSchema:
    """Fallback when no private cluster can be made: a fresh schema on the shared server at ``DATABASE_URL``; a
    "restart" terminates every connection of the schema (``pg_terminate_backend``), never the server itself."""

    kind = "shared server, fresh schema (pg_terminate_backend of the schema's connections)"

    def __init__(self, database_url: str) -> None:
        from urllib.parse import quote

        import psycopg

        self._psycopg = psycopg
        self.admin_url = database_url
        self.schema = f"cw_chaos_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f'CREATE SCHEMA "{self.schema}"')
        sep = "&" if "?" in database_url else "?"
        options = quote(f"-csearch_path={self.schema}", safe="")
        self.url = f"{database_url}{sep}options={options}&application_name={self.schema}"

    def restart(self) -> None:
        with self._psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name = %s AND pid <> pg_backend_pid()",
                (self.schema,),
            )

    def close(self, keep: bool = False) -> None:
        """Drop the schema unless ``keep``."""
        self.restart()
        if keep:
            log(f"schema {self.schema} kept for a post-mortem")
            return
        with self._psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')


class Emulator:
    """The project's moto server (``python -m celery_workflow.testing.moto_server``) in a process of its own (not
    this one: the driver's client threads would share its interpreter lock), with the AWS World's table and task queue
    provisioned on it. ``env`` is the workers' and the client's environment (``aws://``)."""

    def __init__(self, logdir: Path, visibility_timeout: int, *, undo_log: bool = True) -> None:
        # undo_log: bench.moto_undo in the server, so that a transaction costs what its items do, not a copy of the
        # whole table per action (0.5 s a transaction at a thousand items: the chaos would measure moto)
        self.kind = "moto server, DynamoDB serialised" + (", transactions with an undo log" if undo_log else "")
        server = "from celery_workflow.testing.moto_server import main; raise SystemExit(main(['--port', '0']))"
        if undo_log:
            server = "from bench.moto_undo import install; install(); " + server
        self._log = (logdir / "moto.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", server],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            start_new_session=True,
        )
        try:
            assert self.proc.stdout is not None
            exports = [self.proc.stdout.readline().split(" ", 1)[1].strip() for _ in range(4)]
            emulator = dict(line.split("=", 1) for line in exports)
            import boto3

            from celery_workflow._aws.provision import provision

            def client(service: str) -> object:
                return boto3.session.Session().client(
                    service,
                    endpoint_url=emulator["AWS_ENDPOINT_URL"],
                    region_name=emulator["AWS_DEFAULT_REGION"],
                    aws_access_key_id=emulator["AWS_ACCESS_KEY_ID"],
                    aws_secret_access_key=emulator["AWS_SECRET_ACCESS_KEY"],
                )

            world = provision(
                "chaos", {}, dynamodb=client("dynamodb"), sqs=client("sqs"), visibility_timeout=visibility_timeout
            )
        except BaseException:
            self.close()
            raise
        self.env = {**emulator, **world, "CELERY_WORKFLOW_URL": "aws://"}

    def close(self, keep: bool = False) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()
