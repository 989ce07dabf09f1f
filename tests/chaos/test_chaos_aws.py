"""The short AWS chaos test (issue #31, item 6): ``bench.chaos --world aws`` with small numbers.

Runs with inline and queued steps, durable sleeps and a hook on real prefork Celery workers on the SQS transport,
the World on DynamoDB, both on the project's moto server (DynamoDB requests serialised, issue #33 item 4), while
workers' process groups are SIGKILLed and the workers' boto3 calls meet injected faults (:mod:`bench.aws_faults`):
transactions cancelled for ``TransactionConflict``, throttled requests, SQS messages delivered twice at once; beside
the Celery worker a Lambda poller (:mod:`bench.chaos_lambda`) runs the Lambda queue handler with a 1 s deadline. Every
run must complete with the right output, every step be recorded once, every event log be contiguous, nothing be
dead-lettered. ``python -m bench.chaos --world aws`` runs the same with larger numbers (``bench/RESULTS.md``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.chaos import Config, run_chaos

pytestmark = [pytest.mark.acceptance, pytest.mark.chaos]


@pytest.mark.timeout(120)
def test_chaos_aws(tmp_path: Path) -> None:
    cfg = Config(
        world="aws",
        runs=5,
        workers=1,
        lambdas=1,
        lambda_deadline=1.0,
        concurrency=2,
        steps=3,
        nap=0.5,
        duration=6.0,
        kill_every=2.0,
        lease=2.0,
        settle=60.0,
        exit_limit=30.0,
        exit_wait=20.0,
        logdir=tmp_path / "chaos",
        faults="conflict=0.2,throttle=0.08,dup=0.2",  # throttle: 0.03 of ~150 calls gives none 1 run in 100
    )
    figures = run_chaos(cfg)
    report = f"{figures.table()}\nfailures: {figures.failures}\nlogs: {figures.logdir}"
    print(report)
    assert figures.kills >= 1, report
    assert figures.injected["conflict"] > 0, report
    assert figures.injected["throttle"] > 0, report
    assert figures.injected["dup"] > 0, report
    assert figures.lost == 0, report
    assert figures.duplicated == 0, report
    assert figures.wrong_output == 0, report
    assert figures.gaps == 0, report
    assert figures.dead_letters == 0, report
    assert figures.completed == figures.runs, report
