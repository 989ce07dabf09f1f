"""The command line, `celery-workflow …` and `celery -A app workflow …` (one click group, `celery_workflow.cli`).

In process with click's CliRunner on SQLite (and Postgres) Worlds: runs list / show / cancel / watch, JSON output,
errors as exit codes, migrate and redrive / purge progress, the retention sweep, the inspector; the World comes from
``--world`` or, under Celery, from the app's Workflows (Celery hands subcommands an ``obj`` with ``.app``).
As subprocesses: `celery -A cliapp workflow runs list --json` (tests/acceptance/apps/cliapp.py) on SQLite and
Postgres, `celery -A examples.shop workflow runs list`, and `runs watch` following a run a real worker runs.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner, Result

from celery_workflow import Workflows, continue_as_new, create_hook, get_writable
from celery_workflow._backend.migrations import migrations
from celery_workflow.cli import main, workflow
from celery_workflow.dead_letters import dead_letter_store
from celery_workflow.testing import LocalWorker
from celery_workflow.world import Delivery
from celery_workflow.world_sqlite import SQLiteWorld
from tests.acceptance.workers import APPS, Worker, imported_app, postgres_schema, wait_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'cli.sqlite3'}"


@pytest.fixture
def wf(url: str) -> Iterator[Workflows]:
    workflows = Workflows(Celery("cli"), world=url, broker="app")
    yield workflows
    workflows.close()


def invoke(*args: str, obj: Any = None, env: dict[str, str] | None = None) -> Result:
    result = CliRunner().invoke(workflow, list(args), obj=obj, env=env, catch_exceptions=False)
    assert "Traceback" not in result.output
    return result


def cli(url: str, *args: str) -> Result:
    return invoke("--world", url, *args)


def register(wf: Workflows) -> SimpleNamespace:
    """A workflow that completes (with a stream), one that fails, one that waits on a hook."""

    @wf.step
    def double(x: int) -> int:
        get_writable("progress").write({"doubled": x})
        return 2 * x

    @wf.workflow
    def doubler(x: int) -> int:
        return double(x)

    @wf.step(max_retries=0)
    def explode() -> None:
        raise ValueError("boom")

    @wf.workflow
    def fails() -> None:
        explode()

    @wf.workflow
    def waiter() -> None:
        create_hook(token="cli-wait").wait()

    @wf.workflow
    def relay(x: int) -> int:
        if x < 2:
            continue_as_new(x + 1)
        return double(x)

    return SimpleNamespace(doubler=doubler, fails=fails, waiter=waiter, relay=relay)


def test_list_show_cancel(wf: Workflows, url: str) -> None:
    flows = register(wf)
    done = flows.doubler.start(21)
    waiting = flows.waiter.start()
    LocalWorker(wf).run_until_idle()
    assert done.status == "completed" and waiting.status == "running"

    result = cli(url, "runs", "list")
    assert result.exit_code == 0
    assert done.id in result.stdout and waiting.id in result.stdout and "completed" in result.stdout
    result = cli(url, "runs", "list", "--status", "running")
    assert waiting.id in result.stdout and done.id not in result.stdout
    assert cli(url, "runs", "list", "--workflow", "nothing").stdout == "no runs\n"

    result = cli(url, "runs", "show", done.id)
    assert result.exit_code == 0
    assert "output    42" in result.stdout and "step:double:1" in result.stdout and "run_completed" in result.stdout

    result = cli(url, "runs", "show", waiting.id)  # its hook_created: the token stays hidden (issue #26 item 12)
    assert result.exit_code == 0 and "hook_created" in result.stdout and "cli-wait" not in result.stdout

    result = cli(url, "runs", "cancel", waiting.id, "--reason", "not needed")
    assert (result.exit_code, result.stdout) == (0, f"{waiting.id} cancelled\n")
    assert waiting.status == "cancelled"
    assert waiting.events()[-1].data == {"reason": "not needed"}

    result = cli(url, "runs", "cancel", done.id)
    assert result.exit_code == 1 and "completed" in result.stderr


def test_show_names_a_runs_parent_and_children(wf: Workflows, url: str) -> None:
    @wf.workflow
    def kid(n: int) -> int:
        if n < 0:
            create_hook(token="cli-kid").wait()
        return n + 1

    @wf.workflow
    def family(n: int) -> int:
        first = kid.start(n)
        kid.start(-1, parent_close="abandon")
        return int(first.result())

    run = family.start(1)
    worker = LocalWorker(wf)
    worker.run_until(lambda: run.status.terminal)
    assert run.result() == 2
    done, waiting = f"{run.id}!1", f"{run.id}!2"

    text = cli(url, "runs", "show", run.id).stdout
    assert f"  {done:36} kid                  completed\n" in text
    assert f"  {waiting:36} kid                  no end recorded\n" in text
    assert "parent" not in text.split("\n\n")[0]
    shown_json = json.loads(cli(url, "runs", "show", run.id, "--json").stdout)
    assert shown_json["parent_run_id"] is None
    assert shown_json["children"] == [
        {"run_id": done, "workflow_name": "kid", "parent_close": "cancel", "status": "completed"},
        {"run_id": waiting, "workflow_name": "kid", "parent_close": "abandon", "status": None},
    ]
    assert f"parent    {run.id}\n" in cli(url, "runs", "show", waiting).stdout
    assert json.loads(cli(url, "runs", "show", done, "--json").stdout)["parent_run_id"] == run.id


def test_json_output_is_valid_and_complete(wf: Workflows, url: str) -> None:
    flows = register(wf)
    done = flows.doubler.start(21)
    LocalWorker(wf).run_until_idle()

    listed = json.loads(cli(url, "runs", "list", "--json").stdout)
    assert [(r["run_id"], r["workflow_name"], r["status"], r["output"]) for r in listed] == [
        (done.id, "doubler", "completed", 42)
    ]
    shown = json.loads(cli(url, "runs", "show", done.id, "--json").stdout)
    assert shown["run_id"] == done.id and shown["input"] == {"args": [21], "kwargs": {}}
    assert [s["step_id"] for s in shown["steps"]] == ["step:double:1"] and shown["steps"][0]["output"] == 42
    assert shown["events"][0]["event_type"] == "run_created" and shown["events"][-1]["event_type"] == "run_completed"
    assert [e["slot"] for e in shown["events"]] == list(range(1, len(shown["events"]) + 1))
    assert json.loads(cli(url, "runs", "list", "--json", "--status", "failed").stdout) == []


def test_bad_input_is_a_clear_error_and_an_exit_code(wf: Workflows, url: str) -> None:
    for command in ("show", "cancel", "watch"):
        result = cli(url, "runs", command, "wrun_nope")
        assert (result.exit_code, result.stderr) == (1, "Error: no run wrun_nope\n"), command
    result = cli("mysql://nowhere", "runs", "list")
    assert result.exit_code == 2 and "unknown World URL scheme 'mysql'" in result.stderr
    result = cli(url, "runs", "list", "--status", "sleeping")
    assert result.exit_code == 2 and "'sleeping' is not one of" in result.stderr
    result = cli(url, "dead-letters", "redrive")
    assert result.exit_code == 2 and "name dead letter IDs, --queue Q, or --all" in result.stderr
    result = cli(url, "dead-letters", "show", "12345")
    assert result.exit_code == 2 and "12345" in result.stderr


def test_main_is_the_celery_workflow_alias(wf: Workflows, url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    run = register(wf).doubler.start(1)
    out = io.StringIO()
    assert main(["--world", url, "runs", "list"], out=out) == 0 and run.id in out.getvalue()
    monkeypatch.setenv("CELERY_WORKFLOW_URL", url)  # the World without --world
    out = io.StringIO()
    assert main(["runs", "show", run.id], out=out) == 0 and "doubler" in out.getvalue()
    assert main(["runs", "show", "wrun_nope"], out=io.StringIO()) == 1
    assert main(["runs", "list", "--limit", "0"], out=io.StringIO()) == 2
    assert main(["--help"], out=io.StringIO()) == 0


def test_under_celery_the_world_is_the_apps(wf: Workflows, url: str, tmp_path: Path) -> None:
    run = register(wf).doubler.start(3)
    celery_ctx = SimpleNamespace(app=wf.celery_app)  # what `celery -A app` hands its subcommands (CLIContext)
    result = invoke("runs", "list", obj=celery_ctx, env={"CELERY_WORKFLOW_URL": f"sqlite:///{tmp_path / 'other.db'}"})
    assert result.exit_code == 0 and run.id in result.stdout  # the app's World, not $CELERY_WORKFLOW_URL
    other = f"sqlite:///{tmp_path / 'other.db'}"
    SQLiteWorld(tmp_path / "other.db").close()  # a World the commands open must exist (they create none)
    assert invoke("--world", other, "runs", "list", obj=celery_ctx).stdout == "no runs\n"  # --world wins

    result = invoke("runs", "list", obj=SimpleNamespace(app=Celery("bare")))
    assert result.exit_code == 2 and "the Celery app 'bare' has no Workflows" in result.stderr


def test_watch_exits_with_how_the_run_ended(wf: Workflows, url: str) -> None:
    flows = register(wf)
    done, failed, waiting = flows.doubler.start(21), flows.fails.start(), flows.waiter.start()
    LocalWorker(wf).run_until_idle()
    wf.cancel(waiting.id, "no longer needed")

    result = cli(url, "runs", "watch", done.id)
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[0] == '[progress] {"doubled": 21}'
    assert lines[1].split() == ["completed", "steps", "1/1"]
    assert lines[-1] == "output  42"
    result = cli(url, "runs", "watch", failed.id, "--interval", "0.05")
    assert result.exit_code == 1
    assert (
        result.stdout.splitlines()[-1]
        == "error   celery_workflow.errors.StepFailed: step explode failed: ValueError: boom"
    )
    result = cli(url, "runs", "watch", waiting.id)
    assert result.exit_code == 2 and result.stdout.splitlines()[-1] == "cancelled: no longer needed"


def test_watch_follows_a_run_that_continues_as_new(wf: Workflows, url: str) -> None:
    run = register(wf).relay.start(0, run_id="relay")
    LocalWorker(wf).run_until_idle()
    result = cli(url, "runs", "watch", run.id)
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert "run relay continued as relay~1" in lines and "run relay~1 continued as relay~2" in lines
    assert lines[-1] == "output  4"


def test_migrate_shows_progress_and_is_idempotent(url: str, wf: Workflows) -> None:
    fresh = url.replace("cli.sqlite3", "fresh.sqlite3")
    result = cli(fresh, "migrate")
    assert result.exit_code == 0
    known = migrations("sqlite")  # every packaged migration, whatever their number
    latest = known[-1].version
    assert result.stderr.splitlines() == [
        f"creating a new SQLite World at {fresh.removeprefix('sqlite:///')}",
        *(f"migrating: {n}/{len(known)} {m.name}" for n, m in enumerate(known, start=1)),
    ]
    assert result.stdout.startswith(f"schema version 0 -> {latest}: applied 0001_world.sql")
    assert cli(fresh, "runs", "list").stdout == "no runs\n"  # the migrated World works
    assert cli(fresh, "migrate").stdout == f"schema version {latest}: up to date\n"
    result = invoke("migrate", obj=SimpleNamespace(app=wf.celery_app))  # the app's World, migrated when opened
    assert (result.exit_code, result.stdout) == (0, f"schema version {latest}: up to date\n")


def test_dead_letters_json_and_batched_redrive_and_purge(wf: Workflows, url: str) -> None:
    world, store = wf.world, dead_letter_store(wf.world)
    world.enqueue([Delivery("jobs", f'{{"n": {i}}}'.encode()) for i in range(3)])
    for claimed in world.claim(["jobs"], limit=3):
        assert store.dead_letter(claimed.receipt, reason="rejected", error="refused") is not None

    listed = json.loads(cli(url, "dead-letters", "list", "--json").stdout)
    assert [(d["queue"], d["reason"], d["last_error"]) for d in listed] == [("jobs", "rejected", "refused")] * 3
    shown = json.loads(cli(url, "dead-letters", "show", str(listed[0]["id"]), "--json").stdout)
    assert shown["message"] == '{"n": 0}'

    result = cli(url, "dead-letters", "redrive", str(listed[0]["id"]))
    assert (result.exit_code, result.stdout, result.stderr) == (
        0,
        "redrove 1 dead letter\n",
        "redrive dead letters: 1/1\n",
    )
    result = cli(url, "dead-letters", "purge", "--all")
    assert (result.exit_code, result.stdout, result.stderr) == (
        0,
        "purged 2 dead letters\n",
        "purge dead letters: 2/2\n",
    )
    assert cli(url, "dead-letters", "list").stdout == "no dead letters\n"
    assert [c.payload for c in world.claim(["jobs"], limit=3)] == [b'{"n": 0}']  # the redriven one, back once


def test_sweep_expired_needs_a_world_with_retention(url: str, wf: Workflows) -> None:
    result = cli(url, "sweep-expired")
    assert result.exit_code == 2 and "SQLiteWorld has no retention sweep" in result.stderr
    result = cli(url, "outlive-runs")  # the AWS World's command: a SQL World's sweep needs no time to live extended
    assert result.exit_code == 2 and "SQLiteWorld expires runs by its retention sweep" in result.stderr


def test_inspector_serves_the_apps_workflows_or_the_world(
    wf: Workflows, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert "inspector" in invoke("--help").stdout
    assert "--port" in invoke("inspector", "--help").stdout
    inspector = pytest.importorskip("celery_workflow.inspector.server")
    served: list[tuple[Any, str, int, bool]] = []

    def serve(target: Any, host: str, port: int, *, allow_actions: bool) -> None:
        served.append((target, host, port, allow_actions))

    monkeypatch.setattr(inspector, "serve", serve)
    assert invoke("inspector", "--port", "8123", obj=SimpleNamespace(app=wf.celery_app)).exit_code == 0
    assert cli(url, "inspector", "--host", "0.0.0.0", "--allow-actions").exit_code == 0
    assert served[0] == (wf, "127.0.0.1", 8123, False)  # read-only unless asked
    assert type(served[1][0]).__name__ == "SQLiteWorld" and served[1][1:] == ("0.0.0.0", 8000, True)


# -- Postgres ------------------------------------------------------------------------------------------------------


@pytest.fixture
def pg_url() -> Iterator[str]:
    with postgres_schema() as schema_url:
        yield schema_url


def test_postgres_migrate_and_retention_sweep(pg_url: str) -> None:
    result = cli(pg_url, "migrate")
    assert result.exit_code == 0
    known = migrations("postgres")
    assert result.stdout.startswith(f"schema version 0 -> {known[-1].version}")
    assert result.stderr.splitlines()[-1] == f"migrating: {len(known)}/{len(known)} {known[-1].name}"

    from celery_workflow.world_pg import PostgresWorld

    wf = Workflows(Celery("sweep"), world=PostgresWorld.open(pg_url, retention=timedelta(milliseconds=1)))
    try:
        run = register(wf).doubler.start(2)
        LocalWorker(wf).run_until_complete(run)
        celery_ctx = SimpleNamespace(app=wf.celery_app)
        result = invoke("sweep-expired", obj=celery_ctx)
        assert (result.exit_code, result.stdout) == (0, "deleted 1 expired run\n")
        assert result.stderr == "sweeping expired runs …\n"
        assert invoke("runs", "list", obj=celery_ctx).stdout == "no runs\n"
    finally:
        wf.close()
    assert cli(pg_url, "sweep-expired").stdout == "no retention is configured: no run expires\n"


# -- `celery -A app workflow …` in subprocesses --------------------------------------------------------------------


def celery(app: str, env: dict[str, str], *args: str, cwd: Path = APPS) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", app, "workflow", *args],
        cwd=cwd,
        env=subprocess_env(env, cwd),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def subprocess_env(env: dict[str, str], cwd: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{cwd}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **env}


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_celery_subcommand_lists_the_apps_runs(backend: str, tmp_path: Path) -> None:
    if backend == "sqlite":
        check_celery_lists(f"sqlite:///{tmp_path / 'world.sqlite3'}")
        return
    with postgres_schema() as world_url:
        check_celery_lists(world_url)


def check_celery_lists(world_url: str) -> None:
    """`celery -A cliapp workflow runs list --json` on the World of the app (which takes it from the environment)."""
    env = {"CELERY_WORKFLOW_URL": world_url}
    with imported_app("cliapp", env) as app:
        empty = celery("cliapp", env, "runs", "list", "--json")
        assert (empty.returncode, json.loads(empty.stdout or "null")) == (0, []), empty.stderr
        runs = [app.deliver.start("o-1"), app.fails.start()]
        done = celery("cliapp", env, "runs", "list", "--json")
        assert done.returncode == 0, done.stderr
        listed = json.loads(done.stdout)
        assert sorted((r["run_id"], r["workflow_name"], r["status"]) for r in listed) == sorted(
            [(runs[0].id, "deliver", "pending"), (runs[1].id, "fails", "pending")]
        )
        missing = celery("cliapp", env, "runs", "show", "wrun_nope")
        assert (missing.returncode, missing.stderr.strip()) == (1, "Error: no run wrun_nope")


def test_celery_subcommand_on_the_shop_example(tmp_path: Path) -> None:
    env = {"CELERY_WORKFLOW_URL": f"sqlite:///{tmp_path / 'shop.sqlite3'}"}
    done = celery("examples.shop", env, "runs", "list", cwd=ROOT)
    assert (done.returncode, done.stdout) == (0, "no runs\n"), done.stderr


@pytest.mark.acceptance
def test_watch_follows_a_run_a_real_worker_runs(tmp_path: Path) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    env = {"CELERY_WORKFLOW_URL": f"sqlite:///{tmp_path / 'world.sqlite3'}", "CW_MARKERS": str(markers)}
    with imported_app("cliapp", env) as app:
        worker = Worker("cliapp", env, tmp_path / "worker.log", ("-c", "1"))
        try:
            worker.wait_ready()
            run = app.deliver.start("o-7")
            command = ["celery", "-A", "cliapp", "workflow", "runs", "watch", run.id, "--interval", "0.1"]
            lines: list[str] = []
            with subprocess.Popen(
                [sys.executable, "-m", *command],
                cwd=APPS,
                env=subprocess_env(env, APPS),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ) as watch:
                reader = threading.Thread(target=lambda: lines.extend(watch.stdout or ()), daemon=True)
                reader.start()

                def log() -> str:
                    return "".join(lines) + worker.log.read_text()[-3000:]

                try:
                    # the first value comes while the step waits for its go-ahead: the watcher follows the run live
                    wait_for(lambda: '[progress] {"stage": "shipping", "order": "o-7"}\n' in lines, 30, log)
                    assert watch.poll() is None and run.status == "running"
                    (markers / "go-o-7").touch()
                    assert watch.wait(timeout=30) == 0, log() + (watch.stderr.read() if watch.stderr else "")
                    reader.join(timeout=5)
                finally:
                    if watch.poll() is None:
                        watch.kill()
        finally:
            worker.kill()
    text = "".join(lines)
    assert "current step:ship:1 (running)" in text
    assert '[progress] {"stage": "shipped", "order": "o-7"}\n' in text
    assert lines[-2].split() == ["completed", "steps", "2/2"]
    assert lines[-1] == 'output  {"order": "o-7", "label": "label-o-7"}\n'


def test_cancelling_a_child_wakes_its_parent_and_cancelling_a_parent_cancels_its_children(
    wf: Workflows, url: str
) -> None:
    from celery_workflow import RunCancelled

    @wf.workflow
    def held(token: str) -> None:
        create_hook(token=token).wait()

    @wf.workflow
    def family() -> str:
        try:
            held.start("cli-child-a").result()
        except RunCancelled as exc:
            return f"{exc.run_id} cancelled"
        return "done"

    @wf.workflow
    def household() -> None:
        held.start("cli-child-b").result()

    first, second = family.start(run_id="fam"), household.start(run_id="house")
    worker = LocalWorker(wf)
    worker.run_until_idle()
    assert cli(url, "runs", "cancel", "fam!1").exit_code == 0  # the child: its parent is woken and sees it
    worker.run_until_complete(first)
    assert first.result() == "fam!1 cancelled"
    assert cli(url, "runs", "cancel", "house").exit_code == 0  # the parent: its child goes with it
    assert wf.get_run("house!1").status == "cancelled" and second.status == "cancelled"
