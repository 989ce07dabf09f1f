"""``scheduled [--queue Q…] [--limit N] [--json]``: the countdown and ETA tasks the World's queue holds for later.

On our SQLite and Postgres transports a task sent with ``countdown``/``eta`` (a workflow's sleep, a step's retry
backoff, a plain Celery task's countdown) waits in the store until it is due: no worker holds it, so it is what a
worker's ``celery inspect scheduled`` adds from its store (:mod:`celery_workflow.transport.scheduled`) and what this
command lists for every queue at once, without a worker running. Soonest due first.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import click

from celery_workflow.cli.session import BadInput, Session, echo_json
from celery_workflow.cli.text import shown
from celery_workflow.transport.scheduled import NO_DELAYED, delayed_requests, delayed_store, listed_queues

__all__ = ["scheduled"]

pass_session = click.make_pass_decorator(Session)


def _queues(session: Session, store: Any) -> list[str]:
    from celery_workflow.worker_setup import known_queues

    wf = session.workflows()
    return listed_queues(store, known_queues(wf) if wf is not None else ())


@click.command("scheduled")
@click.option("--queue", "queues", metavar="Q", multiple=True, help="Only this queue (repeatable).")
@click.option("--limit", type=click.IntRange(min=1), default=1000, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="JSON output (Celery's `inspect scheduled` shape), for scripts.")
@pass_session
def scheduled(session: Session, queues: Sequence[str], limit: int, as_json: bool) -> None:
    """Countdown/ETA tasks waiting in the World's queue until they are due."""
    store = delayed_store(session.world)
    if store is None:
        raise BadInput(NO_DELAYED)
    entries = delayed_requests(store, list(queues) or _queues(session, store), None, limit)
    if as_json:
        echo_json(entries)
        return
    if not entries:
        click.echo("no scheduled tasks")
        return
    now = time.time()
    click.echo(f"{'DUE (UTC)':19} {'IN':>8} {'QUEUE':16} {'TASK':32} {'TASK ID':36} RUN ID")
    for entry in entries:
        request = entry["request"]
        due = datetime.fromisoformat(entry["eta"])
        click.echo(
            f"{due:%Y-%m-%d %H:%M:%S} {max(due.timestamp() - now, 0):>7.0f}s"
            f" {shown(request['delivery_info']['routing_key'])[:16]:16} {shown(request['name'] or '?')[:32]:32}"
            f" {shown(request['id'] or '?')[:36]:36} {shown(entry['run_id'] or '-')}"
        )
