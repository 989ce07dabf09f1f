"""DBOS Transact side of the benchmark, run in its own process: ``python -m bench.dbos_bench URL RUNS STEPS``.

Prints one JSON line: per-run start-to-result latencies in seconds, and the commits and WAL flushes of the measured
runs (after launch and warm-up). The workflow is the same no-op chain.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def launch(name: str, url: str) -> Any:
    """DBOS configured on ``url`` with the no-op chain workflow registered, launched; the workflow."""
    from dbos import DBOS

    DBOS(config={"name": name, "system_database_url": url})

    @DBOS.step()  # type: ignore[untyped-decorator]
    def noop(i: int) -> int:
        return i

    @DBOS.workflow()  # type: ignore[untyped-decorator]
    def chain(n: int) -> int:
        total = 0
        for i in range(n):
            total += noop(i)
        return total

    DBOS.launch()
    return chain


def main() -> None:
    url, runs, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    from dbos import DBOS

    chain = launch("cw_bench", url)
    for _ in range(5):
        DBOS.start_workflow(chain, steps).get_result()  # warm-up
    from bench.pgstats import settled

    before = settled(url)
    latencies = []
    for _ in range(runs):
        t0 = time.perf_counter()
        DBOS.start_workflow(chain, steps).get_result()
        latencies.append(time.perf_counter() - t0)
    delta = settled(url) - before
    DBOS.destroy()
    print(
        json.dumps(
            {
                "latencies": latencies,
                "commits": delta.commits,
                "wal_syncs": delta.wal_syncs,
                "wal_writes": delta.wal_writes,
            }
        )
    )


if __name__ == "__main__":
    main()
