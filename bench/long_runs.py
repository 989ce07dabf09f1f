"""``python -m bench --scenario long``: what a delivery of a long-running loop costs as its log grows (issue #13,
scenario 3).

A workflow loops ``--iterations`` times over a step and a 1 ms sleep (5 events per iteration: the step's creation,
start and result, the sleep's creation and completion), so each iteration is one delivery that replays the run from
the top. Two versions, each on the SQLite and the Postgres World, driven in this process by
:class:`celery_workflow.testing.LocalWorker` (the handler's own cost, without a broker):

* **one run**: the loop in one run; its log reaches five events per iteration and every delivery replays all of it;
* **continue_as_new**: the same loop handing over to a fresh run every ``--chunk`` iterations.

For deliveries at about 100, 1,000 and 10,000 events into the loop it prints the mean wall and CPU time of one
delivery and the events it loaded, and the whole loop's time. One run's cost per delivery grows with its log (the
loop's total with its square); with continue_as_new it stays flat. ``tests/unit/test_continue_as_new.py`` fails if
the events a delivery replays grow with the loop's length.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EVENTS_PER_ITERATION = 5
MARKS = (100, 1_000, 10_000)


@dataclass
class Delivery:
    position: int  # events of the loop written before this delivery (over all runs of a chain)
    loaded: int  # events this delivery read and replayed
    wall: float
    cpu: float


@dataclass
class Curve:
    world: str
    version: str
    deliveries: list[Delivery] = field(default_factory=list)
    total_wall: float = 0.0

    def near(self, mark: int) -> list[Delivery]:
        return [d for d in self.deliveries if abs(d.position - mark) <= max(25, mark // 20)]


@contextmanager
def open_world(kind: str, database_url: str) -> Iterator[Any]:
    from celery_workflow.world import open_world as open_url

    if kind == "sqlite":
        with tempfile.TemporaryDirectory(prefix="cw-long-") as tmp:
            world = open_url(f"sqlite:///{Path(tmp) / 'world.sqlite3'}")
            try:
                yield world
            finally:
                world.close()
        return
    from bench.__main__ import scratch_schema, with_search_path

    with scratch_schema(database_url) as schema:
        world = open_url(with_search_path(database_url, schema))
        try:
            yield world
        finally:
            world.close()


def measure(kind: str, version: str, iterations: int, chunk: int, database_url: str) -> Curve:
    from celery import Celery

    from celery_workflow import Workflows, continue_as_new, sleep
    from celery_workflow.runtime.continuation import continued_as
    from celery_workflow.testing import LocalWorker

    curve = Curve(kind, version)
    with open_world(kind, database_url) as world:
        wf = Workflows(Celery("long"), world=world, broker="app")

        @wf.step
        def tick(i: int) -> int:
            return i

        @wf.workflow
        def loop(n: int, start: int = 0, total: int = 0) -> int:
            for i in range(start, n):
                total += tick(i)
                sleep(0.001)
                if version == "continue_as_new" and (i + 1) % chunk == 0 and i + 1 < n:
                    continue_as_new(n, i + 1, total)
            return total

        loaded: list[int] = []
        read = world.get_run_with_events

        def counting(run_id: str) -> Any:
            run, events = read(run_id)
            loaded.append(len(events))
            return run, events

        world.get_run_with_events = counting
        handle = wf.handle_delivery
        position = 0

        def timed(payload: bytes, claim: Any = None) -> Any:
            nonlocal position
            loaded.clear()
            w0, c0 = time.perf_counter(), time.process_time()
            out = handle(payload, claim)
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            if loaded:
                curve.deliveries.append(Delivery(position, max(loaded), wall, cpu))
            return out

        wf.handle_delivery = timed  # type: ignore[method-assign]
        worker = LocalWorker(wf)
        run = loop.start(iterations)
        current = run.id
        started = time.perf_counter()
        done_before = 0  # loop events of the runs of the chain already ended

        def finished() -> bool:
            nonlocal current, done_before, position
            view = world.get_run(current)
            successor = continued_as(world, view)
            if successor is not None:
                done_before += view.event_count
                current = successor
                return False
            position = done_before + view.event_count
            return view.status.terminal

        worker.run_until(finished, timeout=3600)
        curve.total_wall = time.perf_counter() - started
        assert run.result() == iterations * (iterations - 1) // 2
    return curve


def report(curves: Sequence[Curve], iterations: int, chunk: int) -> str:
    lines = [
        f"{iterations} iterations of a step and a 1 ms sleep ({EVENTS_PER_ITERATION} events each);"
        f" continue_as_new every {chunk} iterations",
        "",
        "| World | version | events into the loop | ms/delivery (wall) | ms/delivery (CPU) | events replayed |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for c in curves:
        for mark in MARKS:
            near = c.near(mark)
            if not near:
                continue
            wall = statistics.mean(d.wall for d in near) * 1000
            cpu = statistics.mean(d.cpu for d in near) * 1000
            events = statistics.mean(d.loaded for d in near)
            lines.append(f"| {c.world} | {c.version} | {mark:,} | {wall:.2f} | {cpu:.2f} | {events:,.0f} |")
    lines += [
        "",
        "| World | version | whole loop (s) | deliveries | ratio one run / continue_as_new |",
        "|---|---|---:|---:|---:|",
    ]
    by = {(c.world, c.version): c for c in curves}
    for c in curves:
        other = by.get((c.world, "continue_as_new"))
        ratio = c.total_wall / other.total_wall if other else float("nan")
        lines.append(f"| {c.world} | {c.version} | {c.total_wall:.1f} | {len(c.deliveries)} | {ratio:.1f}x |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench --scenario long", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--world", action="append", choices=["sqlite", "postgres"], help="default: both")
    p.add_argument("--iterations", type=int, default=2_000, help="default 2000 (10,000 events)")
    p.add_argument("--chunk", type=int, default=100, help="continue_as_new every this many iterations")
    p.add_argument("--version", action="append", choices=["one_run", "continue_as_new"], help="default: both")
    p.add_argument(
        "--database-url", default=os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    )
    args = p.parse_args(argv)
    curves = []
    for kind in args.world or ["sqlite", "postgres"]:
        for version in args.version or ["one_run", "continue_as_new"]:
            curve = measure(kind, version, args.iterations, args.chunk, args.database_url)
            print(f"{kind} {version}: {curve.total_wall:.1f} s", file=sys.stderr, flush=True)
            curves.append(curve)
    print(report(curves, args.iterations, args.chunk))
    return 0
