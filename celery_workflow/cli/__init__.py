"""The command line: ``celery -A app workflow …``, and ``celery-workflow …`` (the same commands).

    workflow runs list [--workflow W] [--status S] [--limit N] [--json]    runs, newest first
    workflow runs show RUN_ID [--json]                                    a run, its steps and its events
    workflow runs cancel RUN_ID [--reason R]                              cancel a run
    workflow runs watch RUN_ID [--interval S]                             follow a run live (exit 0/1/2: completed,
                                                                          failed, cancelled)
    workflow dead-letters list|show ID|redrive [--queue Q] [ID…]|purge    messages no consumer could process
    workflow scheduled [--queue Q] [--limit N] [--json]                   countdown/ETA tasks held until due
    workflow schedules list|show ID|pause ID|resume ID|delete ID [--json] the World's cron schedules
    workflow relay [--queue Q] [--once]                                   publish due deliveries to the app's broker
    workflow migrate                                                      apply the World's schema migrations
    workflow sweep-expired                                                delete the runs past their retention
    workflow outlive-runs [--workflow W]                                  AWS: ended runs get a lengthened retention
    workflow create-table NAME                                            the AWS World's DynamoDB table
    workflow provision NAME [--queue KEY] [--fifo-queue KEY]              the AWS World's table and queues (export lines)
    workflow inspector [--host H] [--port 8000]                           serve the run inspector
    workflow demo                                                         the example workflow on a real worker

:data:`workflow` is a click group, registered as a Celery subcommand through the ``celery.commands`` entry point
group, so ``celery -A app workflow …`` works on the World of the app's :class:`~celery_workflow.app.Workflows`.
``celery-workflow`` (:func:`main`) runs the same group on ``--world URL``, else ``$CELERY_WORKFLOW_URL``, else
``sqlite:///celery_workflow.sqlite3``; ``--world`` also overrides the app's World under Celery. See
:mod:`celery_workflow.cli.session` for exit codes and where output goes.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext, redirect_stdout
from typing import Any, TextIO

import click

from celery_workflow.cli.admin import create_table, demo, inspector, migrate, outlive_runs, provision, sweep_expired
from celery_workflow.cli.dead_letters import dead_letters
from celery_workflow.cli.relay import relay
from celery_workflow.cli.runs import runs
from celery_workflow.cli.scheduled import scheduled
from celery_workflow.cli.schedules import schedules
from celery_workflow.cli.session import Session, WorkflowGroup

__all__ = ["main", "workflow"]


@click.group("workflow", cls=WorkflowGroup)
@click.option(
    "--world",
    metavar="URL",
    help="The World: sqlite:///path, postgresql://…, aws:// (from WORKFLOW_*). Default: the Celery app's (under"
    " `celery -A app workflow`), else $CELERY_WORKFLOW_URL, else sqlite:///celery_workflow.sqlite3.",
)
@click.pass_context
def workflow(ctx: click.Context, world: str | None) -> None:
    """Durable workflows on Celery: runs, dead letters, schema migrations, the run inspector."""
    session = Session.from_context(ctx.obj, world)
    ctx.obj = session
    ctx.call_on_close(session.close)


for _command in (
    runs,
    dead_letters,
    scheduled,
    schedules,
    relay,
    migrate,
    sweep_expired,
    outlive_runs,
    create_table,
    provision,
    inspector,
    demo,
):
    workflow.add_command(_command)


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """``celery-workflow``: run the :data:`workflow` group on ``argv`` (default: the process's arguments) and
    return its exit code; ``out`` takes what it prints on stdout (default: stdout)."""
    with redirect_stdout(out) if out is not None else nullcontext():
        try:
            code: Any = workflow.main(
                args=list(argv) if argv is not None else None, prog_name="celery-workflow", standalone_mode=False
            )
        except click.ClickException as exc:
            exc.show()
            return exc.exit_code
        except click.Abort:
            click.echo("Aborted!", err=True)
            return 130
    return code if isinstance(code, int) else 0
