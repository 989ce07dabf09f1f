"""The commands around the runs: ``demo``, ``migrate``, ``sweep-expired``, ``create-table``, ``provision`` and
``inspector``.

* ``migrate`` applies the World's pending schema migrations one by one (each in its own transaction, recorded with
  its version, so an interrupted migration resumes where it stopped), with progress. ``celery-workflow migrate``
  opens the World without migrating it first; under ``celery -A app workflow`` the app's Workflows opened (and so
  migrated) its World already, unless it was opened with ``migrate=False``. Worlds without a schema (AWS) say so.
* ``sweep-expired`` deletes the ended runs past their retention, as the World's own configuration sets it
  (``PostgresConfig(retention=…)``): run it as ``celery -A app workflow sweep-expired``.
* ``outlive-runs`` gives the AWS World's ended runs the later time to live a lengthened retention says
  (:func:`celery_workflow._aws.retention.outlive_runs`).
* ``provision`` creates an AWS World's table and queues as the Terraform module names them and prints their
  environment as ``export`` lines (:func:`celery_workflow._aws.provision.provision`): the path to an emulator.
* ``inspector`` serves the run inspector (:func:`celery_workflow.inspector.server.serve`) until interrupted.
"""

from __future__ import annotations

import json
import shlex
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import click

from celery_workflow.cli.session import BadInput, Progress, Session, is_tty
from celery_workflow.errors import ConfigurationError
from celery_workflow.world import World

__all__ = ["create_table", "demo", "inspector", "migrate", "outlive_runs", "provision", "sweep_expired"]

T = TypeVar("T")

pass_session = click.make_pass_decorator(Session)


@click.command()
@click.option("--timeout", type=click.FloatRange(min=1), default=120.0, show_default=True, help="Seconds.")
@pass_session
def demo(session: Session, timeout: float) -> None:
    """Run the example workflow on a real worker, on --world (default: the embedded SQLite file)."""
    from celery_workflow.demo_runner import run_demo

    raise click.exceptions.Exit(run_demo(session.resolved_url(), out=sys.stdout, timeout=timeout))


def _dialect(world: World) -> str | None:
    """The SQL dialect of the World's migrations, or None for a World without a schema of ours."""
    from celery_workflow.world_sqlite import SQLiteWorld

    if isinstance(world, SQLiteWorld):
        return "sqlite"
    try:
        from celery_workflow.world_pg import PostgresWorld
    except ConfigurationError:  # no psycopg: not a Postgres World either
        return None
    return "postgres" if isinstance(world, PostgresWorld) else None


@click.command()
@pass_session
def migrate(session: Session) -> None:
    """Apply the World's pending schema migrations, with progress."""
    from celery_workflow._backend.migrations import migrations

    world = session.world_for_migration()
    dialect = _dialect(world)
    if dialect is None:
        click.echo(f"{type(world).__name__} has no schema migrations")
        return
    db: Any = getattr(world, "db")  # noqa: B009 - SQLiteWorld.db / PostgresWorld.db, both with migrate(up_to=…)
    current = int(db.migrate(up_to=0))  # applies nothing: reads the version (refusing a newer schema)
    pending = [m for m in migrations(dialect) if m.version > current]
    if not pending:
        click.echo(f"schema version {current}: up to date")
        return
    with Progress("migrating", len(pending)) as progress:
        for migration in pending:
            db.migrate(up_to=migration.version)
            progress.advance(1, migration.name)
    click.echo(f"schema version {current} -> {pending[-1].version}: applied {', '.join(m.name for m in pending)}")


@click.command("sweep-expired")
@pass_session
def sweep_expired(session: Session) -> None:
    """Delete the ended runs past the World's retention (PostgresConfig(retention=…))."""
    world = session.world
    sweep = getattr(world, "sweep_expired", None)
    if not callable(sweep):
        raise BadInput(f"{type(world).__name__} has no retention sweep")
    if not getattr(getattr(world, "config", None), "expires_runs", True):
        click.echo("no retention is configured: no run expires")
        return
    deleted = int(_with_ticker("sweeping expired runs", sweep))
    click.echo(f"deleted {deleted} expired run{'s' * (deleted != 1)}")


def _with_ticker(label: str, work: Callable[[], T]) -> T:
    """``work()``, with ``label`` and the seconds spent redrawn on stderr while it runs when stderr is a terminal
    (the sweep reports no count before it ends), else the label once."""
    if not is_tty(sys.stderr):
        click.echo(f"{label} …", err=True)
        return work()
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(work())
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, name="celery_workflow-cli", daemon=True)
    started = time.monotonic()
    thread.start()
    while thread.is_alive():
        click.echo(f"\r\x1b[K{label} … {time.monotonic() - started:.1f} s", nl=False, err=True)
        thread.join(0.2)
    click.echo(f"\r\x1b[K{label} … done in {time.monotonic() - started:.1f} s", err=True)
    if failure:
        raise failure[0]
    return result[0]


@click.command("outlive-runs")
@click.option("--workflow", metavar="W", help="Only the runs of this workflow.")
@pass_session
def outlive_runs(session: Session, workflow: str | None) -> None:
    """After lengthening a retention on the AWS World: give the ended runs whose time to live ends before their
    retention now says the later one (a run's end sets its items' time to live and queues nothing that would come
    back to it). Reads every run's META once."""
    world = session.world
    outlive = getattr(world, "outlive_runs", None)
    if not callable(outlive):
        raise BadInput(f"{type(world).__name__} expires runs by its retention sweep: it has no time to live to extend")
    extended = int(_with_ticker("extending the runs' time to live", lambda: outlive(workflow)))
    click.echo(f"extended {extended} run{'s' * (extended != 1)}")


@click.command("create-table")
@click.argument("name")
@click.option("--timeout", type=click.FloatRange(min=1), default=300.0, show_default=True, help="Seconds to wait.")
@click.option(
    "--rebuild-indexes",
    "rebuild",
    is_flag=True,
    help="Rebuild the indexes of an existing table that an earlier version created with another projection.",
)
def create_table(name: str, timeout: float, rebuild: bool) -> None:
    """Create the AWS World's DynamoDB table NAME (the Terraform module's WORKFLOW_TABLE) and wait until it is
    active; a DynamoDB client from the environment (region, credentials, AWS_ENDPOINT_URL). An existing table is
    kept; with --rebuild-indexes its indexes of an earlier version are deleted and built again (listings by
    workflow fail until the rebuilt index is active)."""
    try:
        import boto3

        from celery_workflow.world_sqs import create_table as create
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise BadInput("create-table needs boto3: pip install 'celery-workflow[aws]'") from exc
    click.echo(f"creating DynamoDB table {name} (waiting until it is active) …")
    create(boto3.client("dynamodb"), name, timeout=timeout, rebuild=rebuild)
    click.echo(f"table {name} is active")


@click.command("provision")
@click.argument("name")
@click.option("--queue", "queues", multiple=True, metavar="KEY", help="A routed queue <NAME>-<KEY> (repeat).")
@click.option("--fifo-queue", "fifo_queues", multiple=True, metavar="KEY", help="A FIFO routed queue (repeat).")
@click.option(
    "--scheduler-role-arn",
    metavar="ARN",
    help="Create the schedule group NAME and configure the Scheduler with this role (FIFO queues need it).",
)
@click.option("--max-receive-count", type=click.IntRange(1, 1000), default=10, show_default=True)
@click.option("--visibility-timeout", type=click.IntRange(0, 43200), default=360, show_default=True, help="Seconds.")
@click.option(
    "--wait",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    help="Seconds to wait for the endpoint to answer (an emulator just started).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the environment as a JSON object.")
def provision(  # click passes every option by keyword
    *,
    name: str,
    queues: tuple[str, ...],
    fifo_queues: tuple[str, ...],
    scheduler_role_arn: str | None,
    max_receive_count: int,
    visibility_timeout: int,
    wait: float,
    as_json: bool,
) -> None:
    """Create an AWS World's table NAME, its task queue NAME-tasks and the routed queues NAME-KEY (each with a
    dead-letter queue), named as the Terraform module names them, then print the World's environment as export lines
    (with CELERY_WORKFLOW_URL=aws://): eval "$(celery-workflow provision NAME --queue backfill)". boto3 clients from the
    environment (region, credentials, AWS_ENDPOINT_URL). Idempotent; no IAM: for a real account use terraform/."""
    try:
        import boto3

        from celery_workflow._aws.provision import provision as make
        from celery_workflow._aws.provision import wait_for_endpoint
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise BadInput("provision needs boto3: pip install 'celery-workflow[aws]'") from exc
    overlap = set(queues) & set(fifo_queues)
    if overlap:
        raise BadInput(f"queue {sorted(overlap)[0]!r} given both as --queue and --fifo-queue")
    dynamodb = boto3.client("dynamodb")
    try:
        wait_for_endpoint(dynamodb, wait)
        environment = make(
            name,
            {**dict.fromkeys(queues, False), **dict.fromkeys(fifo_queues, True)},
            dynamodb=dynamodb,
            sqs=boto3.client("sqs"),
            scheduler=boto3.client("scheduler") if scheduler_role_arn else None,
            scheduler_role_arn=scheduler_role_arn,
            max_receive_count=max_receive_count,
            visibility_timeout=visibility_timeout,
        )
    except ConfigurationError as exc:
        raise BadInput(str(exc)) from exc
    environment = {"CELERY_WORKFLOW_URL": "aws://", **environment}
    click.echo(
        f"provisioned table {name} and queues {name}-tasks" + "".join(f", {name}-{k}" for k in (*queues, *fifo_queues)),
        err=True,
    )
    if as_json:
        click.echo(json.dumps(environment, indent=2))
    else:
        for key, value in environment.items():
            click.echo(f"export {key}={shlex.quote(value)}")


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="Port to listen on.")
@click.option(
    "--allow-actions",
    is_flag=True,
    help="Let whoever reaches it reveal hook tokens, cancel runs, resume hooks and redrive dead letters"
    " (read-only without it; mind --host).",
)
@pass_session
def inspector(session: Session, host: str, port: int, allow_actions: bool) -> None:
    """Serve the run inspector (runs, timeline, events, streams) until interrupted."""
    try:
        from celery_workflow.inspector.server import serve
    except ImportError as exc:
        raise click.ClickException(f"the run inspector is not available: {exc}") from exc
    click.echo(f"run inspector on http://{host}:{port}/ (Ctrl-C stops it)", err=True)
    try:
        serve(session.target(), host, port, allow_actions=allow_actions)
    except KeyboardInterrupt:
        raise click.exceptions.Exit(130) from None
