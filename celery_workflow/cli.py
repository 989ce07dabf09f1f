"""``celery-workflow``: the demo, and inspecting and cancelling runs.

    celery-workflow demo                     run the example workflow on a worker, on the embedded default World
    celery-workflow runs list [--status S]   runs, newest first
    celery-workflow runs show RUN_ID         a run, its steps and its events
    celery-workflow runs cancel RUN_ID       cancel a run
    celery-workflow dead-letters list|show ID|redrive [--queue Q] [ID…]|purge
                                             messages no consumer could process (:mod:`.cli_dead_letters`)
    celery-workflow create-table NAME        create the AWS World's DynamoDB table and wait until it is active

The World is ``--world URL``, else ``$CELERY_WORKFLOW_URL``, else ``sqlite:///celery_workflow.sqlite3``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from celery_workflow import cli_dead_letters
from celery_workflow.app import DEFAULT_URL
from celery_workflow.errors import CeleryWorkflowError, ConfigurationError, RunTerminal
from celery_workflow.events import EventType, NewEvent, RunStatus
from celery_workflow.world import World, open_world


def _world(args: argparse.Namespace) -> World:
    return open_world(args.world or os.environ.get("CELERY_WORKFLOW_URL") or DEFAULT_URL)


def _short(value: Any, width: int = 60) -> str:
    text = json.dumps(value, default=str, separators=(",", ":"))
    return text if len(text) <= width else text[: width - 1] + "…"


def cmd_runs_list(args: argparse.Namespace, out: TextIO) -> int:
    world = _world(args)
    page = world.list_runs(workflow=args.workflow, status=args.status, limit=args.limit)
    if not page.items:
        print("no runs", file=out)
        return 0
    print(f"{'RUN ID':32} {'WORKFLOW':24} {'STATUS':10} CREATED", file=out)
    for run in page.items:
        print(
            f"{run.run_id:32} {run.workflow_name:24} {run.status.value:10} {run.created_at:%Y-%m-%d %H:%M:%S}", file=out
        )
    return 0


def cmd_runs_show(args: argparse.Namespace, out: TextIO) -> int:
    world = _world(args)
    run = world.get_run(args.run_id)
    print(f"run       {run.run_id}", file=out)
    print(f"workflow  {run.workflow_name}", file=out)
    print(f"status    {run.status.value}", file=out)
    print(f"input     {_short(run.input, 100)}", file=out)
    if run.status is RunStatus.COMPLETED:
        print(f"output    {_short(run.output, 100)}", file=out)
    if run.error:
        print(f"error     {run.error.get('type')}: {run.error.get('message')}", file=out)
    steps = world.list_steps(run.run_id)
    if steps:
        print("\nsteps", file=out)
        for step in steps:
            print(f"  {step.step_id:36} {step.status.value:10} attempts={step.attempt}", file=out)
    print("\nevents", file=out)
    for ev in world.list_events(run.run_id):
        print(
            f"  {ev.slot:4} {ev.created_at:%H:%M:%S.%f} {ev.event_type.value:15} {ev.correlation_id or '':24} {_short(dict(ev.data), 50)}",
            file=out,
        )
    return 0


def cmd_runs_cancel(args: argparse.Namespace, out: TextIO) -> int:
    world = _world(args)
    try:
        run = world.append(
            args.run_id, [NewEvent(EventType.RUN_CANCELLED, None, {"reason": "celery-workflow runs cancel"})]
        ).run
    except RunTerminal as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{run.run_id} {run.status.value}", file=out)
    return 0


def cmd_create_table(args: argparse.Namespace, out: TextIO) -> int:
    """The AWS World's table, with a DynamoDB client from the environment (region, credentials,
    ``AWS_ENDPOINT_URL``)."""
    try:
        import boto3

        from celery_workflow.world_sqs import create_table
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ConfigurationError("create-table needs boto3: pip install 'celery-workflow[aws]'") from exc
    print(f"creating DynamoDB table {args.name} (waiting until it is active) …", file=out)
    create_table(boto3.client("dynamodb"), args.name, timeout=args.timeout)
    print(f"table {args.name} is active", file=out)
    return 0


def cmd_demo(args: argparse.Namespace, out: TextIO) -> int:
    from celery_workflow.demo_runner import run_demo

    return run_demo(args.world or os.environ.get("CELERY_WORKFLOW_URL") or DEFAULT_URL, out=out, timeout=args.timeout)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="celery-workflow", description="Durable workflows on Celery.")
    p.add_argument(
        "--world",
        help="World URL: sqlite:///path, postgresql://…, aws:// (from WORKFLOW_*) (default: $CELERY_WORKFLOW_URL or"
        " sqlite:///celery_workflow.sqlite3)",
    )
    sub = p.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the example workflow on a real worker, on the embedded default")
    demo.add_argument("--timeout", type=float, default=120.0)
    demo.set_defaults(func=cmd_demo)
    runs = sub.add_parser("runs", help="inspect and cancel runs")
    rsub = runs.add_subparsers(dest="runs_command", required=True)
    ls = rsub.add_parser("list", help="runs, newest first")
    ls.add_argument("--workflow")
    ls.add_argument("--status", choices=[s.value for s in RunStatus])
    ls.add_argument("--limit", type=int, default=50)
    ls.set_defaults(func=cmd_runs_list)
    show = rsub.add_parser("show", help="a run with its steps and events")
    show.add_argument("run_id")
    show.set_defaults(func=cmd_runs_show)
    cancel = rsub.add_parser("cancel", help="cancel a run")
    cancel.add_argument("run_id")
    cancel.set_defaults(func=cmd_runs_cancel)
    cli_dead_letters.add_parser(sub, _world)
    table = sub.add_parser("create-table", help="create the AWS World's DynamoDB table and wait until it is active")
    table.add_argument("name", help="the table's name (the Terraform module's WORKFLOW_TABLE)")
    table.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the table (default 300)")
    table.set_defaults(func=cmd_create_table)
    return p


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        code: int = args.func(args, out or sys.stdout)
    except CeleryWorkflowError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
