"""Workflows on real `celery -A wfapp worker` processes, on the SQLite, Postgres and AWS Worlds (the AWS World's
workers on the SQS transport, against a moto server, with Redis carrying remote control and events).

One worker serves the default queue for most tests; tests that need a worker of their own (one slot, a kill,
routing) use a queue only their worker consumes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from celery_workflow import RunCancelled, WorkflowFailed
from celery_workflow.events import EventType
from tests.integration.aws_fixtures import moto_fixture  # noqa: F401

from .workers import APPS, Worker, aws_environment, imported_app, postgres_schema

pytestmark = pytest.mark.acceptance


@pytest.fixture(scope="module", params=["sqlite", "postgres", "aws"])
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The World the workers and the client share: an embedded SQLite file, a Postgres schema of its own, or an AWS
    World (DynamoDB, SQS, Scheduler on a moto server; Redis as the control channel) of its own."""
    base = tmp_path_factory.mktemp(f"wf-{request.param}")
    markers = base / "markers"
    markers.mkdir()
    common = {"CW_MARKERS": str(markers), "CW_LEASE": "60"}
    if request.param == "sqlite":
        yield {"CELERY_WORKFLOW_URL": f"sqlite:///{base / 'world.sqlite3'}", **common}
        return
    if request.param == "aws":
        with aws_environment(request.getfixturevalue("moto")) as aws:
            yield {**aws, **common}
        return
    with postgres_schema() as url:
        yield {"CELERY_WORKFLOW_URL": url, **common}


@pytest.fixture(scope="module")
def app(env: dict[str, str]) -> Iterator[ModuleType]:
    """The wfapp module imported in the test process (the client side), bound to this module's World."""
    with imported_app("wfapp", env) as module:
        yield module


def start_worker(env: dict[str, str], log: Path, *args: str, **extra: str) -> Worker:
    worker = Worker("wfapp", {**env, **extra}, log, args)
    worker.wait_ready()
    return worker


@pytest.fixture(scope="module")
def worker(app: ModuleType, env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    w = start_worker(
        env, tmp_path_factory.mktemp("logs") / "main-worker.log", "-c", "2", "-Q", "celery", "-n", "main@%h"
    )
    yield w
    w.stop()


def markers(env: dict[str, str]) -> Path:
    return Path(env["CW_MARKERS"])


def wait_for(predicate: object, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def event_counts(run: object) -> Counter[str]:
    return Counter(e.event_type.value for e in run.events())  # type: ignore[attr-defined]


def test_sequential_steps(app: ModuleType, worker: Worker) -> None:
    run = app.sequential.start(5)
    assert run.result(timeout=30) == 10
    assert event_counts(run)["step_completed"] == 5


def test_a_runs_first_delivery_reads_its_log_once(app: ModuleType, worker: Worker, env: dict[str, str]) -> None:
    """Nothing a message carries is trusted: the worker reads the run before it runs anything, once."""
    for padding in ("", "x" * 5000):
        run = app.sequential.start(1, run_id=f"noted-{len(padding)}-{time.monotonic_ns()}", padding=padding)
        assert run.result(timeout=30) == 0
        assert (Path(env["CW_MARKERS"]) / f"reads-{run.id}").read_text().splitlines() == ["read"]


def test_runs_cancelled_before_their_first_delivery_run_no_step(
    app: ModuleType, env: dict[str, str], tmp_path: Path
) -> None:
    """Issue #26 item 1: runs cancelled while their first delivery waits (the worker busy) run no step, though the
    step is known quick in that worker (it ran a moment before)."""
    for name in ("killable", "marking"):
        app.wf.route(name, "backfill")
    log = tmp_path / "cancel.log"
    solo = start_worker(env, log, "-c", "1", "-Q", "backfill", "-n", "cancel@%h")
    try:
        assert app.marking.start("warm").result(timeout=30) == "warm"
        busy = app.killable.start("busy-cancel")
        wait_for((markers(env) / "slow-busy-cancel-started-1").exists, what="the worker to be busy")
        runs = [app.marking.start(f"cancelled-{i}") for i in range(4)]
        for run in runs:
            run.cancel()
        (markers(env) / "slow-busy-cancel-release").touch()
        assert busy.result(timeout=30) == "busy-cancel@1"
        wait_for(lambda: log.read_text().count(": 'ended'") >= len(runs), what="the cancelled runs' deliveries")
        assert sorted(p.name for p in markers(env).glob("mark-cancelled-*")) == []
        for run in runs:
            with pytest.raises(RunCancelled):
                run.result(timeout=1)
    finally:
        solo.stop()
        for name in ("killable", "marking"):
            app.wf.routes.pop(name, None)


def test_continue_as_new_hands_over_to_fresh_runs(app: ModuleType, worker: Worker) -> None:
    run = app.counting.start(8)
    assert run.result(timeout=30) == 28
    chain = [run.id]
    while (successor := app.wf.get_run(chain[-1]).continued_as) is not None:
        chain.append(successor)
    assert chain == [run.id, f"{run.id}~1", f"{run.id}~2"]
    assert [event_counts(app.wf.get_run(r))["step_completed"] for r in chain] == [3, 3, 2]


def test_retries(app: ModuleType, worker: Worker) -> None:
    run = app.retrying.start(2)
    assert run.result(timeout=30) == 3
    assert event_counts(run)["step_retrying"] == 2


def test_fatal_error_caught_in_the_workflow(app: ModuleType, worker: Worker) -> None:
    run = app.catches_fatal.start()
    assert run.result(timeout=30) == "caught: card declined"
    assert run.steps()[0].attempt == 1


def test_failed_run(app: ModuleType, worker: Worker) -> None:
    run = app.fails.start()
    with pytest.raises(WorkflowFailed, match="broken step"):
        run.result(timeout=30)
    assert run.status == "failed"


def test_hook_resumed_from_another_process(app: ModuleType, worker: Worker, env: dict[str, str]) -> None:
    run = app.waits_for_hook.start("hook-from-outside")
    wait_for(lambda: app.wf.world.list_hooks(run.id), what="the hook")
    code = "import wfapp; wfapp.wf.resume_hook('hook-from-outside', {'approved': True})"
    subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env, "PYTHONPATH": str(APPS)},
        check=True,
        timeout=60,
    )
    assert run.result(timeout=30) == {"approved": True}


def test_parallel_steps(app: ModuleType, worker: Worker) -> None:
    run = app.parallel.start()
    assert run.result(timeout=60) == ["left", "right"]


def test_stream_is_read_while_it_is_written(app: ModuleType, worker: Worker, env: dict[str, str]) -> None:
    run = app.streaming.start(4)
    seen = []
    for value in run.stream("ticks", timeout=60):
        seen.append(value)
        (markers(env) / f"tick-{value['tick']}-read").touch()  # the step waits for this before writing more
    assert seen == [{"tick": i} for i in range(4)]
    run.result(timeout=30)


def test_cancel(app: ModuleType, worker: Worker) -> None:
    run = app.waits_for_hook.start("to-cancel")
    wait_for(lambda: app.wf.world.list_hooks(run.id), what="the hook")
    run.cancel()
    with pytest.raises(RunCancelled):
        run.result(timeout=10)
    assert not app.wf.world.list_hooks(run.id)


def test_idempotent_start(app: ModuleType, worker: Worker) -> None:
    first = app.sequential.start(3, run_id="acceptance-idempotent")
    second = app.sequential.start(3, run_id="acceptance-idempotent")
    assert first.id == second.id
    assert first.result(timeout=30) == 3
    third = app.sequential.start(3, run_id="acceptance-idempotent")
    assert third.result(timeout=5) == 3
    assert event_counts(first)["run_created"] == 1


def test_plain_celery_task(app: ModuleType, worker: Worker, tmp_path: Path) -> None:
    target = tmp_path / "plain.txt"
    app.celery_app.send_task("wfapp.plain", args=[str(target), "hello"])
    wait_for(target.exists, what="the plain task")
    assert target.read_text() == "hello"


def test_celery_inspect_ping(app: ModuleType, worker: Worker, env: dict[str, str]) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "wfapp", "inspect", "ping", "--timeout", "5"],
        cwd=APPS,
        env={**os.environ, **env, "PYTHONPATH": str(APPS)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "pong" in out.stdout, out.stdout + out.stderr


def test_sleep_does_not_hold_the_only_slot(app: ModuleType, env: dict[str, str], tmp_path: Path) -> None:
    solo = start_worker(env, tmp_path / "solo.log", "-c", "1", "-Q", "backfill", "-n", "solo@%h")
    try:
        app.wf.route("sleeper", "backfill")  # later runs of sleeper go to the one-slot worker's queue
        sleeping = app.sleeper.start(4.0)
        assert sleeping.view().queue == "backfill"
        wait_for(lambda: app.wf.world.list_waits(sleeping.id), what="the sleep to start")
        quick = app.backfill.start(41)  # routed to backfill too: needs the same (only) slot
        assert quick.result(timeout=30) == 42
        assert sleeping.status == "running"  # still asleep, yet the slot was free
        assert sleeping.result(timeout=30) == "woke"
    finally:
        app.wf.routes.pop("sleeper", None)
        solo.stop()


def test_routed_workflow_is_left_alone_by_other_queues(
    app: ModuleType, worker: Worker, env: dict[str, str], tmp_path: Path
) -> None:
    run = app.backfill.start(1)
    probe = app.sequential.start(2)  # the default-queue worker is alive and working …
    assert probe.result(timeout=30) == 1
    assert run.status == "pending"  # … but never touches the backfill queue
    backfill = start_worker(env, tmp_path / "backfill.log", "-c", "1", "-Q", "backfill", "-n", "backfill@%h")
    try:
        assert run.result(timeout=30) == 2
    finally:
        backfill.stop()


def test_a_worker_asked_for_an_unknown_sqs_queue_refuses_to_start(env: dict[str, str], tmp_path: Path) -> None:
    """On the AWS World queues come from Terraform: a worker told to consume a name the config does not know exits
    with an error that says so, and creates nothing."""
    if env["CELERY_WORKFLOW_URL"] != "aws://":
        pytest.skip("the SQL Worlds' transports declare queues on demand")
    log = tmp_path / "nowhere.log"
    worker = Worker("wfapp", env, log, ("-c", "1", "-Q", "nowhere", "-n", "nowhere@%h"))
    try:
        code = worker.proc.wait(timeout=60)
    finally:
        worker.kill()
    text = log.read_text()
    assert code != 0, text[-3000:]
    assert "nowhere" in text and "never created on the fly" in text, text[-3000:]


def test_worker_killed_mid_step_is_recovered_by_another(app: ModuleType, env: dict[str, str], tmp_path: Path) -> None:
    short = {"CW_LEASE": "3"}
    app.wf.route("killable", "backfill")
    try:
        first = start_worker(env, tmp_path / "first.log", "-c", "1", "-Q", "backfill", "-n", "first@%h", **short)
        run = app.killable.start("k1")
        assert run.view().queue == "backfill"
        wait_for((markers(env) / "slow-k1-started-1").exists, what="the step to start")
        first.kill()
        second = start_worker(env, tmp_path / "second.log", "-c", "1", "-Q", "backfill", "-n", "second@%h", **short)
        try:
            wait_for((markers(env) / "slow-k1-started-2").exists, timeout=60, what="the step to run again")
            (markers(env) / "slow-k1-release").touch()
            assert run.result(timeout=30) == "k1@2"
        finally:
            second.stop()
    finally:
        app.wf.routes.pop("killable", None)
    events = run.events()
    assert Counter(e.event_type for e in events)[EventType.STEP_COMPLETED] == 1
    assert [e.slot for e in events] == list(range(1, len(events) + 1))
    assert run.steps()[0].attempt == 2


def test_divergence_fails_the_run_after_bounded_redeliveries(
    app: ModuleType, worker: Worker, env: dict[str, str]
) -> None:
    run = app.diverges.start("dv-1")
    wait_for(lambda: app.wf.world.list_hooks(run.id), what="the hook")
    (markers(env) / "diverge-dv-1").touch()
    app.wf.resume_hook("dv-1", "go")
    with pytest.raises(WorkflowFailed, match="step:first_step:1"):
        run.result(timeout=60)  # retried with the transport's backoff (1 s, 2 s, 4 s), then failed
    failed = [e for e in run.events() if e.event_type is EventType.RUN_FAILED]
    assert failed[0].data["code"] == "REPLAY_DIVERGENCE"


def _flower_api(port: int, path: str) -> Any:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


def test_flower_lists_the_workflow_and_step_deliveries_of_a_run(
    app: ModuleType, worker: Worker, env: dict[str, str], tmp_path: Path
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = (tmp_path / "flower.log").open("wb")
    flower = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "wfapp", "flower", "--address=127.0.0.1", f"--port={port}"],
        cwd=APPS,
        env={**os.environ, **env, "PYTHONPATH": str(APPS), "FLOWER_UNAUTHENTICATED_API": "1"},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        try:
            # Flower inspects the workers once, when it starts, and again only when asked (refresh): a worker that
            # missed the first inspect's one-second timeout would otherwise stay unlisted
            wait_for(
                lambda: "main@" in json.dumps(_flower_api(port, "/api/workers?refresh=1") or {}),
                60,
                "Flower to see the worker",
            )
        except AssertionError as exc:
            log.flush()
            raise AssertionError(f"{exc}\n{(tmp_path / 'flower.log').read_text()[-4000:]}") from None

        def deliveries(run_id: str) -> list[dict[str, Any]]:
            tasks = _flower_api(port, "/api/tasks") or {}
            return [t for t in tasks.values() if run_id in str(t.get("args")) and t.get("state") == "SUCCESS"]

        # Flower binds its event queue a moment after it answers: a run that ends before then is never seen by it,
        # so start runs until one is listed whole
        deadline = time.monotonic() + 90
        while True:
            run = app.fan.start(3)
            assert run.result(timeout=30) == [0, 2, 4]
            seen_until = time.monotonic() + 5
            while time.monotonic() < seen_until and len(deliveries(run.id)) < 5:
                time.sleep(0.1)
            if len(deliveries(run.id)) >= 5 or time.monotonic() > deadline:
                break
        names = [t["name"] for t in deliveries(run.id)]
        assert names.count("step.add") == 3, names  # one delivery per parallel step …
        assert "workflow.fan" in names  # … and the workflow's own deliveries, each showing the run id
    finally:
        os.killpg(flower.pid, signal.SIGKILL)
        flower.wait(timeout=10)
        log.close()


def test_runs_complete_when_every_database_connection_is_killed(
    app: ModuleType, worker: Worker, env: dict[str, str]
) -> None:
    url = env["CELERY_WORKFLOW_URL"]
    if not url.startswith("postgresql"):
        pytest.skip("a Postgres outage test")
    from tests.integration import pg_fixtures

    schema = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)["application_name"][0]
    runs = [app.sequential.start(4) for _ in range(20)]
    wait_for(lambda: sum(r.status == "completed" for r in runs) >= 3, 60, "some runs to complete")
    killed = 0
    with pg_fixtures.admin_connection() as admin:
        for _ in range(2):
            done = sum(r.status == "completed" for r in runs)
            killed += pg_fixtures.terminate_backends(admin, schema)
            if done < len(runs):  # the workers got going again before the second outage
                wait_for(lambda d=done: sum(r.status == "completed" for r in runs) > d, 90, "progress after the outage")
    assert killed > 0
    assert [r.result(timeout=90) for r in runs] == [6] * 20
