"""DBOS Transact side of ``python -m bench --scenario inflight``, in its own process:
``python -m bench.dbos_inflight URL CLIENTS SECONDS WARMUP``.

``CLIENTS`` threads each start the 10-step no-op workflow and wait for its result, back to back, for ``WARMUP +
SECONDS``. Prints one JSON line: the latencies of the runs that ended in the measured window, how many ended in all,
how many failed, and the commits and WAL flushes of the whole level.
"""

from __future__ import annotations

import json
import sys

from bench.inflight import drive


def main() -> None:
    url, clients, seconds, warmup = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
    from dbos import DBOS

    from bench.dbos_bench import launch

    chain = launch("cw_bench_inflight", url)
    DBOS.start_workflow(chain, 10).get_result()
    from bench.pgstats import settled

    before = settled(url)
    latencies, total, errors = drive(
        lambda: DBOS.start_workflow(chain, 10).get_result(), clients, seconds, warmup, "DBOS"
    )
    delta = settled(url) - before
    DBOS.destroy()
    print(
        json.dumps(
            {
                "latencies": latencies,
                "total": total,
                "errors": errors,
                "commits": delta.commits,
                "wal_syncs": delta.wal_syncs,
                "wal_writes": delta.wal_writes,
            }
        )
    )


if __name__ == "__main__":
    main()
