"""What the Postgres World and the design notes say about forced hook claims is what the code does (issue #27,
item 12): ``create_hook(token, force=True)`` exists, and takes a token by two single-run appends, never by locking a
second run."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from celery_workflow._postgres import world as pg_world
from celery_workflow.runtime import context

ROOT = Path(__file__).resolve().parents[2]
STALE = re.compile(r"not\s+modell?ed|no\s+forced\s+claim\s+to\s+lock", re.I)


def test_create_hook_takes_force() -> None:
    assert "force" in inspect.signature(context.create_hook).parameters


def test_the_postgres_world_describes_forced_claims_as_they_are() -> None:
    text = pg_world.__doc__ or ""
    assert not STALE.search(text), STALE.search(text)
    assert "force=True" in text and "hook_disposed" in text


def test_the_design_notes_describe_forced_claims_as_they_are() -> None:
    notes = (ROOT / "docs" / "design-notes.md").read_text()
    (entry,) = [p for p in notes.split("\n- ") if p.startswith("**Forced claims**")]
    assert not STALE.search(entry), entry
    assert "force=True" in entry
