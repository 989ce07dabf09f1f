"""Postgres notifications carry ids and tokens, never data (issue #26, item 8).

Any role that can connect to the database may LISTEN on the World's and the transport's channels (their names are
predictable: a fixed name and a tag of the schema). A listener of its own, on every channel, hears a run start on a
real worker (its first message handed to the worker's standing claim), write a stream and end: no payload carries
the run's input or output or a task message (a canary string in the input is nowhere), only ids and tokens.
"""

from __future__ import annotations

import re
import secrets
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from celery_workflow._postgres.listener import CHANNEL_QUEUE, CHANNEL_RUNS, CHANNEL_STREAMS, SCHEMA_TAG
from tests.acceptance.workers import Worker, imported_app, postgres_schema, wait_for

pytestmark = pytest.mark.acceptance

#: What a payload may be: lines of ids, names, tokens and numbers (no JSON, no spaces, nothing encoded).
IDS_ONLY = re.compile(r"[A-Za-z0-9_.:@-]{1,200}")


def test_no_notification_carries_a_runs_data_or_a_message(tmp_path: Path) -> None:
    canary = f"canary{secrets.token_hex(8)}"
    with postgres_schema() as url:
        env = {"CELERY_WORKFLOW_URL": url}
        with imported_app("notifyapp", env) as app, psycopg.connect(url, autocommit=True) as spy:
            (tag,) = spy.execute(f"SELECT {SCHEMA_TAG}").fetchone() or ("",)
            for channel in (CHANNEL_QUEUE, CHANNEL_RUNS, CHANNEL_STREAMS):
                spy.execute(f'LISTEN "{channel}_{tag}"')
            worker = Worker("notifyapp", env, tmp_path / "worker.log", ("-c", "1", "-n", "notify@%h"))
            try:
                worker.wait_ready()

                def standing() -> Any:
                    row = spy.execute(
                        "SELECT count(*) FROM celery_workflow_standing_claims WHERE active AND assigned_id IS NULL"
                    ).fetchone()
                    return row is not None and row[0] > 0

                wait_for(standing, 30, lambda: worker.log.read_text()[-3000:])  # idle: its next message is handed
                run = app.echo.start(canary)
                assert run.result(timeout=30) == f"{canary} heard"
                assert list(run.stream("notes", timeout=10)) == [{"heard": canary}]
            finally:
                worker.stop()
            heard: list[tuple[str, str]] = []
            deadline = time.monotonic() + 1.0
            while (left := deadline - time.monotonic()) > 0:
                heard += [(n.channel, n.payload) for n in spy.notifies(timeout=left)]
    payloads = [payload for _, payload in heard]
    assert f"{CHANNEL_RUNS}_{tag}" in {c for c, _ in heard} and run.id in payloads  # the run's end: its id alone
    assert any(p.startswith("celery_workflow.standing:") for p in payloads), payloads  # a hand-off was heard
    assert any(p == f"{run.id}:notes" for p in payloads)  # the stream's key
    assert not [p for p in payloads if canary in p]
    assert [p for p in payloads if not all(IDS_ONLY.fullmatch(line) for line in p.split("\n"))] == []
