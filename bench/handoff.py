"""``python -m bench --scenario handoff``: what standing claims save on the one-step path (issue #13, item 4).

Two workers of the same code run side by side on two schemas, one whose consumer leaves standing claims (a start's
insert hands it the message: no claim) and one with the transport option ``hand_off`` off (it claims each message
after the notification), and the client alternates blocks of one-step runs between them, so both see the same
machine (its speed drifts by tens of percent over minutes). The first of the two to run alternates every round.

``--aa`` runs both with hand-offs on: an A/A control of the method (how far apart two identical setups come out).
``--swap`` puts the setup without hand-offs in the first slot, so an order or schema effect changes sign.
``--workers N`` starts N workers per setup (N idle consumers of the queue: without hand-offs, each start's
notification wakes every one of them and each tries to claim the row; with them, only the one handed the message
wakes).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from types import ModuleType
from typing import Any

from bench.__main__ import ROOT, scratch_schema, with_search_path, worker


def _client(name: str, env: dict[str, str]) -> ModuleType:
    """Another copy of ``bench.cw_app`` (its own Celery app and World), configured by ``env``."""
    os.environ.update(env)
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "cw_app.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench --scenario handoff", description=__doc__)
    p.add_argument(
        "--database-url", default=os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    )
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--block", type=int, default=50, help="runs of one setup before the other's turn")
    p.add_argument("--aa", action="store_true", help="both setups with hand-offs (a control)")
    p.add_argument("--swap", action="store_true", help="the setup without hand-offs first")
    p.add_argument("--workers", type=int, default=1, help="worker processes per setup (idle consumers of the queue)")
    args = p.parse_args(argv)
    logdir = Path(tempfile.mkdtemp(prefix="cw-bench-handoff-"))
    sys.path.insert(0, str(ROOT))
    flags = ("1", "1") if args.aa else ("0", "1") if args.swap else ("1", "0")
    with ExitStack() as stack:
        setups: list[tuple[str, Any]] = []
        for slot, flag in zip("AB", flags, strict=True):
            schema = stack.enter_context(scratch_schema(args.database_url))
            env = {
                "CELERY_WORKFLOW_URL": with_search_path(args.database_url, schema),
                "CW_DURABILITY": "delivery",
                "CW_HAND_OFF": flag,
            }
            client = _client(f"bench_handoff_{slot}", env)
            stack.callback(client.wf.close)
            for n in range(args.workers):
                stack.enter_context(worker("bench.cw_app", env, "prefork", logdir / f"worker-{slot}{n}.log"))
            setups.append((f"{slot}: hand-offs {'on' if flag == '1' else 'off'}", client))
        for _, client in setups:
            for _ in range(20 * args.workers):  # the workers up and warm
                client.one_step.start().result(timeout=60)
        latencies: dict[str, list[float]] = {name: [] for name, _ in setups}
        blocks: dict[str, list[float]] = {name: [] for name, _ in setups}
        for r in range(args.rounds):
            for name, client in setups if r % 2 == 0 else setups[::-1]:
                block = []
                for _ in range(args.block):
                    start = time.perf_counter()
                    client.one_step.start().result(timeout=60)
                    block.append((time.perf_counter() - start) * 1000)
                latencies[name] += block
                blocks[name].append(statistics.median(block))
    (a, _), (b, _) = setups
    print(
        f"{args.rounds} rounds of {args.block} one-step runs per setup, alternating; prefork pool,"
        f" {args.workers} worker process{'es' if args.workers > 1 else ''} per setup\n"
    )
    print("| setup | runs | p50 ms | p90 ms |\n| --- | ---: | ---: | ---: |")
    for name, values in latencies.items():
        q = statistics.quantiles(values, n=10)
        print(f"| {name} | {len(values)} | {statistics.median(values):.3f} | {q[8]:.3f} |")
    diffs = sorted(x - y for x, y in zip(blocks[a], blocks[b], strict=True))
    quarter = len(diffs) // 4
    print(
        f"\n- per round, A - B (p50 of each block): median {statistics.median(diffs):+.3f} ms, middle half"
        f" {diffs[quarter]:+.3f}..{diffs[-quarter - 1]:+.3f} ms ({len(diffs)} rounds)"
    )
    print(f"\n(worker logs: {logdir})")
    return 0
