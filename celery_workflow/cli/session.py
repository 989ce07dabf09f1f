"""What every command of the CLI shares: the World it works on (:class:`Session`), how errors become exit codes
(:class:`WorkflowGroup`), JSON output and progress.

The World comes from ``--world URL`` when it is given; else, under ``celery -A app workflow``, from the app's
:class:`~celery_workflow.app.Workflows` (:func:`~celery_workflow.app.workflows_of`: Celery hands its subcommands a
click context whose ``obj`` has the app as ``.app``); else from ``$CELERY_WORKFLOW_URL``, else the embedded default
``sqlite:///celery_workflow.sqlite3``. A World is opened on first use, so ``--help`` and ``demo`` open none.

Exit codes: 0 done; 1 the operation failed (no such run, the run has ended, the World failed); 2 bad input (a usage
error, a World URL no World registers, an empty ``--world``, a SQLite World that does not exist, a dead letter that is
not there). Errors are one line on stderr, never a traceback. Output a script reads goes to stdout; progress goes to
stderr. Stored data is printed through :mod:`celery_workflow.cli.text`: no control character reaches the terminal.

Only ``migrate`` (and ``demo``) create a World: every other command opens one that exists (``create=False``), so a
mistyped SQLite path is an error naming it, not a new empty World that answers "no runs".
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TextIO

import click

from celery_workflow.cli.text import safe_json, shown
from celery_workflow.errors import CeleryWorkflowError, ConfigurationError, DeadLetterNotFound, RunNotFound
from celery_workflow.events import RunView
from celery_workflow.world import World, open_world

if TYPE_CHECKING:
    from celery_workflow.app import Workflows

__all__ = ["BadInput", "Progress", "Session", "WorkflowGroup", "echo_json", "get_run", "is_tty"]

#: World URL schemes whose World can be opened without migrating it (``migrate`` applies the migrations itself).
MIGRATING_SCHEMES = ("sqlite", "postgresql", "postgres")
#: World URL schemes whose World a command can open without creating it (``create=False``): every command but
#: ``migrate`` and ``demo`` works on a World that exists, and a mistyped path is an error, not a new empty World.
EXISTING_ONLY_SCHEMES = ("sqlite",)


def _scheme(url: str) -> str:
    return url.split(":", 1)[0].lower() if ":" in url else ""


class BadInput(click.ClickException):
    """Bad input that is not a usage error: exit code 2, one line, no usage text."""

    exit_code = 2


class WorkflowGroup(click.Group):
    """The ``workflow`` group: a :class:`~celery_workflow.errors.CeleryWorkflowError` from any command becomes a
    one-line error and an exit code (see the module docstring)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (ConfigurationError, DeadLetterNotFound) as exc:
            raise BadInput(shown(exc)) from exc
        except CeleryWorkflowError as exc:
            raise click.ClickException(shown(exc) or type(exc).__name__) from exc


class Session:
    """The World the commands of one invocation work on, opened on first use (see the module docstring).

    ``url``: ``--world``; ``app``: the Celery app of ``celery -A app workflow`` (None for ``celery-workflow``)."""

    def __init__(self, *, url: str | None = None, app: Any = None) -> None:
        self.url = url
        self.app = app
        self._world: World | None = None
        self._owned = False

    @classmethod
    def from_context(cls, parent: Any, url: str | None) -> Session:
        """The session of a ``workflow`` invocation whose inherited ``ctx.obj`` is ``parent``: Celery's
        ``CLIContext`` (its ``.app``) under ``celery``, None under ``celery-workflow``."""
        return cls(url=url, app=getattr(parent, "app", None))

    def resolved_url(self) -> str:
        """``--world``, else ``$CELERY_WORKFLOW_URL``, else the embedded default (what ``demo`` and ``migrate``
        open when no Celery app gives the World). An empty ``--world`` is an error, never the default (an empty
        ``$CELERY_WORKFLOW_URL`` counts as unset, as environment variables go)."""
        from celery_workflow.app import DEFAULT_URL

        if self.url is not None:
            if not self.url.strip():
                raise BadInput("--world needs a World URL (sqlite:///path, postgresql://…, aws://), got ''")
            return self.url
        return os.environ.get("CELERY_WORKFLOW_URL") or DEFAULT_URL

    def workflows(self) -> Workflows | None:
        """The Workflows of the Celery app (under ``celery -A app workflow``, without ``--world``), or None."""
        if self.url is not None or self.app is None:
            return None
        from celery_workflow.app import workflows_of

        found = workflows_of(self.app)
        if found is None:
            name = getattr(self.app, "main", None) or "default"
            raise BadInput(
                f"the Celery app {name!r} has no Workflows: give -A the module that creates Workflows(celery_app),"
                " or pass --world URL"
            )
        return found

    @property
    def world(self) -> World:
        """The World the commands work on; one from a URL must exist already (a SQLite file that is not there, or
        holds no World, is an error naming the path, and nothing is created)."""
        if self._world is None:
            wf = self.workflows()
            if wf is not None:
                self._world = wf.world
            else:
                url = self.resolved_url()
                options = {"create": False} if _scheme(url) in EXISTING_ONLY_SCHEMES else {}
                self._world, self._owned = open_world(url, **options), True
        return self._world

    def world_for_migration(self) -> World:
        """The World, opened without migrating it when it comes from a URL (SQLite, Postgres), so that ``migrate``
        applies the migrations itself. The app's World was opened (and migrated) by its Workflows already.

        ``migrate`` is how a World is created from the command line: a SQLite file that does not exist is created
        (said on stderr), in a directory that must exist (a mistyped path does not grow a tree of directories)."""
        if self._world is None and self.workflows() is None:
            url = self.resolved_url()
            scheme = _scheme(url)
            options = {"migrate": False} if scheme in MIGRATING_SCHEMES else {}
            if scheme == "sqlite":
                _check_new_sqlite_world(url)
            self._world, self._owned = open_world(url, **options), True
        return self.world

    def target(self) -> Workflows | World:
        """What the run inspector serves: the app's Workflows under Celery, else the World."""
        return self.workflows() or self.world

    def close(self) -> None:
        world, self._world = self._world, None
        if world is not None and self._owned:
            world.close()


def _check_new_sqlite_world(url: str) -> None:
    """For ``migrate`` on a SQLite URL: BadInput when its file is missing and so is the file's directory; a note on
    stderr when the file is missing (the migration creates it)."""
    from celery_workflow._sqlite.database import parse_database_url

    try:
        path = Path(parse_database_url(url)[0])
    except ValueError as exc:
        raise BadInput(str(exc)) from exc
    if path.exists():
        return
    if not path.parent.is_dir():
        raise BadInput(f"cannot create a SQLite World at {path}: its directory {path.parent} does not exist")
    click.echo(f"creating a new SQLite World at {path}", err=True)


def get_run(world: World, run_id: str) -> RunView:
    """The run, or the error ``no run <id>`` (exit code 1)."""
    try:
        return world.get_run(run_id)
    except RunNotFound:
        raise click.ClickException(f"no run {shown(run_id)}") from None


def echo_json(value: Any) -> None:
    """``value`` as indented JSON on stdout, with no raw control character (:func:`~.text.safe_json`)."""
    click.echo(safe_json(value, indent=2))


def is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    """Progress of a long command on stderr: a :func:`click.progressbar` on a terminal, else a line per step.

    ``with Progress("redriving", total) as progress: progress.advance(n, "what")``."""

    def __init__(self, label: str, total: int) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self._bar = (
            click.progressbar(None, total, label, file=sys.stderr, show_pos=True, item_show_func=_show)
            if is_tty(sys.stderr)
            else None
        )

    def __enter__(self) -> Progress:
        if self._bar is not None:
            self._bar.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.__exit__(kind, exc, tb)

    def advance(self, steps: int = 1, note: str | None = None) -> None:
        self.done += steps
        if self._bar is not None:
            self._bar.update(steps, note)
        else:
            click.echo(f"{self.label}: {self.done}/{self.total}" + (f" {note}" if note else ""), err=True)


def _show(note: str | None) -> str | None:
    return note
