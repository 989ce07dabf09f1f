"""``python -m bench --scenario relay``: workflow deliveries relayed through the app's own broker (RabbitMQ, Redis;
``Workflows(broker="app")``) beside the World's own transport, on the same Postgres World (issue #29, item 2).

For each carrier, with a real ``celery worker`` subprocess: sequential runs of no-op workflows of 1 and 10 steps
(steps/s, start-to-result p50/p99), then ``--sleepers`` runs that sleep ``--nap`` seconds started at once, and how
late each woke: the time from its sleep's due time (``wait_created.resume_at``) to its ``wait_completed`` event.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.__main__ import ROOT, Result, scratch_schema, timed, with_search_path, worker

CARRIERS = {
    "world": "world",
    "rabbitmq": "amqp://guest:guest@127.0.0.1:5672//",
    "redis": "redis://127.0.0.1:6379/15",
}


def _app(env: dict[str, str]) -> Any:
    os.environ.update(env)
    sys.modules.pop("bench.relay_app", None)
    return importlib.import_module("bench.relay_app")


def lateness(app: Any, runs: list[Any]) -> list[float]:
    """Seconds from each run's sleep due time to its wake-up event."""
    out = []
    for run in runs:
        events = {e.event_type.value: e for e in run.events()}
        due = datetime.fromisoformat(str(events["wait_created"].data["resume_at"]).replace("Z", "+00:00"))
        out.append((events["wait_completed"].created_at - due).total_seconds())
    return out


def measure(name: str, broker: str, database_url: str, args: argparse.Namespace, logdir: Path) -> list[str]:
    with scratch_schema(database_url) as schema:
        env = {
            "CELERY_WORKFLOW_URL": with_search_path(database_url, schema),
            "BENCH_BROKER": broker,
            "BENCH_QUEUE": f"bench-relay-{uuid.uuid4().hex[:6]}",
        }
        app = _app(env)
        try:
            with worker("bench.relay_app", env, args.pool, logdir / f"{name}-worker.log", concurrency=args.concurrency):
                app.one_step.start().result(timeout=60)  # the worker is up
                lines = []
                for steps, flow in ((1, app.one_step), (10, app.ten_steps)):
                    latencies = timed(lambda f=flow: f.start().result(timeout=60), args.runs)
                    r = Result(name, steps, latencies)
                    lines.append(
                        f"| {name} | {steps} | {args.runs} | {r.steps_per_s:.0f} | {r.pct(0.5):.1f} | {r.pct(0.99):.1f} |"
                    )
                sleepers = [app.nap.start(args.nap) for _ in range(args.sleepers)]
                for run in sleepers:
                    run.result(timeout=args.nap + 60)
                late = sorted(lateness(app, sleepers))
                p50, worst = late[len(late) // 2] * 1000, late[-1] * 1000
                lines.append(
                    f"| {name} | sleep {args.nap:g} s | {args.sleepers} | wake lateness p50 {p50:.0f} ms, max {worst:.0f} ms | | |"
                )
                return lines
        finally:
            app.wf.close()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench --scenario relay", description=__doc__)
    p.add_argument(
        "--database-url", default=os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    )
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--sleepers", type=int, default=20)
    p.add_argument("--nap", type=float, default=2.0, help="seconds each sleeper sleeps")
    p.add_argument("--pool", default="prefork", choices=["prefork", "solo", "threads"])
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--carrier", action="append", choices=sorted(CARRIERS), help="default: all")
    args = p.parse_args(argv)
    logdir = Path(tempfile.mkdtemp(prefix="cw-bench-relay-"))
    sys.path.insert(0, str(ROOT))
    lines = [
        "| carrier | steps/workflow | runs | steps/s | p50 ms | p99 ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in args.carrier or list(CARRIERS):
        started = time.monotonic()
        lines += measure(name, CARRIERS[name], args.database_url, args, logdir)
        print(f"{name}: {time.monotonic() - started:.0f} s", file=sys.stderr)
    print("\n".join(lines))
    print(f"\n(worker logs: {logdir})")
    return 0
