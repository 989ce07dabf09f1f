"""Child runs, a schedule and a guarded change: a nightly import that fans out one child run per file.

``import_batch`` starts an ``import_file`` run for each file (``import_file.start(...)`` inside a workflow is a *child
run*: recorded once in the batch's log, a run of its own with its own retries), waits for all of them with
``gather(..., return_exceptions=True)`` (no worker waits meanwhile: each child's end wakes the batch), and returns a
report. A file that cannot be parsed fails its child (``FatalError``); the batch sees ``WorkflowFailed`` for it and
carries on. Cancelling the batch cancels the imports still running (``parent_close="cancel"``, the default); the
audit trail is started with ``parent_close="abandon"`` so that it is written whatever becomes of the batch. The World
is ``$CELERY_WORKFLOW_URL`` (unset: an embedded SQLite file in the current directory)::

    celery -A examples.batch_import worker                          # runs the batch, its children and their steps
    python -m examples.batch_import 'a.csv=1,2,3' 'b.csv=4,x' 'c.csv=5'
    celery-workflow runs show 'import-1!1'                          # a child: its id is <batch id>!<n>

The inspector's run page of the batch lists its children and links each to its own page (and back to the batch).

Every night at 02:00 (Paris time) ``nightly`` reads an inbox folder and imports what it holds as a child batch. The
schedule lives in the World, not in Celery beat: define it once, and whichever worker's ticker claims a tick starts
its run (``nightly-import@<tick>``), exactly one per tick however many workers run::

    python -m examples.batch_import schedule /srv/inbox            # define (or redefine) the schedule
    celery -A examples.batch_import workflow schedules list         # next tick, last run; pause/resume/delete

``import_file`` changed after runs were in flight: empty files are no longer stored. ``patched("skip-empty-files")``
keeps that change safe: a run recorded before it replays down the old path (its ``store`` step is in its log), a run
that reaches it on the new code takes the new one (docs/workflow-changes.md).
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

from celery import Celery

from celery_workflow import FatalError, RunCancelled, WorkflowFailed, Workflows, gather, patched

celery_app = Celery("batch_import")
wf = Workflows(celery_app)  # the World: $CELERY_WORKFLOW_URL (sqlite:///…, postgresql://…, aws://)


@wf.step
def parse(name: str, content: str) -> list[int]:
    """Parse one file's rows (here: comma-separated integers)."""
    try:
        return [int(part) for part in content.split(",") if part.strip()]
    except ValueError as exc:
        raise FatalError(f"{name}: {exc}") from None  # no retry: the file itself is wrong


@wf.step
def store(name: str, rows: list[int]) -> int:
    """Store the rows (here: only count them); the step id is the idempotency key a real store would use."""
    return len(rows)


@wf.step
def record(entry: str) -> str:
    """Write an audit line (here: return it)."""
    return entry


@wf.workflow
def audit(batch: str, files: int) -> str:
    return record(f"batch {batch}: {files} files")


@wf.workflow
def import_file(name: str, content: str) -> dict[str, object]:
    rows = parse(name, content)
    if patched("skip-empty-files") and not rows:  # the change; runs recorded before it still store the empty file
        return {"file": name, "stored": 0}
    return {"file": name, "stored": store(name, rows)}


@wf.workflow
def import_batch(files: dict[str, str]) -> dict[str, object]:
    audit.start(sorted(files)[0] if files else "empty", len(files), parent_close="abandon")
    children = [import_file.start(name, content) for name, content in sorted(files.items())]
    outcomes = gather(*children, return_exceptions=True)
    stored, failed = 0, {}
    for child, outcome in zip(children, outcomes, strict=True):
        if isinstance(outcome, WorkflowFailed):
            failed[child.id] = str(outcome.error.get("message", ""))
        elif isinstance(outcome, RunCancelled):
            failed[child.id] = "cancelled"
        else:
            stored += int(outcome["stored"])
    return {"stored": stored, "failed": failed}


@wf.step
def read_inbox(folder: str) -> dict[str, str]:
    """The files waiting in ``folder`` (their names and contents), read once: a replay reads the recorded result."""
    return {path.name: path.read_text() for path in sorted(Path(folder).glob("*.csv"))}


@wf.workflow
def nightly(folder: str) -> dict[str, object]:
    """What the schedule starts: the inbox's files imported as one child batch (its own run, linked to this one)."""
    files = read_inbox(folder)
    return import_batch.start(files).result()


def schedule_nightly(folder: str) -> None:
    """Define the nightly schedule (idempotent: running it again with other values redefines it). A tick missed while
    no worker ran is still fired within six hours; a night whose import still runs skips the next one."""
    wf.schedule(
        nightly,
        cron="0 2 * * *",
        id="nightly-import",
        args=[folder],
        timezone="Europe/Paris",
        overlap="skip",
        catch_up=timedelta(hours=6),
    )


def main(argv: list[str]) -> None:
    if argv[:1] == ["schedule"]:
        schedule_nightly(argv[1])
        print(wf.schedules.get("nightly-import"))
        return
    files = dict(arg.split("=", 1) for arg in argv)
    run = import_batch.start(files, run_id="import-1")
    print(run.id, run.result(timeout=60))


if __name__ == "__main__":
    main(sys.argv[1:])
