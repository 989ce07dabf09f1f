"""``runs list | show | cancel | watch``: look at runs, cancel one, follow one live.

``runs list --waiting`` lists the runs in progress with what each waits for, ``runs show`` has a "waiting on"
section and ``runs watch`` adds it to the run's state (:mod:`celery_workflow.waiting_on`; hook tokens hidden).

``runs watch RUN_ID`` polls the World every ``--interval`` seconds (a finished run ends the wait at once): it prints
each stream value as it arrives (``[stream] value``) and the run's state, steps done / steps known and the current
step; on a terminal that state is one line redrawn in place, otherwise a line each time it changes. When the run
ends it prints the output or the error and exits 0 (completed), 1 (failed) or 2 (cancelled).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from celery_workflow import codec
from celery_workflow._backend.children import children_of, close_children, link_of
from celery_workflow.cli.session import Session, echo_json, get_run, is_tty
from celery_workflow.cli.text import shown
from celery_workflow.errors import RunTerminal
from celery_workflow.event_data import RunCancelledData
from celery_workflow.events import NewEvent, RunStatus, RunView, StepView
from celery_workflow.rpc import event_data, event_json, run_json, step_json
from celery_workflow.runtime.continuation import continued_as
from celery_workflow.waiting_on import Waiting, describe, run_waiting_on, waiting_json
from celery_workflow.worker_setup import unserved
from celery_workflow.world import World

__all__ = ["WATCH_EXIT", "runs"]

#: ``runs watch``'s exit code for each way a run ends.
WATCH_EXIT = {RunStatus.COMPLETED: 0, RunStatus.FAILED: 1, RunStatus.CANCELLED: 2}

pass_session = click.make_pass_decorator(Session)


def _short(value: Any, width: int = 60) -> str:
    text = shown(json.dumps(value, default=str, separators=(",", ":"), ensure_ascii=False))
    return text if len(text) <= width else text[: width - 1] + "…"


@click.group()
def runs() -> None:
    """Look at runs, cancel one, follow one live."""


@runs.command("list")
@click.option("--workflow", metavar="NAME", help="Only runs of this workflow.")
@click.option("--status", type=click.Choice([s.value for s in RunStatus]), help="Only runs in this state.")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True, help="At most this many runs.")
@click.option(
    "--waiting", is_flag=True, help="Only runs in progress, with what each waits for (a sleep, a hook, a retry…)."
)
@click.option("--json", "as_json", is_flag=True, help="JSON output (a list of runs), for scripts.")
@pass_session
def list_runs(
    session: Session, *, workflow: str | None, status: str | None, limit: int, waiting: bool, as_json: bool
) -> None:
    """Runs, newest first."""
    world = session.world
    if waiting:
        found = _in_progress(world, workflow, status, limit)
    else:
        found = world.list_runs(workflow=workflow, status=status, limit=limit).items
    waits = {run.run_id: run_waiting_on(world, run.run_id) for run in found} if waiting else {}
    if as_json:
        echo_json([{**run_json(run), **_waits_json(waits, run)} for run in found])
        return
    if not found:
        click.echo("no runs waiting" if waiting else "no runs")
        return
    idle = unserved(world, found)
    click.echo(f"{'RUN ID':32} {'WORKFLOW':24} {'STATUS':10} {'CREATED':19} {'WAITING ON' if waiting else 'QUEUE'}")
    for run in found:
        last = _waiting_text(waits.get(run.run_id, [])) if waiting else _queue(run, idle)
        click.echo(
            f"{shown(run.run_id):32} {shown(run.workflow_name):24} {run.status.value:10}"
            f" {run.created_at:%Y-%m-%d %H:%M:%S} {last}".rstrip()
        )
    if idle:
        click.echo(f"\nno worker consumes {', '.join(sorted(map(shown, idle)))}: start one with -Q (or without -Q)")


def _in_progress(world: World, workflow: str | None, status: str | None, limit: int) -> list[RunView]:
    """Runs pending or running (or of ``status``, when it is one of them), newest first."""
    wanted = [RunStatus(status)] if status else [RunStatus.RUNNING, RunStatus.PENDING]
    found = [
        r for s in wanted if not s.terminal for r in world.list_runs(workflow=workflow, status=s, limit=limit).items
    ]
    return sorted(found, key=lambda r: (r.created_at, r.run_id), reverse=True)[:limit]


def _waits_json(waits: dict[str, list[Waiting]], run: RunView) -> dict[str, Any]:
    return {"waiting_on": waiting_json(waits[run.run_id])} if run.run_id in waits else {}


def _waiting_text(items: list[Waiting]) -> str:
    """What a run waits for, in one line: the first thing, and how many more."""
    if not items:
        return "-"
    more = f" (+{len(items) - 1} more)" if len(items) > 1 else ""
    return shown(describe(items[0])) + more


def _queue(run: RunView, idle: set[str]) -> str:
    """A run's queue, marked when the run waits on it and nobody consumes it (see worker_setup.unserved)."""
    if not run.queue:
        return ""
    return shown(run.queue) + (" (no consumer)" if run.queue in idle and not run.status.terminal else "")


@runs.command("show")
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="JSON output (the run with its steps and events), for scripts.")
@pass_session
def show_run(session: Session, run_id: str, as_json: bool) -> None:
    """A run with its steps and its event log."""
    world = session.world
    run = get_run(world, run_id)
    steps = world.list_steps(run_id)
    events = world.list_events(run_id)
    waits = run_waiting_on(world, run_id)
    link = link_of(events[:1])
    children = children_of(events)
    if as_json:
        echo_json(
            {
                **run_json(run),
                "parent_run_id": link.run_id if link is not None else None,
                "children": [child.to_json() for child in children],
                "waiting_on": waiting_json(waits),
                "steps": [step_json(s) for s in steps],
                "events": [event_json(e) for e in events],
            }
        )
        return
    click.echo(f"run       {shown(run.run_id)}")
    click.echo(f"workflow  {shown(run.workflow_name)}")
    click.echo(f"status    {run.status.value}")
    if run.queue:
        click.echo(f"queue     {_queue(run, unserved(world, [run]))}")
    if link is not None:
        click.echo(f"parent    {shown(link.run_id)}")
    click.echo(f"input     {_short(run.input, 100)}")
    if run.status is RunStatus.COMPLETED:
        click.echo(f"output    {_short(run.output, 100)}")
    if run.error:
        click.echo(f"error     {shown(run.error.get('type'))}: {shown(run.error.get('message'))}")
    if waits:
        click.echo("\nwaiting on")
        for item in waits:
            click.echo(f"  {shown(describe(item))}")
    if children:
        click.echo("\nchildren")
        for child in children:
            status = child.status or "no end recorded"
            click.echo(f"  {shown(child.run_id):36} {shown(child.workflow_name):20} {status}")
    if steps:
        click.echo("\nsteps")
        for step in steps:
            click.echo(f"  {shown(step.step_id):36} {step.status.value:10} attempts={step.attempt}")
    click.echo("\nevents")
    for ev in events:
        click.echo(
            f"  {ev.slot:4} {ev.created_at:%H:%M:%S.%f} {ev.event_type.value:15} {shown(ev.correlation_id or ''):24}"
            f" {_short(event_data(ev), 50)}"
        )


@runs.command("cancel")
@click.argument("run_id")
@click.option("--reason", default="cancelled from the command line", show_default=True, help="Recorded with it.")
@pass_session
def cancel_run(session: Session, run_id: str, reason: str) -> None:
    """Cancel a run: its later deliveries do nothing; its child runs still running are cancelled too (but those
    started with parent_close="abandon"), and a child run's parent is woken (its result() raises RunCancelled)."""
    world = session.world
    get_run(world, run_id)
    try:
        run = world.append(run_id, [NewEvent.of(RunCancelledData(reason=reason or None))]).run
    except RunTerminal:
        raise click.ClickException(f"run {shown(run_id)} has ended ({world.get_run(run_id).status.value})") from None
    close_children(world, run_id)
    click.echo(f"{shown(run.run_id)} {run.status.value}")


@runs.command("watch")
@click.argument("run_id")
@click.option(
    "--interval", type=click.FloatRange(min=0.01), default=0.5, show_default=True, help="Seconds between polls."
)
@pass_session
def watch_run(session: Session, run_id: str, interval: float) -> None:
    """Follow a run live: steps, the current step, stream output, and the runs it hands over to (continue_as_new).
    Exit code 0 completed, 1 failed, 2 cancelled (the last run of the chain)."""
    world = session.world
    view = get_run(world, run_id)
    screen = _Screen(is_tty(sys.stdout))
    read: dict[str, int] = {}
    try:
        while True:
            steps = world.list_steps(run_id)  # read after the view, so a terminal view has every step and chunk
            for name in sorted(world.list_streams(run_id)):
                page = world.read_stream(run_id, name, start=read.get(name, 0))
                for chunk in page.chunks:
                    screen.line(f"[{shown(name)}] {_value(chunk.data)}")
                read[name] = page.next_index
            waits = [] if view.status.terminal else run_waiting_on(world, run_id)
            screen.status(_state(view, steps) + (f"  waiting on {_waiting_text(waits)}" if waits else ""))
            successor = continued_as(world, view) if view.status.terminal else None
            if successor is not None:  # it handed over (continue_as_new): follow the chain to its end
                screen.line(f"run {shown(run_id)} continued as {shown(successor)}")
                run_id, view, read = successor, get_run(world, successor), {}
                continue
            if view.status.terminal:
                break
            view = world.wait_for_terminal(run_id, timeout=interval)
    except KeyboardInterrupt:
        screen.done()
        raise click.exceptions.Exit(130) from None
    screen.done()
    _ending(world, view)
    raise click.exceptions.Exit(WATCH_EXIT[view.status])


def _value(data: bytes) -> str:
    value = codec.loads(data)
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    return shown(json.dumps(value, default=str, ensure_ascii=False))


def _state(view: RunView, steps: list[StepView]) -> str:
    done = sum(1 for s in steps if s.status.terminal)
    text = f"{view.status.value:9}  steps {done}/{len(steps)}"
    current = [s for s in steps if not s.status.terminal]
    if current:
        step = max(current, key=lambda s: s.updated_at)
        attempt = f", attempt {step.attempt}" if step.attempt > 1 else ""
        text += f"  current {shown(step.step_id)} ({step.status.value}{attempt})"
    return text


def _ending(world: World, view: RunView) -> None:
    if view.status is RunStatus.COMPLETED:
        click.echo(f"output  {shown(json.dumps(view.output, default=str, ensure_ascii=False))}")
    elif view.status is RunStatus.FAILED:
        error = view.error or {}
        click.echo(f"error   {shown(error.get('type', 'Error'))}: {shown(error.get('message', ''))}")
    else:
        last = world.list_events(view.run_id, after_slot=max(view.event_count - 1, 0))
        reason = next((e.body.reason for e in last if isinstance(e.body, RunCancelledData)), None)
        click.echo("cancelled" + (f": {shown(reason)}" if reason else ""))


class _Screen:
    """Stream lines and the run's state on stdout: on a terminal the state is one line redrawn in place (under the
    stream lines), otherwise it is printed each time it changes."""

    def __init__(self, tty: bool) -> None:
        self.tty = tty
        self.shown: str | None = None

    def line(self, text: str) -> None:
        if self.tty and self.shown is not None:
            click.echo("\r\x1b[K", nl=False)
            click.echo(text)
            click.echo(self.shown, nl=False)
        else:
            click.echo(text)

    def status(self, text: str) -> None:
        if text == self.shown:
            return
        self.shown = text
        if self.tty:
            click.echo(f"\r\x1b[K{text}", nl=False)
        else:
            click.echo(text)

    def done(self) -> None:
        if self.tty and self.shown is not None:
            click.echo()
