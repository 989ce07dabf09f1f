"""``python -m bench``: durable steps per second and start-to-result latency, against baselines in the same run.

Measured, one after another on the same machine and the same Postgres:

* **celery_workflow** on the Postgres World, through a real ``celery worker`` subprocess: sequential runs of no-op
  workflows of 1 and 10 steps, each started by a client and waited for (``run.result()``);
* **plain Celery** on Redis: a chain of the same number of no-op tasks (not durable), same pool;
* **DBOS Transact** with the same workflow, sequential, in-process, on its own database of the same server;
* **pgbench**: one-row INSERT transactions on one connection, the ceiling of sequential durable commits.

Install what it compares with ``pip install -e '.[bench]'`` (psycopg, redis, DBOS) and have ``pgbench`` on the PATH.
It prints steps/s, p50/p99 start-to-result latency, Postgres commits and WAL flushes per step, and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg

from bench.pgstats import Counters, settled

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Result:
    system: str
    steps: int
    latencies: list[float]
    counters: Counters | None = None

    @property
    def steps_per_s(self) -> float:
        return self.steps * len(self.latencies) / sum(self.latencies)

    def pct(self, q: float) -> float:
        data = sorted(self.latencies)
        return data[min(len(data) - 1, int(q * len(data)))] * 1000

    def per_step(self, value: int) -> float:
        return value / (self.steps * len(self.latencies))


def with_search_path(url: str, schema: str) -> str:
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}options={quote(f'-csearch_path={schema}')}"


@contextmanager
def scratch_schema(url: str) -> Iterator[str]:
    schema = f"cw_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    try:
        yield schema
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


@contextmanager
def scratch_database(url: str, name: str) -> Iterator[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")
    base, _, query = url.partition("?")
    yield base.rsplit("/", 1)[0] + f"/{name}" + (f"?{query}" if query else "")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@contextmanager
def worker(
    app: str, env: dict[str, str], pool: str, log: Path, concurrency: int = 1
) -> Iterator[subprocess.Popen[bytes]]:
    out = log.open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            app,
            "worker",
            "-c",
            str(concurrency),
            f"--pool={pool}",
            "--loglevel=WARNING",
            "--without-heartbeat",
            "--without-mingle",
            "--without-gossip",
            "-n",
            f"bench-{uuid.uuid4().hex[:6]}@%h",
        ],
        cwd=ROOT,
        env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        out.close()


def timed(fn: Callable[[], object], runs: int, warmup: int = 5) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def bench_celery_workflow(url: str, runs: int, pool: str, durability: str, logdir: Path) -> list[Result]:
    env = {"CELERY_WORKFLOW_URL": url, "CW_DURABILITY": durability}
    os.environ.update(env)
    sys.path.insert(0, str(ROOT))
    from bench import cw_app

    results = []
    with worker("bench.cw_app", env, pool, logdir / "cw-worker.log"):
        for steps, flow in ((1, cw_app.one_step), (10, cw_app.ten_steps)):
            flow.start().result(timeout=60)  # the worker is up
            before = settled(url)

            def one(f: Any = flow) -> object:
                return f.start().result(timeout=60)

            latencies = timed(one, runs)
            counters = settled(url) - before
            results.append(Result(f"celery_workflow ({durability})", steps, latencies, counters))
    cw_app.wf.close()
    return results


def bench_celery_chain(redis_url: str, runs: int, pool: str, logdir: Path) -> list[Result]:
    os.environ["BENCH_REDIS_URL"] = redis_url
    from celery import chain

    from bench import celery_chain

    results = []
    with worker("bench.celery_chain", {"BENCH_REDIS_URL": redis_url}, pool, logdir / "chain-worker.log"):
        for steps in (1, 10):

            def one(n: int = steps) -> object:
                sig = chain(celery_chain.noop.si(None, 0), *[celery_chain.noop.s(i) for i in range(1, n)])
                return sig.apply_async().get(timeout=60)

            one()
            results.append(Result("plain Celery chain (Redis)", steps, timed(one, runs)))
    return results


def bench_dbos(url: str, runs: int) -> list[Result]:
    results = []
    with scratch_database(url, "cw_bench_dbos") as db_url:
        for steps in (1, 10):
            out = subprocess.run(
                [sys.executable, "-m", "bench.dbos_bench", db_url, str(runs), str(steps)],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=600,
                check=True,
            )
            data = json.loads(out.stdout.strip().splitlines()[-1])
            counters = Counters(data["commits"], data["wal_syncs"], data["wal_writes"])
            results.append(Result("DBOS Transact 3.4", steps, data["latencies"], counters))
    return results


def bench_pgbench(url: str, schema: str, seconds: int) -> float:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {schema}.pgb (id bigserial PRIMARY KEY, v int)")
    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as script:
        script.write(f"INSERT INTO {schema}.pgb (v) VALUES (1);\n")
    out = subprocess.run(
        ["pgbench", "-n", "-c", "1", "-T", str(seconds), "-f", script.name, url],
        capture_output=True,
        text=True,
        check=True,
    )
    match = re.search(r"tps = ([0-9.]+)", out.stdout)
    return float(match.group(1)) if match else float("nan")


def report(results: list[Result], pgbench_tps: float) -> str:
    lines = [
        "| system | steps/workflow | runs | steps/s | p50 ms | p99 ms | commits/step | WAL flushes/step |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        c = r.counters
        commits = f"{r.per_step(c.commits):.2f}" if c else "-"
        flushes = f"{r.per_step(c.wal_syncs):.2f}" if c else "-"
        lines.append(
            f"| {r.system} | {r.steps} | {len(r.latencies)} | {r.steps_per_s:.0f} | {r.pct(0.5):.1f} | {r.pct(0.99):.1f}"
            f" | {commits} | {flushes} |"
        )
    lines.append(f"| pgbench, one-row INSERT, 1 connection | - | - | {pgbench_tps:.0f} tx/s | | | 1 | |")
    by = {(r.system.split(" (")[0].split(" Transact")[0], r.steps): r for r in results}
    ratios = []
    cw10, cw1 = by.get(("celery_workflow", 10)), by.get(("celery_workflow", 1))
    for name, key in (("DBOS", ("DBOS", 10)), ("plain Celery chain", ("plain Celery chain", 10))):
        other = by.get(key)
        if cw10 and other:
            ratios.append(
                f"- celery_workflow / {name}, 10-step workflows, steps/s: **{cw10.steps_per_s / other.steps_per_s:.2f}x**"
            )
    if cw10:
        ratios.append(f"- celery_workflow steps/s / pgbench commits/s: {cw10.steps_per_s / pgbench_tps:.2f}")
        if cw10.counters:
            ratios.append(f"- WAL flushes per step (10-step workflows): {cw10.per_step(cw10.counters.wal_syncs):.2f}")
    if cw1:
        ratios.append(f"- 1-step start-to-result p50: {cw1.pct(0.5):.1f} ms")
    return "\n".join([*lines, "", *ratios])


#: ``python -m bench --scenario NAME …``: the scenarios beside the default one (sequential runs), by module.
SCENARIOS = {
    "claims": "bench.claims",
    "chaos": "bench.chaos",
    "fanout": "bench.fanout",
    "handoff": "bench.handoff",
    "inflight": "bench.inflight",
    "latency": "bench.latency",
    "long": "bench.long_runs",
    "relay": "bench.relay",
    "sleepers": "bench.sleepers",
}


def main() -> int:
    scenario = argparse.ArgumentParser(add_help=False)
    scenario.add_argument("--scenario", default="sequential", choices=["sequential", *SCENARIOS])
    chosen, rest = scenario.parse_known_args()
    if chosen.scenario != "sequential":
        import importlib

        entry: Any = importlib.import_module(SCENARIOS[chosen.scenario]).main
        return int(entry(rest))
    p = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--database-url", default=os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    )
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/15")
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--pool", default="prefork", choices=["prefork", "solo", "threads"])
    p.add_argument("--durability", default="delivery", choices=["delivery", "step"])
    p.add_argument("--pgbench-seconds", type=int, default=10)
    p.add_argument("--skip", action="append", default=[], choices=["dbos", "chain", "pgbench", "cw"])
    p.add_argument("--scenario", default="sequential", help="sequential (this one), " + ", ".join(SCENARIOS))
    args = p.parse_args()
    logdir = Path(tempfile.mkdtemp(prefix="cw-bench-"))
    results: list[Result] = []
    with scratch_schema(args.database_url) as schema:
        url = with_search_path(args.database_url, schema)
        tps = float("nan") if "pgbench" in args.skip else bench_pgbench(args.database_url, schema, args.pgbench_seconds)
        if "cw" not in args.skip:
            results += bench_celery_workflow(url, args.runs, args.pool, args.durability, logdir)
        if "chain" not in args.skip:
            results += bench_celery_chain(args.redis_url, args.runs, args.pool, logdir)
        if "dbos" not in args.skip:
            try:
                results += bench_dbos(args.database_url, args.runs)
            except (ImportError, subprocess.CalledProcessError) as exc:
                print(f"DBOS skipped: {exc}", file=sys.stderr)
    print(report(results, tps))
    print(f"\n(worker logs: {logdir})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
