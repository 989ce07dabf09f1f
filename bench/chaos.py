"""``python -m bench.chaos``: workflow runs on real Celery workers while workers are SIGKILLed (and, on Postgres, the
database server is restarted), then checks that nothing was lost or recorded twice and that workers stop in time.

What it does, on one World (``--world sqlite|postgres|aws``):

1. Starts ``--workers`` ``celery -A bench.chaos_app worker -c 2`` processes, each in its own process group, with a
   short transport lease (``--lease``, 2 s) so a killed worker's deliveries come back quickly.
2. Starts ``--runs`` runs of ``chaos_flow`` (``bench/chaos_app.py``) evenly over the first 70 % of ``--duration``
   (each: inline steps, a durable sleep, a hook, two parallel steps, another sleep) and resumes each run's hook from
   this process as soon as it exists. Step bodies log each execution, to count those that ran more than once.
3. Meanwhile a chaos thread SIGKILLs a random worker's whole process group every ``--kill-every`` seconds (±30 %) and
   starts a replacement; on Postgres another restarts the database server every ``--restart-every`` seconds
   (``pg_ctl restart -m immediate``, a crash and recovery) on a private throwaway cluster (``initdb`` into a temporary
   folder, as the ``postgres`` OS user when run as root, on a free port), never the shared server. Where no cluster
   can be made it falls back to a fresh schema on ``DATABASE_URL`` and ``pg_terminate_backend`` of the schema's
   connections instead, and says so. On AWS (``--world aws``: DynamoDB and SQS on the project's moto server, in a
   process of its own, DynamoDB requests serialised) the workers' boto3 calls meet injected faults (``--faults``,
   :mod:`bench.aws_faults`): transactions cancelled for ``TransactionConflict``, throttled requests, and received
   SQS messages sent again at once so that the same delivery is handled twice, concurrently. ``--lambdas N`` adds N
   Lambda pollers (:mod:`bench.chaos_lambda`: the Lambda queue handler on batches of the task queue, each invocation
   SIGKILLed at a short ``--lambda-deadline``) beside the Celery workers, killed like them.
4. After ``--duration`` seconds the chaos stops; it waits (at most ``--settle`` seconds) for every run to end, then
   checks: every run completed with the right output; each step has exactly one ``step_completed`` event; every event
   log has slots 1..n without gaps (n = the run's event count); no dead letters. Step bodies that ran more than once
   are counted (allowed: steps run at least once, are recorded exactly once).
5. Sends SIGTERM to every worker (to each process group, as ``kill -TERM -PGID`` does, or with ``--term main`` to the
   main processes only) and measures how long each takes to exit; each must be gone within ``--exit-limit`` (30 s).
   A worker still there after ``--exit-wait`` seconds gets its stacks dumped (``py-spy dump``, when installed) into
   the log folder, then SIGKILL.

It prints a table of figures and exits 1 if any check failed. Worker logs and stack dumps stay in the printed folder.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from bench.aws_faults import count_faults
from bench.chaos_procs import APP, Emulator, PrivateCluster, SharedSchema, Stop, Worker, log, stop_workers

DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
#: Runs are started evenly over this share of the chaos's duration (the rest lets the last ones finish under it).
START_SPREAD = 0.7


# -- the run -----------------------------------------------------------------------------------------------------------


@dataclass
class Config:
    world: str = "sqlite"
    runs: int = 12
    workers: int = 2
    concurrency: int = 2
    steps: int = 3
    nap: float = 1.0
    step_seconds: float = 0.15
    duration: float = 40.0
    kill_every: float = 4.0
    restart_every: float = 10.0
    restart_mode: str = "immediate"
    lease: float = 2.0
    settle: float = 180.0
    term: str = "group"
    exit_limit: float = 30.0
    exit_wait: float = 60.0
    database_url: str = field(default_factory=lambda: os.environ.get("DATABASE_URL", DEFAULT_DATABASE_URL))
    logdir: Path | None = None
    seed: int | None = None
    keep_failed: bool = True  # keep a private cluster (stopped) when a check failed
    faults: str = "conflict=0.2,throttle=0.03,dup=0.2"  # AWS: CW_AWS_FAULTS of the workers (bench.aws_faults)
    lambdas: int = 0  # AWS: Lambda pollers (bench.chaos_lambda) beside the Celery workers, killed alike
    lambda_deadline: float = 3.0  # AWS: each Lambda invocation's deadline, s


@dataclass
class Figures:
    world: str
    database: str
    runs: int
    term: str = "group"
    exit_wait: float = 60.0
    completed: int = 0
    steps: int = 0
    kills: int = 0
    restarts: int = 0
    lost: int = 0
    wrong_output: int = 0
    duplicated: int = 0
    gaps: int = 0
    executions: int = 0
    reexecuted: int = 0
    dead_letters: int = 0
    client_retries: int = 0
    injected: dict[str, int] = field(default_factory=dict)  # AWS: faults by kind (conflict, throttle, dup)
    stops: list[Stop] = field(default_factory=list)
    wall: float = 0.0
    failures: list[str] = field(default_factory=list)
    logdir: Path = Path()

    def exits(self) -> str:
        """``max / median`` seconds from SIGTERM to the main process's exit; a worker that did not exit within the
        wait counts as ``> wait``."""
        if not self.stops:
            return "-"
        times = sorted(s.main_exit if s.main_exit is not None else math.inf for s in self.stops)
        hung = sum(1 for t in times if t == math.inf)

        def show(t: float) -> str:
            return f"> {self.exit_wait:.0f}" if t == math.inf else f"{t:.1f}"

        out = f"{show(times[-1])} / {show(statistics.median_low(times))}"
        return out + (f" ({hung} of {len(times)} did not exit)" if hung else "")

    def _injected(self, *kinds: str) -> str:
        return " / ".join(str(self.injected.get(k, 0)) for k in kinds)

    def table(self) -> str:
        rows = [
            ("World", f"{self.world} ({self.database})"),
            ("runs (completed)", f"{self.runs} ({self.completed})"),
            ("steps completed", str(self.steps)),
            ("kills (SIGKILL of a worker's process group)", str(self.kills)),
            ("database restarts", str(self.restarts)),
            ("lost (runs not completed)", str(self.lost)),
            ("wrong outputs", str(self.wrong_output)),
            ("duplicated (steps completed twice)", str(self.duplicated)),
            ("event logs with gaps", str(self.gaps)),
            ("step bodies run (re-executed)", f"{self.executions} ({self.reexecuted})"),
            ("dead letters", str(self.dead_letters)),
            ("client calls retried", str(self.client_retries)),
            *(
                [
                    ("injected: conflicts / throttles / SQS duplicates", self._injected("conflict", "throttle", "dup")),
                    ("Lambda invocations timed out / crashed", self._injected("timeout", "crash")),
                ]
                if self.injected
                else []
            ),
            (f"worker exit after SIGTERM to the {self.term}, max / median s", self.exits()),
            ("wall time s", f"{self.wall:.0f}"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
        lines += [
            f"  worker {s.name}: up {s.uptime:.0f} s, exit "
            + ("none (killed)" if s.main_exit is None else f"{s.main_exit:.1f} s, code {s.returncode}")
            for s in self.stops
        ]
        return "\n".join(lines)


@contextlib.contextmanager
def chaos_app(env: dict[str, str]) -> Iterator[ModuleType]:
    """``bench.chaos_app`` imported in this process (the client side) bound to ``env``; its ``wf`` closed after."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    sys.modules.pop(APP, None)
    try:
        module = importlib.import_module(APP)
        try:
            yield module
        finally:
            module.wf.close()
    finally:
        sys.modules.pop(APP, None)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def retrying(what: str, fn: Callable[[], Any], stop: threading.Event, errors: Counter[str], pause: float = 0.2) -> Any:
    """``fn()``, retried while it raises (the database may be restarting), until ``stop`` is set."""
    while True:
        try:
            return fn()
        except Exception as exc:
            errors[f"{what}: {type(exc).__name__}"] += 1
            if stop.wait(pause):
                raise


class Chaos:
    """The threads that start runs, resume hooks, kill workers and restart the database while a chaos run lasts."""

    def __init__(self, cfg: Config, app: ModuleType, env: dict[str, str], logdir: Path, database: Any) -> None:
        self.cfg = cfg
        self.app = app
        self.env = env
        self.worker_env = {**env, "CW_AWS_FAULTS": cfg.faults} if cfg.world == "aws" and cfg.faults else env
        self.worker_env = {**self.worker_env, "CW_LAMBDA_DEADLINE": str(cfg.lambda_deadline)}
        self.logdir = logdir
        self.database = database
        self.rng = random.Random(cfg.seed)
        self.workers: list[Worker] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()  # ends the chaos (kills, restarts)
        self.done = threading.Event()  # ends the client threads (starts, hook resumes)
        self.kills = 0
        self.restarts = 0
        self.errors: Counter[str] = Counter()
        self.started: set[int] = set()  # runs whose start was accepted (guarded by lock)
        self.resumed: set[int] = set()
        self._serial = 0

    def run_id(self, i: int) -> str:
        return f"chaos-{i}"

    def spawn(self, kind: str = "celery") -> Worker:
        with self.lock:
            self._serial += 1
            name = f"chaos{self._serial}" if kind == "celery" else f"lambda{self._serial}"
        worker = Worker(name, self.worker_env, self.logdir, self.cfg.concurrency, kind)
        if not worker.wait_ready():
            log(f"worker {worker.name} not ready (see {worker.log})")
        with self.lock:
            self.workers.append(worker)
        return worker

    def start_runs(self) -> None:
        spread = self.cfg.duration * START_SPREAD
        t0 = time.monotonic()
        for i in range(self.cfg.runs):
            due = t0 + spread * i / max(self.cfg.runs, 1)
            if self.done.wait(max(0.0, due - time.monotonic())):
                return

            def start(i: int = i) -> Any:
                return self.app.chaos_flow.start(i, self.cfg.steps, self.cfg.nap, run_id=self.run_id(i))

            with contextlib.suppress(Exception):
                retrying("start", start, self.done, self.errors)
                with self.lock:
                    self.started.add(i)

    def resume_hooks(self) -> None:
        from celery_workflow.errors import HookNotFound

        unsure: set[int] = set()  # a resume whose answer was lost: look at the log before trying again
        while not self.done.wait(0.25):
            with self.lock:
                waiting = sorted(self.started - self.resumed)
            for i in waiting:
                if self.done.is_set():
                    return
                try:
                    if i in unsure:
                        events = self.app.wf.world.list_events(self.run_id(i))
                        if any(e.event_type.value == "hook_received" for e in events):
                            self.resumed.add(i)
                            continue
                    self.app.wf.resume_hook(self.app.hook_token(i), {"v": i * 7})
                    self.resumed.add(i)
                except HookNotFound:
                    pass  # not created yet
                except Exception as exc:
                    unsure.add(i)
                    self.errors[f"resume: {type(exc).__name__}"] += 1

    def kill_workers(self) -> None:
        while not self.stop.wait(self.cfg.kill_every * self.rng.uniform(0.7, 1.3)):
            with self.lock:
                alive = [w for w in self.workers if w.proc.poll() is None]
            if not alive:
                continue
            victim = self.rng.choice(alive)
            victim.kill()
            with self.lock:
                self.workers.remove(victim)
                self.kills += 1
            self.spawn(victim.kind)

    def restart_database(self) -> None:
        while not self.stop.wait(self.cfg.restart_every * self.rng.uniform(0.7, 1.3)):
            try:
                self.database.restart()
                self.restarts += 1
            except Exception as exc:
                log(f"database restart failed: {exc}")
                self.errors[f"restart: {type(exc).__name__}"] += 1


def run_chaos(cfg: Config) -> Figures:
    """One chaos run on ``cfg.world``; the figures, with ``failures`` naming every check that failed."""
    t_start = time.monotonic()
    logdir = cfg.logdir or Path(tempfile.mkdtemp(prefix=f"cw-chaos-{cfg.world}-"))
    logdir.mkdir(parents=True, exist_ok=True)
    markers = logdir / "markers"
    markers.mkdir(exist_ok=True)
    figures = Figures(
        world=cfg.world, database="", runs=cfg.runs, term=cfg.term, exit_wait=cfg.exit_wait, logdir=logdir
    )
    with contextlib.ExitStack() as stack:
        database: Any = None
        if cfg.world == "sqlite":
            url = f"sqlite:///{logdir / 'world.sqlite3'}"
            kind = "SQLite file"
        elif cfg.world == "postgres":
            try:
                database = PrivateCluster(cfg.restart_mode)
            except (RuntimeError, OSError, subprocess.TimeoutExpired, LookupError) as exc:
                log(f"no private Postgres cluster ({exc}); falling back to a schema on {cfg.database_url}")
                database = SharedSchema(cfg.database_url)
            stack.callback(lambda: database.close(keep=bool(figures.failures) and cfg.keep_failed))
            url, kind = database.url, database.kind
        elif cfg.world == "aws":
            emulator = Emulator(logdir, visibility_timeout=max(1, math.ceil(cfg.lease)))
            stack.callback(emulator.close)
            url, kind = "aws://", emulator.kind
        else:
            raise ValueError(f"unknown World {cfg.world!r}")
        env = {
            **(emulator.env if cfg.world == "aws" else {}),
            "CELERY_WORKFLOW_URL": url,
            "CW_LEASE": str(cfg.lease),
            "CW_CHAOS_DIR": str(markers),
            "CW_CHAOS_STEP_SECONDS": str(cfg.step_seconds),
        }
        figures.database = kind
        log(f"{cfg.world}: {kind}; logs in {logdir}")
        app = stack.enter_context(chaos_app(env))
        chaos = Chaos(cfg, app, env, logdir, database)
        try:
            kinds = ["celery"] * cfg.workers + (["lambda"] * cfg.lambdas if cfg.world == "aws" else [])
            spawning = [threading.Thread(target=chaos.spawn, args=(k,), name="chaos-spawn") for k in kinds]
            for t in spawning:  # side by side: each takes seconds to get ready
                t.start()
            for t in spawning:
                t.join()
            threads = [
                threading.Thread(target=chaos.start_runs, name="chaos-starts", daemon=True),
                threading.Thread(target=chaos.resume_hooks, name="chaos-hooks", daemon=True),
                threading.Thread(target=chaos.kill_workers, name="chaos-kills", daemon=True),
            ]
            if database is not None and cfg.restart_every > 0:
                threads.append(threading.Thread(target=chaos.restart_database, name="chaos-restarts", daemon=True))
            for t in threads:
                t.start()
            chaos.stop.wait(cfg.duration)
            chaos.stop.set()
            for t in threads[2:]:
                t.join()
            log(f"chaos over: {chaos.kills} kills, {chaos.restarts} restarts; waiting for the runs")
            settle_runs(app, chaos, cfg.settle)
            chaos.done.set()
            for t in threads[:2]:
                t.join()
            figures.kills, figures.restarts = chaos.kills, chaos.restarts
            verify(app, cfg, chaos, markers, figures)
            if cfg.world == "aws":
                figures.injected = count_faults(markers / "faults.log")
        finally:
            chaos.stop.set()
            chaos.done.set()
            with chaos.lock:
                workers = [w for w in chaos.workers if w.proc.poll() is None]
            figures.stops = stop_workers(workers, cfg.term, cfg.exit_wait, logdir)
        for s in figures.stops:
            if s.main_exit is None or s.main_exit >= cfg.exit_limit:
                took = "did not exit" if s.main_exit is None else f"took {s.main_exit:.1f} s"
                figures.failures.append(
                    f"worker {s.name} (up {s.uptime:.0f} s) {took} after SIGTERM to its {cfg.term} (limit {cfg.exit_limit:.0f} s)"
                )
        figures.client_retries = sum(chaos.errors.values())
        if chaos.errors:
            log(f"client calls retried: {dict(chaos.errors)}")
    figures.wall = time.monotonic() - t_start
    return figures


def settle_runs(app: ModuleType, chaos: Chaos, timeout: float) -> None:
    """Wait until every started run has ended (or ``timeout`` passes), resuming hooks meanwhile."""
    deadline = time.monotonic() + timeout
    pending = set(range(chaos.cfg.runs))
    while pending and time.monotonic() < deadline:
        for i in sorted(pending):
            try:
                if app.wf.world.get_run(chaos.run_id(i)).status.terminal:
                    pending.discard(i)
            except Exception as exc:
                chaos.errors[f"settle: {type(exc).__name__}"] += 1
        if pending:
            time.sleep(0.25)
    if pending:
        log(f"{len(pending)} run(s) not ended after {timeout:.0f} s: {sorted(pending)[:10]}")
    else:
        log(f"every run ended {timeout - (deadline - time.monotonic()):.1f} s after the chaos")


def describe_run(world: Any, run_id: str) -> str:
    """The end of a run's log, its waits and hooks, and its queued deliveries: what a run that did not end waits for."""
    parts = []
    try:
        events = world.list_events(run_id)
        parts.append(
            "last events " + ", ".join(f"{e.slot}:{e.event_type.value}:{e.correlation_id}" for e in events[-6:])
        )
        parts.append(
            "waits "
            + ", ".join(f"{w.wait_id}:{w.status.value}@{w.resume_at:%H:%M:%S}" for w in world.list_waits(run_id))
        )
        parts.append("hooks " + ", ".join(h.token for h in world.list_hooks(run_id)))
        queued = [m for m in world.store.peek() if m.run_id == run_id]
        parts.append(
            "queued "
            + ", ".join(
                f"#{m.id} {m.idempotency_key} attempts {m.attempts} due {m.not_before} lease {m.lease_until}"
                for m in queued
            )
        )
    except Exception as exc:
        parts.append(f"({type(exc).__name__}: {exc})")
    return "; ".join(parts)


def verify(app: ModuleType, cfg: Config, chaos: Chaos, markers: Path, figures: Figures) -> None:
    """Fill in the figures from the World's logs and the step bodies' execution log."""
    from celery_workflow.dead_letters import dead_letter_store

    world = app.wf.world
    completed_steps: set[str] = set()
    for i in range(cfg.runs):
        run_id = chaos.run_id(i)
        try:
            view = world.get_run(run_id)
            events = world.list_events(run_id)
        except Exception as exc:
            figures.lost += 1
            figures.failures.append(f"{run_id}: cannot read ({type(exc).__name__}: {exc})")
            continue
        if view.status.value != "completed":
            figures.lost += 1
            figures.failures.append(f"{run_id}: {view.status.value} {view.error or ''}; {describe_run(world, run_id)}")
        else:
            figures.completed += 1
            if view.output != app.expected_output(i, cfg.steps):
                figures.wrong_output += 1
                figures.failures.append(f"{run_id}: output {view.output!r}")
        slots = [e.slot for e in events]
        if slots != list(range(1, len(slots) + 1)) or len(slots) != view.event_count:
            figures.gaps += 1
            figures.failures.append(f"{run_id}: event slots {slots} (event count {view.event_count})")
        per_step = Counter(str(e.correlation_id) for e in events if e.event_type.value == "step_completed")
        if view.status.value == "completed" and len(per_step) != cfg.steps + app.PARALLEL:
            figures.failures.append(f"{run_id}: {len(per_step)} steps completed, {cfg.steps + app.PARALLEL} expected")
        figures.steps += len(per_step)
        completed_steps.update(f"{run_id} {step}" for step in per_step)
        for step, n in per_step.items():
            if n > 1:
                figures.duplicated += 1
                figures.failures.append(f"{run_id}: step {step} completed {n} times")
    executions: Counter[str] = Counter()
    log_file = markers / "executions.log"
    if log_file.exists():
        for line in log_file.read_text().splitlines():
            run_id, step_id, *_ = line.split()
            executions[f"{run_id} {step_id}"] += 1
    figures.executions = sum(executions.values())
    figures.reexecuted = sum(n - 1 for n in executions.values() if n > 1)
    never_ran = completed_steps - set(executions)
    if never_ran:
        figures.failures.append(f"{len(never_ran)} completed steps have no recorded execution: {sorted(never_ran)[:5]}")
    letters = dead_letter_store(world).list_dead_letters(limit=1000)
    figures.dead_letters = len(letters)
    for letter in letters[:10]:
        figures.failures.append(f"dead letter {letter.id}: {letter.describe()}")


def parse_args(argv: Sequence[str] | None = None) -> tuple[Config, list[str]]:
    p = argparse.ArgumentParser(
        prog="python -m bench.chaos", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--world",
        action="append",
        choices=["sqlite", "postgres", "aws"],
        help="repeat for several (default: sqlite and postgres)",
    )
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=2, help="prefork processes per worker (-c)")
    p.add_argument("--steps", type=int, default=3, help="inline steps per run (plus 2 parallel ones)")
    p.add_argument("--nap", type=float, default=1.0, help="each of the run's two durable sleeps, s")
    p.add_argument("--step-seconds", type=float, default=0.15, help="how long each step body works, s")
    p.add_argument("--duration", type=float, default=180.0, help="how long the chaos lasts, s")
    p.add_argument("--kill-every", type=float, default=4.0, help="mean seconds between SIGKILLs of a worker")
    p.add_argument(
        "--restart-every", type=float, default=15.0, help="Postgres: mean seconds between restarts (0: none)"
    )
    p.add_argument("--restart-mode", default="immediate", choices=["immediate", "fast"])
    p.add_argument("--lease", type=float, default=2.0, help="transport lease, s")
    p.add_argument("--settle", type=float, default=300.0, help="longest wait for the runs after the chaos, s")
    p.add_argument("--term", default="group", choices=["group", "main"], help="SIGTERM the process group or main only")
    p.add_argument("--exit-limit", type=float, default=30.0, help="a worker must exit this soon after SIGTERM, s")
    p.add_argument("--exit-wait", type=float, default=60.0, help="how long to wait before dumping stacks, s")
    p.add_argument("--database-url", default=os.environ.get("DATABASE_URL", DEFAULT_DATABASE_URL))
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--faults", default=Config.faults, help="AWS: faults injected into the workers' boto3 calls (bench.aws_faults)"
    )
    p.add_argument("--lambdas", type=int, default=0, help="AWS: Lambda pollers beside the workers (bench.chaos_lambda)")
    p.add_argument("--lambda-deadline", type=float, default=3.0, help="AWS: each Lambda invocation's deadline, s")
    args = p.parse_args(argv)
    cfg = Config(
        runs=args.runs,
        workers=args.workers,
        concurrency=args.concurrency,
        steps=args.steps,
        nap=args.nap,
        step_seconds=args.step_seconds,
        duration=args.duration,
        kill_every=args.kill_every,
        restart_every=args.restart_every,
        restart_mode=args.restart_mode,
        lease=args.lease,
        settle=args.settle,
        term=args.term,
        exit_limit=args.exit_limit,
        exit_wait=args.exit_wait,
        database_url=args.database_url,
        seed=args.seed,
        faults=args.faults,
        lambdas=args.lambdas,
        lambda_deadline=args.lambda_deadline,
    )
    return cfg, args.world or ["sqlite", "postgres"]


def main(argv: Sequence[str] | None = None) -> int:
    cfg, worlds = parse_args(argv)
    results = []
    for world in worlds:
        cfg.world = world
        cfg.logdir = None
        try:
            figures = run_chaos(cfg)
        except Exception:
            traceback.print_exc()
            return 2
        results.append(figures)
        print(f"\n## {world}\n\n{figures.table()}\n\n(logs: {figures.logdir})", flush=True)
        for failure in figures.failures[:30]:
            print(f"FAILED: {failure}", flush=True)
    return 1 if any(f.failures for f in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
