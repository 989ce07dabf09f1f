"""``python -m bench --scenario claims``: what one claim costs as the queue table grows (issue #13, scenario 2).

Sleeping runs are rows of the queue table due later: 100,000 runs asleep are 100,000 rows a worker's claim must not
look at. For each size (default 1k, 100k and 1M rows, due at random within the next 10 minutes, as many sleeping
runs' wake-ups are) it adds one due row and measures the transport's poll (the claim and the queues' next due times,
one statement on Postgres):

* Postgres: ``EXPLAIN (ANALYZE, BUFFERS)`` of that statement prepared with the generic plan the store's sessions
  use (``plan_cache_mode = force_generic_plan``): the nodes that read the queue table and the shared buffers it
  touched (index pages and the rows it locked), in a transaction rolled back;
* SQLite: the SQLite virtual-machine instructions the poll runs (a progress handler counts them) and the query plan
  of its candidate query;
* both: the median wall time of 50 polls through the store's own API (a row put, claimed, acked each time).

The work (buffers, instructions) must stay flat as the table grows: ``tests/integration/test_claim_scaling.py`` fails
if it grows with the sleeping rows.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Sleeping rows are due at random within this many seconds (from a minute from now on, so none falls due meanwhile).
SPREAD = 600.0
SIZES = (1_000, 100_000, 1_000_000)
QUEUE = "celery"


@dataclass
class ClaimCost:
    world: str
    rows: int
    work: int  # Postgres: shared buffers touched; SQLite: VM instructions
    plan: list[str]
    median_ms: float = float("nan")


def walk(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from walk(child)


# -- Postgres --------------------------------------------------------------------------------------------------------


def pg_fill(conn: Any, rows: int, queue: str = QUEUE) -> None:
    """Add ``rows`` sleeping rows (one run each) to the queue table, then ANALYZE it."""
    done = 0
    while done < rows:
        n = min(100_000, rows - done)
        conn.execute(
            "INSERT INTO celery_workflow_queue (queue, payload, run_id, not_before)"
            " SELECT %s, '\\x7b7d'::bytea, 'wrun_sleep_' || (%s + g),"
            " now() + interval '1 minute' + random() * make_interval(secs => %s)"
            " FROM generate_series(1, %s) AS g",
            (queue, done, SPREAD, n),
        )
        done += n
    conn.execute("ANALYZE celery_workflow_queue")


#: The poll's parameters, in the order of a prepared statement's ``$n``, with their types.
_POLL_PARAMS = (("queues", "text[]"), ("no_ack", "text[]"), ("limit", "integer"), ("lease", "interval"),
                ("now", "timestamptz"))  # fmt: skip


def pg_claim_plan(conn: Any, queues: Sequence[str] = (QUEUE,), *, generic: bool = True) -> ClaimCost:
    """The plan and buffers of one poll finding one due row among the others (rolled back). ``generic``: the plan
    a prepared statement gets under ``plan_cache_mode = force_generic_plan``, as the store's sessions run it; else
    the custom plan for these values."""
    from psycopg import sql as pgsql

    from celery_workflow._postgres import queue_sql

    sql = queue_sql.POLL
    for i, (name, _type) in enumerate(_POLL_PARAMS, 1):
        sql = sql.replace(f"%({name})s", f"${i}")
    types = ", ".join(t for _, t in _POLL_PARAMS)
    values: list[Any] = [list(queues), [], 1, "60 seconds", None]
    with conn.transaction(force_rollback=True):
        conn.execute(
            "INSERT INTO celery_workflow_queue (queue, payload, not_before) VALUES (%s, '\\x7b7d'::bytea, now())",
            (queues[0],),
        )
        conn.execute(f"SET LOCAL plan_cache_mode = {'force_generic_plan' if generic else 'force_custom_plan'}")
        conn.execute(f"PREPARE cw_claim_plan ({types}) AS {sql}")
        try:
            args = pgsql.SQL(", ").join(
                pgsql.SQL("{}::{}").format(pgsql.Literal(v), pgsql.SQL(t))
                for v, (_, t) in zip(values, _POLL_PARAMS, strict=True)
            )
            query = pgsql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE cw_claim_plan ({})").format(args)
            (doc,) = conn.execute(query).fetchone()
        finally:
            conn.execute("DEALLOCATE cw_claim_plan")
    plan = doc[0]["Plan"]
    rows = conn.execute("SELECT count(*) FROM celery_workflow_queue").fetchone()[0]
    scans = [
        f"{n['Node Type']}" + (f" using {n['Index Name']}" if n.get("Index Name") else "")
        for n in walk(plan)
        if n.get("Relation Name") == "celery_workflow_queue"
    ]
    return ClaimCost("postgres", int(rows), int(plan["Shared Hit Blocks"] + plan["Shared Read Blocks"]), scans)


def timed_polls(store: Any, times: int = 50, queue: str = QUEUE) -> float:
    """Median milliseconds of ``store.poll`` finding one due row (put before, acked after, neither timed)."""
    spent = []
    for _ in range(times):
        store.put(queue, b'{"body": "{}", "headers": {}, "properties": {}}')
        t0 = time.perf_counter()
        claims, _due = store.poll([queue], limit=1, lease=60)
        spent.append(time.perf_counter() - t0)
        for claim in claims:
            store.ack(claim.receipt)
    return statistics.median(spent) * 1000


# -- SQLite ----------------------------------------------------------------------------------------------------------


def sqlite_fill(store: Any, rows: int, queue: str = QUEUE) -> None:
    """Add ``rows`` sleeping rows (one run each) through the store's database, then ANALYZE."""
    import random

    now = int(time.time() * 1_000_000)
    rng = random.Random(rows)
    with store.db.transaction() as conn:
        base = conn.execute("SELECT count(*) FROM celery_workflow_queue").fetchone()[0]
        conn.executemany(
            "INSERT INTO celery_workflow_queue (queue, payload, run_id, not_before, created_at) VALUES (?, ?, ?, ?, ?)",
            (
                (queue, b"{}", f"wrun_sleep_{base + i}", now + 60_000_000 + int(rng.random() * SPREAD * 1e6), now)
                for i in range(rows)
            ),
        )
        conn.execute("ANALYZE")


def sqlite_claim_cost(store: Any, queue: str = QUEUE) -> ClaimCost:
    """VM instructions of one poll finding one due row, and the plan of its candidate query."""
    from celery_workflow._sqlite import deliveries as sqlite_queue

    store.put(queue, b'{"body": "{}", "headers": {}, "properties": {}}')
    conn = store.db.connection()
    steps = [0]

    def count() -> int:
        steps[0] += 1
        return 0

    conn.set_progress_handler(count, 1)
    try:
        claims, _due = store.poll([queue], limit=1, lease=60)
    finally:
        conn.set_progress_handler(None, 1)
    assert len(claims) == 1, "the due row was not claimed"
    store.ack(claims[0].receipt)
    plan = conn.execute(
        f"EXPLAIN QUERY PLAN SELECT not_before, id FROM {sqlite_queue._Q} WHERE {sqlite_queue._CLAIMABLE}"
        " ORDER BY not_before, id LIMIT ?",
        (queue, 0, 0, 0, 1),
    ).fetchall()
    rows = conn.execute("SELECT count(*) FROM celery_workflow_queue").fetchone()[0]
    return ClaimCost("sqlite", int(rows), steps[0], [str(r[-1]) for r in plan])


# -- the scenario ----------------------------------------------------------------------------------------------------


@contextmanager
def pg_store(database_url: str) -> Iterator[tuple[Any, Any]]:
    """A migrated Postgres queue store on a scratch schema and an autocommit connection to it; dropped after."""
    import psycopg

    from bench.__main__ import scratch_schema, with_search_path
    from celery_workflow._postgres.database import PgDatabase
    from celery_workflow._postgres.queue import PostgresQueue

    with scratch_schema(database_url) as schema:
        url = with_search_path(database_url, schema)
        db = PgDatabase.open(url, max_size=2)
        try:
            db.migrate()
            with psycopg.connect(url, autocommit=True) as conn:
                yield PostgresQueue(db), conn
        finally:
            db.close()


@contextmanager
def sqlite_store() -> Iterator[Any]:
    from celery_workflow.world_sqlite import SQLiteWorld

    with tempfile.TemporaryDirectory(prefix="cw-claims-") as tmp:
        world = SQLiteWorld(str(Path(tmp) / "world.sqlite3"))
        try:
            yield world.store
        finally:
            world.close()


def grow(
    world: str, sizes: Sequence[int], fill: Callable[[int], None], measure: Callable[[], ClaimCost], store: Any
) -> list[ClaimCost]:
    """Fill the queue table up to each size in turn (``fill(more_rows)``) and measure a claim there."""
    out, have = [], 0
    for size in sizes:
        fill(size - have)
        have = size
        cost = measure()
        cost.median_ms = timed_polls(store)
        print(f"{world} {size:>9,} rows: {cost}", file=sys.stderr, flush=True)
        out.append(cost)
    return out


def run(worlds: Sequence[str], sizes: Sequence[int], database_url: str) -> list[ClaimCost]:
    out = []
    if "postgres" in worlds:
        with pg_store(database_url) as (store, conn):
            out += grow("postgres", sizes, lambda n: pg_fill(conn, n), lambda: pg_claim_plan(conn), store)
    if "sqlite" in worlds:
        with sqlite_store() as store:
            out += grow("sqlite", sizes, lambda n: sqlite_fill(store, n), lambda: sqlite_claim_cost(store), store)
    return out


def report(costs: Sequence[ClaimCost]) -> str:
    lines = [
        "| World | rows in the queue table | poll p50 ms | work per poll | plan on the queue table |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for c in costs:
        unit = "buffers" if c.world == "postgres" else "VM instructions"
        lines.append(f"| {c.world} | {c.rows:,} | {c.median_ms:.2f} | {c.work:,} {unit} | {'; '.join(c.plan)} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench --scenario claims", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--world", action="append", choices=["postgres", "sqlite"], help="default: both")
    p.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="comma-separated row counts")
    p.add_argument(
        "--database-url", default=os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    )
    args = p.parse_args(argv)
    sizes = sorted(int(s) for s in args.sizes.split(","))
    print(report(run(args.world or ["postgres", "sqlite"], sizes, args.database_url)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
