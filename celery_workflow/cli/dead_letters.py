"""``dead-letters list | show | redrive | purge``: the messages no consumer could process.

    dead-letters list [--queue Q] [--run RUN_ID] [--limit N] [--json]
    dead-letters show ID [--json]
    dead-letters redrive [--queue Q] [ID…] | --all      back on their queues, attempts reset
    dead-letters purge [--queue Q] [ID…] | --all        delete them

A redrive moves each dead letter at most once (it is deleted as its message is queued again), so running it twice
is harmless. Redrive and purge need IDs, ``--queue`` or ``--all``: nothing is moved or deleted by accident. They
work in batches of :data:`BATCH` with progress on stderr when the store numbers its dead letters (SQLite,
Postgres); an SQS dead-letter queue is read whole by each call, so there it is one call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import click

from celery_workflow.cli.session import BadInput, Progress, Session, echo_json
from celery_workflow.cli.text import shown
from celery_workflow.dead_letters import DeadLetter, DeadLetterStore, dead_letter_store

__all__ = ["BATCH", "dead_letters"]

#: Dead letters read per listing call.
PAGE = 500
#: Dead letters moved or deleted per call of a redrive or purge (one transaction each in the SQL stores).
BATCH = 100

pass_session = click.make_pass_decorator(Session)


def _store(session: Session) -> DeadLetterStore:
    return dead_letter_store(session.world)


def _all(store: DeadLetterStore, queue: str | None, run_id: str | None, limit: int) -> list[DeadLetter]:
    out: list[DeadLetter] = []
    after: int | str = 0
    while len(out) < limit:
        page = store.list_dead_letters(queue=queue, run_id=run_id, after=after, limit=min(PAGE, limit - len(out)))
        out.extend(page)
        if len(page) < PAGE or not isinstance(page[-1].id, int):  # SQS answers all at once
            break
        after = page[-1].id
    return out


@click.group("dead-letters")
def dead_letters() -> None:
    """Messages no consumer could process: list, show, redrive, purge."""


@dead_letters.command("list")
@click.option("--queue", metavar="Q", help="Only those of this queue.")
@click.option("--run", "run_id", metavar="RUN_ID", help="Only those of this run.")
@click.option("--limit", type=click.IntRange(min=1), default=1000, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="JSON output, for scripts.")
@pass_session
def list_letters(session: Session, queue: str | None, run_id: str | None, limit: int, as_json: bool) -> None:
    """Dead letters, oldest first."""
    letters = _all(_store(session), queue, run_id, limit)
    if as_json:
        echo_json([d.to_json() for d in letters])
        return
    if not letters:
        click.echo("no dead letters")
        return
    click.echo(f"{'ID':>6} {'QUEUE':16} {'TASK':32} {'RUN ID':32} {'SENT':>5} {'REASON':15} DEAD AT")
    for d in letters:
        click.echo(
            f"{shown(d.id):>6} {shown(d.queue)[:16]:16} {shown(d.task_name or '?')[:32]:32}"
            f" {shown(d.run_id or '-')[:32]:32} {d.deliveries:>5} {shown(d.reason):15} {d.dead_at:%Y-%m-%d %H:%M:%S}"
        )


@dead_letters.command("show")
@click.argument("letter_id", metavar="ID")
@click.option("--json", "as_json", is_flag=True, help="JSON output (with the message), for scripts.")
@pass_session
def show_letter(session: Session, letter_id: str, as_json: bool) -> None:
    """A dead letter with its message."""
    letter = _store(session).get_dead_letter(letter_id)
    data = letter.to_json(body=True)
    if as_json:
        echo_json(data)
        return
    for key, value in data.items():
        if key != "message":
            click.echo(f"{key:16}{'' if value is None else shown(value)}")
    click.echo(f"\n{shown(letter.describe())}\n\nmessage\n  {shown(data['message'])}")


def _move(
    session: Session,
    *,
    command: str,
    ids: Sequence[str],
    queue: str | None,
    every: bool,
    act: Callable[[DeadLetterStore], Callable[..., int]],
) -> int:
    """Redrive or purge (``act`` picks the store's method) what the arguments select; the number of dead letters."""
    if not (ids or queue or every):
        raise BadInput(f"dead-letters {command}: name dead letter IDs, --queue Q, or --all")
    store = _store(session)
    selected: list[int | str] = list(ids) if ids else [d.id for d in _all(store, queue, None, 10**9)]
    if not all(str(i).isdigit() for i in selected):  # SQS: each call reads the dead-letter queues whole
        return act(store)(list(ids) if ids else None, queue=queue)
    done = 0
    with Progress(f"{command} dead letters", len(selected)) as progress:
        for start in range(0, len(selected), BATCH):
            batch = selected[start : start + BATCH]
            done += act(store)(batch, queue=queue)
            progress.advance(len(batch))
    return done


def _selection(function: Callable[..., None]) -> Callable[..., None]:
    function = click.argument("ids", nargs=-1, metavar="[ID]...")(function)
    function = click.option("--queue", metavar="Q", help="Only those of this queue.")(function)
    return click.option("--all", "every", is_flag=True, help="Every dead letter (of --queue, if given).")(function)


@dead_letters.command("redrive")
@_selection
@pass_session
def redrive(session: Session, ids: tuple[str, ...], queue: str | None, every: bool) -> None:
    """Put dead letters back on their queues, attempts reset (each at most once)."""
    moved = _move(
        session, command="redrive", ids=ids, queue=queue, every=every, act=lambda store: store.redrive_dead_letters
    )
    click.echo(f"redrove {moved} dead letter{'s' * (moved != 1)}")


@dead_letters.command("purge")
@_selection
@pass_session
def purge(session: Session, ids: tuple[str, ...], queue: str | None, every: bool) -> None:
    """Delete dead letters."""
    deleted = _move(
        session, command="purge", ids=ids, queue=queue, every=every, act=lambda store: store.purge_dead_letters
    )
    click.echo(f"purged {deleted} dead letter{'s' * (deleted != 1)}")
