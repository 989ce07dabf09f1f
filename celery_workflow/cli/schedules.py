"""``schedules list | show | pause | resume | delete``: the World's schedules (:mod:`celery_workflow.schedules`).

``list`` shows each schedule's workflow, cron expression and time zone, whether it is paused, its next tick and its
last run; ``show ID`` one schedule in full. ``pause ID`` stops its ticks until ``resume ID``, which starts again from
the first tick after now (ticks that came while it was paused are not caught up); ``delete ID`` removes it (its runs
stay). An unknown id exits with code 1.
"""

from __future__ import annotations

import click

from celery_workflow.cli.session import Session, echo_json
from celery_workflow.cli.text import shown
from celery_workflow.errors import ScheduleNotFound
from celery_workflow.schedules import Schedule, Schedules

__all__ = ["schedules"]

pass_session = click.make_pass_decorator(Session)


def _schedules(session: Session) -> Schedules:
    wf = session.workflows()
    return wf.schedules if wf is not None else Schedules(session.world)


def _when(schedule: Schedule, name: str) -> str:
    value = getattr(schedule, name)
    return "-" if value is None else f"{value:%Y-%m-%d %H:%M:%S}Z"


def _found(session: Session, schedule_id: str, what: str) -> Schedule:
    manager = _schedules(session)
    try:
        if what == "show":
            return manager.get(schedule_id)
        if what == "pause":
            return manager.pause(schedule_id)
        return manager.resume(schedule_id)
    except ScheduleNotFound:
        raise click.ClickException(f"no schedule {shown(schedule_id)}") from None


@click.group()
def schedules() -> None:
    """The World's schedules: list, show, pause, resume, delete."""


@schedules.command("list")
@click.option("--json", "as_json", is_flag=True, help="JSON output (a list of schedules), for scripts.")
@pass_session
def list_schedules(session: Session, as_json: bool) -> None:
    """Every schedule, by id."""
    found = _schedules(session).list()
    if as_json:
        echo_json([s.to_data() for s in found])
        return
    if not found:
        click.echo("no schedules")
        return
    click.echo(f"{'ID':24} {'WORKFLOW':24} {'CRON':16} {'TIMEZONE':16} {'STATE':7} {'NEXT TICK':20} LAST RUN")
    for s in found:
        click.echo(
            f"{shown(s.schedule_id):24} {shown(s.workflow_name):24} {shown(s.cron):16} {shown(s.timezone):16}"
            f" {'paused' if s.paused else 'active':7} {_when(s, 'next_tick'):20} {shown(s.last_run_id or '-')}"
        )


@schedules.command("show")
@click.argument("schedule_id")
@click.option("--json", "as_json", is_flag=True, help="JSON output, for scripts.")
@pass_session
def show_schedule(session: Session, schedule_id: str, as_json: bool) -> None:
    """One schedule in full."""
    s = _found(session, schedule_id, "show")
    if as_json:
        echo_json(s.to_data())
        return
    for label, value in (
        ("schedule", s.schedule_id),
        ("workflow", s.workflow_name),
        ("cron", f"{s.cron} ({s.timezone})"),
        ("state", "paused" if s.paused else "active"),
        ("overlap", s.overlap),
        ("catch up", f"{s.catch_up:g} s"),
        ("arguments", f"args={list(s.input.get('args', []))!r} kwargs={dict(s.input.get('kwargs', {}))!r}"),
        ("next tick", _when(s, "next_tick")),
        ("last tick", _when(s, "last_tick")),
        ("last run", s.last_run_id or "-"),
    ):
        click.echo(f"{label + ':':11} {shown(str(value))}")


@schedules.command("pause")
@click.argument("schedule_id")
@pass_session
def pause_schedule(session: Session, schedule_id: str) -> None:
    """Stop firing a schedule until it is resumed."""
    s = _found(session, schedule_id, "pause")
    click.echo(f"{shown(s.schedule_id)} paused")


@schedules.command("resume")
@click.argument("schedule_id")
@pass_session
def resume_schedule(session: Session, schedule_id: str) -> None:
    """Fire a paused schedule again, from its first tick after now."""
    s = _found(session, schedule_id, "resume")
    click.echo(f"{shown(s.schedule_id)} active, next tick {_when(s, 'next_tick')}")


@schedules.command("delete")
@click.argument("schedule_id")
@pass_session
def delete_schedule(session: Session, schedule_id: str) -> None:
    """Delete a schedule (its runs stay)."""
    try:
        _schedules(session).delete(schedule_id)
    except ScheduleNotFound:
        raise click.ClickException(f"no schedule {shown(schedule_id)}") from None
    click.echo(f"{shown(schedule_id)} deleted")
