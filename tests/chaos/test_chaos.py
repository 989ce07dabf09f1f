"""The short chaos test (issue #12): ``bench.chaos`` with small numbers, on the SQLite and the Postgres World.

Runs with steps, sleeps and hooks on real prefork workers while a worker's process group is SIGKILLed every few
seconds (and, on Postgres, a private throwaway cluster is restarted, ``pg_ctl restart -m immediate``); then every
run must have completed with the right output, every step must be recorded once, every event log must be contiguous,
no delivery may be dead-lettered, and every worker must exit within 30 s of a SIGTERM to its process group.
``python -m bench.chaos`` runs the same with larger numbers (figures in ``bench/RESULTS.md``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bench.chaos import Config, Figures, run_chaos

pytestmark = [pytest.mark.acceptance, pytest.mark.chaos]


def chaos(world: str, tmp_path: Path) -> Figures:
    cfg = Config(
        world=world,
        runs=10,
        workers=2,
        concurrency=2,
        steps=3,
        nap=0.5,
        duration=20.0,
        kill_every=3.0,
        restart_every=5.0,
        lease=2.0,
        settle=90.0,
        term="group",
        exit_limit=30.0,
        exit_wait=32.0,
        logdir=tmp_path / "chaos",
    )
    return run_chaos(cfg)


@pytest.mark.timeout(280)
@pytest.mark.parametrize("world", ["sqlite", "postgres"])
def test_chaos(world: str, tmp_path: Path) -> None:
    if world == "postgres" and not (shutil.which("initdb") or list(Path("/usr/lib/postgresql").glob("*/bin/initdb"))):
        pytest.skip("no initdb: the Postgres chaos test needs a private cluster (it restarts it)")
    figures = chaos(world, tmp_path)
    report = f"{figures.table()}\nfailures: {figures.failures}\nlogs: {figures.logdir}"
    print(report)
    assert figures.kills >= 3, report
    if world == "postgres":
        assert figures.database.startswith("private cluster"), report
        assert figures.restarts >= 2, report
    assert figures.lost == 0, report
    assert figures.wrong_output == 0, report
    assert figures.duplicated == 0, report
    assert figures.gaps == 0, report
    assert figures.dead_letters == 0, report
    assert figures.completed == figures.runs, report
    assert all(s.main_exit is not None and s.main_exit < 30.0 for s in figures.stops), report
    assert figures.failures == [], report
