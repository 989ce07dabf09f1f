"""``python -m bench --scenario latency``: one-step start-to-result latency beside a plain Celery task on Redis,
interleaved, with the CPU each part of the path spends (issue #13, item 4).

A shared machine's speed drifts by tens of percent over minutes (on the 2-core VM of RESULTS.md, a plain Celery task
took 2.1 ms in one minute and 4.2 ms in another). Measured one after the other, as the sequential scenario does, the
ratio of two latencies carries that drift. Here both workers run side by side the whole time, each idle while the
other is measured, and the client alternates blocks of runs between them (``--rounds`` rounds of ``--block`` runs
each), so both see the same machine.

For each system it prints p50/p90/p99 latency and the CPU time per run of each process on the path, read from
``/proc/<pid>/task/*/schedstat`` (nanoseconds on a CPU, every thread): the client (this process), the worker's
main process, its pool child, and the data store's server processes (every ``postgres`` process; ``redis-server``).
What a durable run costs beyond a task is where the two columns differ.

By default the runs follow each other back to back, so each starts while the worker that ran the previous one is
still finishing it (its ack, its pool's bookkeeping). ``--gap MS`` has the client wait that long before each start
(for both systems, outside the measured time): a request arriving at an idle worker, as most do below saturation.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.__main__ import ROOT, scratch_schema, with_search_path, worker
from bench.procmem import children

PARTS = ("client", "worker main", "pool child", "server")


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of ``pid`` so far, in nanoseconds (0 once it is gone)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total


def named(comm: str) -> list[int]:
    """The pids of processes whose command name is ``comm``."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == comm:
                    out.append(int(entry.name))
            except OSError:
                continue
    return out


@dataclass
class System:
    name: str
    call: Callable[[], object]
    worker_pid: int
    server: str  # the command name of the data store's processes
    latencies: list[float] = field(default_factory=list)
    block_p50s: list[float] = field(default_factory=list)  # the median of each block, in seconds
    cpu: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PARTS, 0))

    def sample(self) -> dict[str, int]:
        kids = children(self.worker_pid)
        return {
            "client": cpu_ns(os.getpid()),
            "worker main": cpu_ns(self.worker_pid),
            "pool child": sum(cpu_ns(k) for k in kids),
            "server": sum(cpu_ns(p) for p in named(self.server)),
        }

    def block(self, runs: int, warmup: int = 3, gap: float = 0.0) -> None:
        """``runs`` runs one after the other (``gap`` seconds apart: the client waits that long before each start,
        outside the measured time)."""
        for _ in range(warmup):
            self.call()
        before = self.sample()
        block = []
        for _ in range(runs):
            if gap:
                time.sleep(gap)
            t0 = time.perf_counter()
            self.call()
            block.append(time.perf_counter() - t0)
        after = self.sample()
        self.latencies += block
        self.block_p50s.append(statistics.median(block))
        for part in PARTS:
            self.cpu[part] += after[part] - before[part]

    def pct(self, q: float) -> float:
        data = sorted(self.latencies)
        return data[min(len(data) - 1, int(q * len(data)))] * 1000


def report(systems: list[System]) -> str:
    lines = [
        "| system | runs | p50 ms | p90 ms | p99 ms | "
        + " | ".join(f"CPU {p} ms/run" for p in PARTS)
        + " | CPU total |",
        "| --- | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in PARTS) + " | ---: |",
    ]
    for s in systems:
        n = len(s.latencies)
        per = {p: s.cpu[p] / n / 1e6 for p in PARTS}
        lines.append(
            f"| {s.name} | {n} | {s.pct(0.5):.2f} | {s.pct(0.9):.2f} | {s.pct(0.99):.2f} | "
            + " | ".join(f"{per[p]:.2f}" for p in PARTS)
            + f" | {sum(per.values()):.2f} |"
        )
    cw, celery = systems
    lines += [
        "",
        f"- celery_workflow / plain Celery task, p50 start to result: **{cw.pct(0.5) / celery.pct(0.5):.2f}x**"
        " (target at most 1.5x)",
        f"- CPU per run, all parts: {sum(cw.cpu.values()) / len(cw.latencies) / 1e6:.2f} ms against"
        f" {sum(celery.cpu.values()) / len(celery.latencies) / 1e6:.2f} ms",
    ]
    ratios = sorted(a / b for a, b in zip(cw.block_p50s, celery.block_p50s, strict=True))
    if len(ratios) >= 4:  # how steady the ratio is: each round's two blocks ran back to back on the same machine
        quarter = len(ratios) // 4
        lines.append(
            f"- per round (p50 of its block against the other's): median {statistics.median(ratios):.2f}x, middle half"
            f" {ratios[quarter]:.2f}-{ratios[-quarter - 1]:.2f}x, all {ratios[0]:.2f}-{ratios[-1]:.2f}x"
            f" ({len(ratios)} rounds)"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench --scenario latency", description=__doc__)
    p.add_argument(
        "--database-url", default=os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    )
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/15")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--block", type=int, default=50, help="runs of one system before the other's turn")
    p.add_argument("--pool", default="prefork", choices=["prefork", "solo", "threads"])
    p.add_argument(
        "--gap",
        type=float,
        default=0.0,
        help="milliseconds the client waits before each start, for both systems (default 0: back to back, each run"
        " starting while the previous one's worker finishes; with a gap each starts on a quiet pair of processes)",
    )
    args = p.parse_args(argv)
    logdir = Path(tempfile.mkdtemp(prefix="cw-bench-latency-"))
    sys.path.insert(0, str(ROOT))
    with scratch_schema(args.database_url) as schema:
        env = {"CELERY_WORKFLOW_URL": with_search_path(args.database_url, schema), "CW_DURABILITY": "delivery"}
        os.environ.update(env)
        os.environ["BENCH_REDIS_URL"] = args.redis_url
        from bench import celery_chain, cw_app

        with (
            worker("bench.cw_app", env, args.pool, logdir / "cw-worker.log") as cw_proc,
            worker(
                "bench.celery_chain", {"BENCH_REDIS_URL": args.redis_url}, args.pool, logdir / "chain-worker.log"
            ) as chain_proc,
        ):
            systems = [
                System(
                    "celery_workflow, 1 step (Postgres World)",
                    lambda: cw_app.one_step.start().result(timeout=60),
                    cw_proc.pid,
                    "postgres",
                ),
                System(
                    "plain Celery task (Redis)",
                    lambda: celery_chain.noop.si(None, 0).apply_async().get(timeout=60),
                    chain_proc.pid,
                    "redis-server",
                ),
            ]
            for s in systems:
                s.block(20, warmup=0)  # both workers up and warm
                s.latencies.clear()
                s.block_p50s.clear()
                s.cpu = dict.fromkeys(PARTS, 0)
            for _ in range(args.rounds):
                for s in systems:
                    s.block(args.block, gap=args.gap / 1000)
        cw_app.wf.close()
    print(
        f"{args.rounds} rounds of {args.block} runs each, alternating; {args.pool} pool, one process;"
        f" {'back to back' if not args.gap else f'{args.gap:g} ms between runs'}; CPU from /proc/<pid>/task/*/schedstat\n"
    )
    print(report(systems))
    print(f"\n(worker logs: {logdir})")
    return 0
