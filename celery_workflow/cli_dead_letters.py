"""``celery-workflow dead-letters``: look at the messages no consumer could process, put them back, or delete them.

    celery-workflow dead-letters list [--queue Q] [--run RUN_ID] [--json]
    celery-workflow dead-letters show ID [--json]
    celery-workflow dead-letters redrive [--queue Q] [ID…] | --all      back on their queues, attempts reset
    celery-workflow dead-letters purge [--queue Q] [ID…] | --all        delete them

A redrive moves each dead letter at most once (it is deleted as its message is queued again), so running it twice
is harmless. Redrive and purge need IDs, ``--queue`` or ``--all``: nothing is moved or deleted by accident.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any, TextIO

from celery_workflow.dead_letters import DeadLetter, DeadLetterStore, dead_letter_store
from celery_workflow.errors import ConfigurationError
from celery_workflow.world import World

__all__ = ["add_parser"]

PAGE = 500


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


def cmd_list(store: DeadLetterStore, args: argparse.Namespace, out: TextIO) -> int:
    letters = _all(store, args.queue, args.run, args.limit)
    if args.json:
        print(json.dumps([d.to_json() for d in letters], indent=2), file=out)
        return 0
    if not letters:
        print("no dead letters", file=out)
        return 0
    print(f"{'ID':>6} {'QUEUE':16} {'TASK':32} {'RUN ID':32} {'SENT':>5} {'REASON':15} DEAD AT", file=out)
    for d in letters:
        print(
            f"{d.id:>6} {d.queue[:16]:16} {(d.task_name or '?')[:32]:32} {(d.run_id or '-')[:32]:32} {d.deliveries:>5}"
            f" {d.reason:15} {d.dead_at:%Y-%m-%d %H:%M:%S}",
            file=out,
        )
    return 0


def cmd_show(store: DeadLetterStore, args: argparse.Namespace, out: TextIO) -> int:
    letter = store.get_dead_letter(args.id)
    data = letter.to_json(body=True)
    if args.json:
        print(json.dumps(data, indent=2), file=out)
        return 0
    for key, value in data.items():
        if key != "message":
            print(f"{key:16}{'' if value is None else value}", file=out)
    print(f"\n{letter.describe()}\n\nmessage\n  {data['message']}", file=out)
    return 0


def _selection(args: argparse.Namespace) -> list[int | str] | None:
    if not (args.ids or args.queue or args.all):
        raise ConfigurationError(f"dead-letters {args.dl_command}: name dead letter IDs, --queue Q, or --all")
    return list(args.ids) if args.ids else None


def cmd_redrive(store: DeadLetterStore, args: argparse.Namespace, out: TextIO) -> int:
    moved = store.redrive_dead_letters(_selection(args), queue=args.queue)
    print(f"redrove {moved} dead letter{'s' * (moved != 1)}", file=out)
    return 0


def cmd_purge(store: DeadLetterStore, args: argparse.Namespace, out: TextIO) -> int:
    deleted = store.purge_dead_letters(_selection(args), queue=args.queue)
    print(f"purged {deleted} dead letter{'s' * (deleted != 1)}", file=out)
    return 0


def add_parser(sub: Any, open_world: Callable[[argparse.Namespace], World]) -> None:
    """Add ``dead-letters`` and its subcommands to the ``celery-workflow`` parser's subparsers ``sub``."""

    def bind(command: Callable[[DeadLetterStore, argparse.Namespace, TextIO], int]) -> Callable[..., int]:
        def run(args: argparse.Namespace, out: TextIO) -> int:
            world = open_world(args)
            try:
                return command(dead_letter_store(world), args, out)
            finally:
                world.close()

        return run

    dl = sub.add_parser("dead-letters", help="messages no consumer could process: list, show, redrive, purge")
    dsub = dl.add_subparsers(dest="dl_command", required=True)
    ls = dsub.add_parser("list", help="dead letters, oldest first")
    ls.add_argument("--queue")
    ls.add_argument("--run", help="only those of this run")
    ls.add_argument("--limit", type=int, default=1000)
    ls.add_argument("--json", action="store_true", help="JSON output, for scripts")
    ls.set_defaults(func=bind(cmd_list))
    show = dsub.add_parser("show", help="a dead letter with its message")
    show.add_argument("id")
    show.add_argument("--json", action="store_true")
    show.set_defaults(func=bind(cmd_show))
    for name, command, what in (
        ("redrive", cmd_redrive, "put dead letters back on their queues, attempts reset (each at most once)"),
        ("purge", cmd_purge, "delete dead letters"),
    ):
        p = dsub.add_parser(name, help=what)
        p.add_argument("ids", nargs="*", metavar="ID")
        p.add_argument("--queue", help="only those of this queue")
        p.add_argument("--all", action="store_true", help="every dead letter (of --queue, if given)")
        p.set_defaults(func=bind(command))
