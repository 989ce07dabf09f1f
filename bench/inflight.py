"""``python -m bench --scenario inflight``: many runs in flight at once (issue #13, scenario 1).

For each level of concurrency (default 8, 32 and 128), that many client threads each start a 10-step no-op workflow
and wait for its result, again and again, for ``--seconds`` after a short warm-up. Measured one after another on the
same machine and the same Postgres:

* **celery_workflow** on the Postgres World, against one ``celery worker -c 2`` (prefork) and against two such
  workers (two machines' worth of processes on this one);
* **DBOS Transact** with the same number of concurrent workflows, in its own process, on its own database;
* **a plain Celery chain** on Redis (not durable) with the same window of chains in flight, against ``-c 2``.

Per system and level: steps/s (steps of the runs that ended in the measured window ÷ the window), p50/p99
start-to-result latency of those runs, and Postgres commits per step over the whole level (warm-up and idle polls
included, so a little high at low rates).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from bench.__main__ import ROOT, scratch_database, scratch_schema, with_search_path, worker
from bench.pgstats import Counters, settled
from bench.procmem import Sampler

LEVELS = (8, 32, 128)
STEPS = 10


@dataclass
class Level:
    system: str
    clients: int
    window: float
    latencies: list[float] = field(default_factory=list)
    runs_total: int = 0  # every run that ended during the level, warm-up included (for commits per step)
    counters: Counters | None = None
    errors: int = 0
    memory: str = "-"  # worker process trees' and the client's RSS over the level (bench.procmem.Sampler)

    @property
    def steps_per_s(self) -> float:
        return STEPS * len(self.latencies) / self.window if self.window else float("nan")

    def pct(self, q: float) -> float:
        data = sorted(self.latencies)
        return data[min(len(data) - 1, int(q * len(data)))] * 1000 if data else float("nan")

    def commits_per_step(self) -> str:
        if self.counters is None or not self.runs_total:
            return "-"
        return f"{self.counters.commits / (self.runs_total * STEPS):.2f}"


def drive(
    one: Callable[[], object], clients: int, seconds: float, warmup: float, name: str
) -> tuple[list[float], int, int]:
    """``clients`` threads calling ``one()`` back to back for ``warmup + seconds``; the latencies of the calls that
    ended in the measured window, how many calls ended in all, and how many raised."""
    start = time.monotonic()
    measure_from, stop_at = start + warmup, start + warmup + seconds
    latencies: list[float] = []
    ended = [0, 0]
    lock = threading.Lock()

    def client() -> None:
        while time.monotonic() < stop_at:
            t0 = time.monotonic()
            try:
                one()
            except Exception as exc:  # counted and shown: a benchmark must not hide failures
                with lock:
                    ended[1] += 1
                    if ended[1] <= 3:
                        print(f"{name}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                continue
            t1 = time.monotonic()
            with lock:
                ended[0] += 1
                if measure_from <= t1 <= stop_at and t0 >= measure_from:
                    latencies.append(t1 - t0)

    threads = [threading.Thread(target=client, name=f"client-{i}", daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies, ended[0], ended[1]


def bench_celery_workflow(
    url: str, levels: Sequence[int], seconds: float, warmup: float, *, workers: int, logdir: Path
) -> list[Level]:
    env = {"CELERY_WORKFLOW_URL": url, "CW_DURABILITY": "delivery"}
    os.environ.update(env)
    from bench import cw_app

    name = f"celery_workflow, {workers} worker{'s' if workers > 1 else ''} -c 2"
    out = []
    with ExitStack() as stack:
        procs = [
            stack.enter_context(worker("bench.cw_app", env, "prefork", logdir / f"cw-{workers}-{w}.log", concurrency=2))
            for w in range(workers)
        ]
        cw_app.ten_steps.start().result(timeout=120)  # the workers are up
        for clients in levels:
            before = settled(url)
            roots = {f"worker {i + 1}": p.pid for i, p in enumerate(procs)}
            sampler = Sampler({**roots, "client": os.getpid()}).start()
            latencies, total, errors = drive(
                lambda: cw_app.ten_steps.start().result(timeout=300), clients, seconds, warmup, name
            )
            sampler.stop()
            level = Level(name, clients, seconds, latencies, total, settled(url) - before, errors)
            level.memory = "; ".join(f"{k}: {sampler.summary(k, settle=warmup)}" for k in [*roots, "client"])
            print(f"{name}, {clients} clients: {level.steps_per_s:.0f} steps/s", file=sys.stderr, flush=True)
            out.append(level)
    return out


def bench_celery_chain(
    redis_url: str, levels: Sequence[int], seconds: float, warmup: float, logdir: Path
) -> list[Level]:
    os.environ["BENCH_REDIS_URL"] = redis_url
    from celery import chain

    from bench import celery_chain

    def one() -> object:
        sig = chain(celery_chain.noop.si(None, 0), *[celery_chain.noop.s(i) for i in range(1, STEPS)])
        return sig.apply_async().get(timeout=300)

    name = "plain Celery chain (Redis), -c 2"
    out = []
    with worker("bench.celery_chain", {"BENCH_REDIS_URL": redis_url}, "prefork", logdir / "chain.log", concurrency=2):
        one()
        for clients in levels:
            latencies, total, errors = drive(one, clients, seconds, warmup, name)
            out.append(Level(name, clients, seconds, latencies, total, None, errors))
            print(f"{name}, {clients} clients: {out[-1].steps_per_s:.0f} steps/s", file=sys.stderr, flush=True)
    return out


def bench_dbos(url: str, levels: Sequence[int], seconds: float, warmup: float) -> list[Level]:
    out = []
    with scratch_database(url, "cw_bench_dbos_inflight") as db_url:
        for clients in levels:
            done = subprocess.run(
                [sys.executable, "-m", "bench.dbos_inflight", db_url, str(clients), str(seconds), str(warmup)],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=600 + seconds,
                check=True,
            )
            data = json.loads(done.stdout.strip().splitlines()[-1])
            counters = Counters(data["commits"], data["wal_syncs"], data["wal_writes"])
            level = Level("DBOS Transact 3.4", clients, seconds, data["latencies"], data["total"], counters)
            level.errors = data["errors"]
            print(f"DBOS, {clients} clients: {level.steps_per_s:.0f} steps/s", file=sys.stderr, flush=True)
            out.append(level)
    return out


def report(levels: Sequence[Level]) -> str:
    lines = [
        "| system | runs in flight | steps/s | p50 ms | p99 ms | commits/step | failed calls |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for lv in levels:
        lines.append(
            f"| {lv.system} | {lv.clients} | {lv.steps_per_s:.0f} | {lv.pct(0.5):.0f} | {lv.pct(0.99):.0f}"
            f" | {lv.commits_per_step()} | {lv.errors} |"
        )
    by: dict[tuple[str, int], Level] = {(lv.system.split(",")[0].split(" (")[0], lv.clients): lv for lv in levels}
    ratios = []
    for lv in levels:
        if not lv.system.startswith("celery_workflow"):
            continue
        for other in ("DBOS Transact 3.4", "plain Celery chain"):
            base = by.get((other.split(" (")[0], lv.clients))
            if base is not None and base.steps_per_s:
                ratios.append(
                    f"- {lv.system} / {other}, {lv.clients} in flight: **{lv.steps_per_s / base.steps_per_s:.2f}x**"
                )
    memory = [f"- {lv.system}, {lv.clients} in flight: {lv.memory}" for lv in levels if lv.memory != "-"]
    return "\n".join(
        [*lines, "", *ratios, "", "Resident memory (MiB, first sample after the warm-up → peak → last):", *memory]
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench --scenario inflight", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument(
        "--database-url", default=os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    )
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/15")
    p.add_argument("--levels", default=",".join(str(n) for n in LEVELS), help="comma-separated clients per level")
    p.add_argument("--seconds", type=float, default=20.0, help="measured window per level")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--skip", action="append", default=[], choices=["cw1", "cw2", "dbos", "chain"])
    args = p.parse_args(argv)
    levels = [int(n) for n in args.levels.split(",")]
    logdir = Path(tempfile.mkdtemp(prefix="cw-inflight-"))
    sys.path.insert(0, str(ROOT))
    results: list[Level] = []
    with scratch_schema(args.database_url) as schema:  # one World for both (its app module is imported once)
        url = with_search_path(args.database_url, schema)
        for workers, key in ((1, "cw1"), (2, "cw2")):
            if key not in args.skip:
                results += bench_celery_workflow(url, levels, args.seconds, args.warmup, workers=workers, logdir=logdir)
    if "dbos" not in args.skip:
        try:
            results += bench_dbos(args.database_url, levels, args.seconds, args.warmup)
        except (ImportError, subprocess.CalledProcessError) as exc:
            print(f"DBOS skipped: {exc}", file=sys.stderr)
    if "chain" not in args.skip:
        results += bench_celery_chain(args.redis_url, levels, args.seconds, args.warmup, logdir)
    print(report(results))
    print(f"\n(worker logs: {logdir})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
