"""``python -m bench --scenario fanout``: one run that gathers ``--steps`` parallel steps (issue #26, item 4).

On each ``--world`` (``sqlite``, ``postgres``, ``aws``), one real ``celery worker -c 2`` (prefork, the World's own
transport) runs ``fan(n)`` of ``bench/fanout_app.py``: its first delivery creates the ``n`` steps and their deliveries
(several appends where the World has limits: DynamoDB's 100 actions per transaction), each step is its own delivery,
and every step's result wakes the run, which completes once all are in. Reported per World and width: the seconds
from ``start`` to the run's result, from ``start`` until the log held ``n + 2`` events (the steps' creations: exact
where one append writes them all; where several do, the steps of the first appends already add their events), steps
per second, and how long after the result the worker's queue was empty (what the run left queued: on the SQL Worlds
at most one wake-up, which a pending one deduplicates; on SQS one per step, each replaying an ended run).

``--steps`` takes a comma-separated list (``1000,2000,4000``) to show how the time scales. ``aws`` runs against a moto
server in this process (DynamoDB requests served one at a time, SQS concurrently); moto copies the whole table on
every ``TransactWriteItems``, so its times grow with the table and measure moto more than the World (issue #33,
item 4); ``--fast-moto`` replaces that copy with an undo log (:mod:`bench.moto_undo`) and moto's scans of a whole
SQS queue per receipt handle with an index (:mod:`bench.moto_sqs`). ``postgres`` uses a scratch schema on ``--database-url``; ``sqlite`` a file in a temporary folder.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@dataclass
class Outcome:
    world: str
    steps: int
    seconds: float
    created_after: float
    status: str
    idle_after: float = float("nan")

    @property
    def rate(self) -> float:
        return self.steps / self.seconds if self.seconds else float("nan")


@contextmanager
def world_env(kind: str, database_url: str, *, fast_moto: bool = False) -> Iterator[dict[str, str]]:
    """The environment the worker and this process open the World with (a fresh World each time)."""
    if kind == "sqlite":
        with tempfile.TemporaryDirectory(prefix="cw-fanout-") as tmp:
            yield {"CELERY_WORKFLOW_URL": f"sqlite:///{Path(tmp) / 'world.sqlite3'}"}
        return
    if kind == "postgres":
        from bench.__main__ import scratch_schema, with_search_path

        with scratch_schema(database_url) as schema:
            yield {"CELERY_WORKFLOW_URL": with_search_path(database_url, schema)}
        return
    import boto3

    from celery_workflow.testing.moto_server import MotoServer
    from celery_workflow.world_sqs import create_table

    if fast_moto:
        from bench import moto_sqs, moto_undo

        moto_undo.install()
        moto_sqs.install()
    server = MotoServer()
    server.reset()  # moto's backends live in this process: nothing of an earlier width is left
    try:
        endpoint = server.endpoint
        region = CREDENTIALS["AWS_DEFAULT_REGION"]
        keys = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": region}
        dynamodb = boto3.client("dynamodb", endpoint_url=endpoint, **keys)
        sqs = boto3.client("sqs", endpoint_url=endpoint, **keys)
        create_table(dynamodb, "fanout", poll=0.05)
        dlq = sqs.create_queue(QueueName="fanout-dlq")["QueueUrl"]
        dlq_arn = sqs.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        policy = json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": 10})
        url = sqs.create_queue(QueueName="fanout", Attributes={"RedrivePolicy": policy})["QueueUrl"]
        arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        yield {
            **CREDENTIALS,
            "CELERY_WORKFLOW_URL": "aws://",
            "AWS_ENDPOINT_URL": endpoint,
            "WORKFLOW_TABLE": "fanout",
            "WORKFLOW_QUEUE_URL": url,
            "WORKFLOW_QUEUE_ARN": arn,
        }
    finally:
        server.stop()


def queued(env: dict[str, str]) -> int:
    """Deliveries on the worker's queue (Celery's default queue), claimed or not."""
    url = env["CELERY_WORKFLOW_URL"]
    if url.startswith("sqlite:"):
        import sqlite3

        conn = sqlite3.connect(f"file:{url.split('sqlite:///', 1)[1]}?mode=ro", uri=True, timeout=30)
        try:
            return int(conn.execute("SELECT count(*) FROM celery_workflow_queue WHERE queue = 'celery'").fetchone()[0])
        finally:
            conn.close()
    if url.startswith("postgresql:"):
        import psycopg

        with psycopg.connect(url, autocommit=True) as pg:
            row = pg.execute("SELECT count(*) FROM celery_workflow_queue WHERE queue = 'celery'").fetchone()
            return int(row[0]) if row else 0
    import boto3

    sqs = boto3.client("sqs", endpoint_url=env["AWS_ENDPOINT_URL"], region_name=env["AWS_DEFAULT_REGION"])
    names = [
        "ApproximateNumberOfMessages",
        "ApproximateNumberOfMessagesNotVisible",
        "ApproximateNumberOfMessagesDelayed",
    ]
    found = sqs.get_queue_attributes(QueueUrl=env["WORKFLOW_QUEUE_URL"], AttributeNames=names)["Attributes"]
    return sum(int(found.get(name, 0)) for name in names)


def measure(
    kind: str,
    widths: Sequence[int],
    database_url: str,
    timeout: float,
    logdir: Path,
    *,
    fast_moto: bool = False,
    drain: float = 600.0,
) -> list[Outcome]:
    from bench.__main__ import worker

    out = []
    for n in widths:
        with world_env(kind, database_url, fast_moto=fast_moto) as env:
            os.environ.update(env)
            import bench.fanout_app as app

            app = importlib.reload(app)  # bound to this World
            with worker("bench.fanout_app", env, "prefork", logdir / f"fanout-{kind}-{n}.log", 2):
                app.fan.start(1).result(timeout=120)  # the worker is up
                world = app.wf.world
                began = time.monotonic()
                run = app.fan.start(n)
                created_after = float("nan")
                deadline = began + timeout
                while time.monotonic() < deadline:
                    view = world.get_run(run.id)
                    if math.isnan(created_after) and view.event_count >= n + 2:
                        created_after = time.monotonic() - began  # run_created, run_started, n step_created
                    if view.status.terminal:
                        break
                    time.sleep(0.2)
                seconds = time.monotonic() - began
                view = world.get_run(run.id)
                status = view.status.value
                if status == "completed" and view.output != n * (n - 1) // 2:
                    status = f"wrong output {view.output}"
                idle_after = float("nan")  # until the worker has handled what the run left queued (its wake-ups)
                while time.monotonic() < began + seconds + drain:
                    if queued(env) == 0:
                        idle_after = time.monotonic() - began - seconds
                        break
                    time.sleep(0.5)
            out.append(Outcome(kind, n, seconds, created_after, status, idle_after))
            print(f"{kind} {n}: {status} in {seconds:.1f} s (steps created after {created_after:.1f} s,"
                  f" queue empty {idle_after:.1f} s after the result)", file=sys.stderr, flush=True)  # fmt: skip
            app.wf.close()
    return out


def report(outcomes: Sequence[Outcome]) -> str:
    lines = [
        "one run gathering N parallel no-op steps; one `celery worker -c 2` (prefork)",
        "",
        "| World | steps | status | start to result | steps created after | steps/s | queue empty after the result |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for o in outcomes:
        lines.append(
            f"| {o.world} | {o.steps:,} | {o.status} | {o.seconds:.1f} s | {o.created_after:.1f} s | {o.rate:.0f}"
            f" | {o.idle_after:.1f} s |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench --scenario fanout", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--world", action="append", choices=["sqlite", "postgres", "aws"], help="default: all three")
    p.add_argument("--steps", default="10000", help="parallel steps, or a comma-separated list of widths")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take before it is given up")
    p.add_argument("--database-url", default=os.environ.get("DATABASE_URL", DEFAULT_DATABASE_URL))
    p.add_argument("--drain", type=float, default=600.0, help="seconds to wait after the result for the queue to empty")
    p.add_argument(
        "--fast-moto",
        action="store_true",
        help="aws: an undo log instead of moto's copy of the whole table per transaction action (bench/moto_undo.py),"
        " and an index of SQS receipt handles instead of moto's scan of the queue per handle (bench/moto_sqs.py)",
    )
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the worker and drop the scratch World on the way out
    widths = [int(w) for w in str(args.steps).split(",") if w.strip()]
    logdir = Path(tempfile.mkdtemp(prefix="cw-bench-fanout-"))
    outcomes: list[Outcome] = []
    for kind in args.world or ["sqlite", "postgres", "aws"]:
        outcomes += measure(
            kind, widths, args.database_url, args.timeout, logdir, fast_moto=args.fast_moto, drain=args.drain
        )
    print(report(outcomes))
    print(f"(worker logs in {logdir})", file=sys.stderr)
    return 0 if all(o.status == "completed" for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
