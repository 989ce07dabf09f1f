"""``python -m bench --scenario sleepers``: many runs asleep at once (issue #13, scenario 2).

``--runs`` runs (default 100,000) each sleep until a random time within a ``--window`` (default 600 s) that opens
once every run has been started and has gone to sleep, on the Postgres and on the SQLite World, against one real
``celery worker -c 2`` (prefork). Reported per World:

* the start rate (client threads starting runs while the worker takes each run's first delivery);
* how late each run woke: the seconds between its due time and the write of its ``wait_completed`` (the workflow
  returns it), p50/p99/max over all runs;
* deliveries leased while the runs sleep (sampled every 5 s): a sleeping run holds no worker slot, only a queue row;
* resident memory of the worker (main process and pool children) and of the client over the whole scenario.
"""

from __future__ import annotations

import argparse
import os
import random
import sqlite3
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench.procmem import Sampler


@dataclass
class Outcome:
    world: str
    runs: int
    start_rate: float = 0.0
    setup_s: float = 0.0
    lateness: list[float] = field(default_factory=list)
    leased_max: int = 0
    sleeping_max: int = 0
    unfinished: int = 0
    worker_memory: str = ""
    client_memory: str = ""

    def pct(self, q: float) -> float:
        data = sorted(self.lateness)
        return data[min(len(data) - 1, int(q * len(data)))] if data else float("nan")


@contextmanager
def world_url(kind: str, database_url: str) -> Iterator[str]:
    if kind == "sqlite":
        with tempfile.TemporaryDirectory(prefix="cw-sleepers-") as tmp:
            yield f"sqlite:///{Path(tmp) / 'world.sqlite3'}"
        return
    from bench.__main__ import scratch_schema, with_search_path

    with scratch_schema(database_url) as schema:
        yield with_search_path(database_url, schema)


class QueueCounts:
    """(leased, sleeping) delivery rows of the World's queue table, read with a connection of its own."""

    def __init__(self, url: str) -> None:
        self.url = url

    def __call__(self) -> tuple[int, int]:
        if self.url.startswith("sqlite:"):
            path = self.url.split("sqlite:///", 1)[1]
            conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
            try:
                now = int(time.time() * 1_000_000)
                row = conn.execute(
                    "SELECT count(*) FILTER (WHERE lease_until IS NOT NULL),"
                    " count(*) FILTER (WHERE lease_until IS NULL AND not_before > ?) FROM celery_workflow_queue",
                    (now,),
                ).fetchone()
            finally:
                conn.close()
            return int(row[0]), int(row[1])
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FILTER (WHERE lease_until IS NOT NULL),"
                " count(*) FILTER (WHERE lease_until IS NULL AND not_before > now()) FROM celery_workflow_queue"
            ).fetchone()
        assert row is not None
        return int(row[0]), int(row[1])


def start_runs(nap: object, dues: Sequence[float], threads: int) -> float:
    """Start one run per due time from ``threads`` client threads; return the runs started per second."""
    chunks = [dues[i::threads] for i in range(threads)]
    errors: list[BaseException] = []

    def client(part: Sequence[float]) -> None:
        try:
            for due in part:
                nap.start(due)  # type: ignore[attr-defined]
        except BaseException as exc:
            errors.append(exc)

    began = time.monotonic()
    pool = [threading.Thread(target=client, args=(c,)) for c in chunks]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise errors[0]
    return len(dues) / (time.monotonic() - began)


def measure(kind: str, args: argparse.Namespace, margin: float, logdir: Path) -> Outcome:
    from bench.__main__ import worker

    runs, window, threads = args.runs, args.window, args.threads
    out = Outcome(kind, runs)
    with world_url(kind, args.database_url) as url:
        os.environ["CELERY_WORKFLOW_URL"] = url
        import importlib

        import bench.sleep_app as app

        app = importlib.reload(app)  # bound to this World
        counts = QueueCounts(url)
        with worker(
            "bench.sleep_app", {"CELERY_WORKFLOW_URL": url}, "prefork", logdir / f"sleep-{kind}.log", 2
        ) as proc:
            sampler = Sampler({"worker": proc.pid, "client": os.getpid()}).start()
            app.nap.start(time.time()).result(timeout=120)  # the worker is up
            opens = time.time() + margin
            rng = random.Random(13)
            dues = [opens + rng.uniform(0, window) for _ in range(runs)]
            began = time.monotonic()
            out.start_rate = start_runs(app.nap, dues, threads)
            while True:  # until every run is asleep
                leased, sleeping = counts()
                if sleeping >= runs:
                    break
                if time.time() > opens:
                    print(f"{kind}: only {sleeping} of {runs} asleep when the window opened", file=sys.stderr)
                    break
                time.sleep(1)
            out.setup_s = time.monotonic() - began
            print(f"{kind}: {runs} runs asleep after {out.setup_s:.0f} s ({out.start_rate:.0f} starts/s)",
                  file=sys.stderr, flush=True)  # fmt: skip
            deadline = opens + window + 60
            while time.time() < deadline:
                leased, sleeping = counts()
                out.leased_max = max(out.leased_max, leased)
                out.sleeping_max = max(out.sleeping_max, sleeping)
                if sleeping == 0 and leased == 0 and time.time() > opens + window:
                    break
                time.sleep(5)
            sampler.stop()
            # from when every run is asleep (the window opening) to the end: flat if sleeping runs cost no memory
            out.worker_memory = sampler.summary("worker", settle=out.setup_s)
            out.client_memory = sampler.summary("client", settle=out.setup_s)
        world = app.wf.world
        cursor = None
        while True:
            page = world.list_runs(workflow=app.nap.name, status="completed", limit=1000, cursor=cursor)
            out.lateness += [float(r.output) for r in page.items]
            if page.cursor is None:
                break
            cursor = page.cursor
        out.lateness = out.lateness[: len(out.lateness)]
        out.unfinished = runs + 1 - len(out.lateness)
        app.wf.close()
    return out


def report(outcomes: Sequence[Outcome], window: float) -> str:
    lines = [
        f"runs asleep until a random time within a {window:.0f} s window; one `celery worker -c 2` (prefork)",
        "",
        "| World | runs | starts/s | all asleep after | wake lateness p50 | p99 | max | not woken |"
        " most leased while asleep | worker RSS from the window's opening | client RSS |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for o in outcomes:
        late = o.lateness or [float("nan")]
        lines.append(
            f"| {o.world} | {o.runs:,} | {o.start_rate:.0f} | {o.setup_s:.0f} s | {o.pct(0.5) * 1000:.0f} ms"
            f" | {o.pct(0.99) * 1000:.0f} ms | {max(late) * 1000:.0f} ms | {o.unfinished} | {o.leased_max}"
            f" of {o.sleeping_max:,} | {o.worker_memory} | {o.client_memory} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench --scenario sleepers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--world", action="append", choices=["postgres", "sqlite"], help="default: both")
    p.add_argument("--runs", type=int, default=100_000)
    p.add_argument("--window", type=float, default=600.0, help="seconds over which the runs fall due")
    p.add_argument("--margin", type=float, default=None, help="seconds before the window opens (default: runs/250+30)")
    p.add_argument("--threads", type=int, default=4, help="client threads starting runs")
    p.add_argument(
        "--database-url", default=os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    )
    args = p.parse_args(argv)
    margin = args.margin if args.margin is not None else args.runs / 250 + 30
    logdir = Path(tempfile.mkdtemp(prefix="cw-bench-sleepers-"))
    outcomes = []
    for kind in args.world or ["postgres", "sqlite"]:
        outcomes.append(measure(kind, args, margin, logdir))
    print(report(outcomes, args.window))
    print(f"(worker logs in {logdir})", file=sys.stderr)
    return 0
