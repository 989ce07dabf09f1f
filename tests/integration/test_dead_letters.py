"""Dead letters on the SQLite and Postgres Worlds: a delivery that keeps failing stops being retried after its
queue's limit, moves to the dead letters with its history, fails its run with the cause, and the CLI lists, shows,
redrives (once) and purges it. (The Kombu side, reject and x-delivery-limit, is in ``transport_suite``.)"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_workflow import Workflows
from celery_workflow.cli import main
from celery_workflow.dead_letters import dead_letter_store
from celery_workflow.errors import ConfigurationError
from celery_workflow.testing import LocalWorker, driver


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'dead.sqlite3'}"
        return
    from tests.integration import pg_fixtures

    with pg_fixtures.fresh_schema("cw_dead") as schema:
        yield pg_fixtures.schema_url(schema)


@pytest.fixture
def wf(url: str) -> Iterator[Workflows]:
    workflows = Workflows(Celery("dead"), world=url, broker="app")
    yield workflows
    workflows.close()


def cli(url: str, *args: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(["--world", url, *args], out=out)
    return code, out.getvalue()


def test_a_delivery_failing_past_its_limit_is_dead_lettered_and_fails_its_run(
    wf: Workflows, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    @wf.step
    def charge(amount: int) -> int:
        return amount

    @wf.workflow
    def payment(amount: int) -> int:
        return charge(amount)

    def on_fire(*args: Any, **kwargs: Any) -> str:
        raise RuntimeError("the World is on fire")

    monkeypatch.setattr(driver, "failure_backoff", lambda attempts: 0.01)
    worker = LocalWorker(wf)
    wf.world.max_deliveries = 3  # type: ignore[attr-defined]
    monkeypatch.setattr(wf.runtime, "handle_workflow", on_fire)
    run = payment.start(5)
    worker.run_until(lambda: run.status.terminal, timeout=30)

    assert run.status == "failed"
    assert len(worker.failures) == 3  # three deliveries, then no more
    error = run.view().error or {}
    assert error["type"] == "celery_workflow.errors.DeadLettered"
    assert "delivered 3 times" in error["message"] and "RuntimeError: the World is on fire" in error["message"]
    (letter,) = dead_letter_store(wf.world).list_dead_letters()
    assert (letter.task_name, letter.run_id, letter.reason, letter.attempts) == (
        "workflow.payment", run.id, "max-deliveries", 4,
    )  # fmt: skip
    assert letter.last_error == "RuntimeError: the World is on fire"
    assert letter.first_failed_at is not None and letter.last_failed_at is not None
    assert letter.first_failed_at <= letter.last_failed_at <= letter.dead_at
    assert error["dead_letter"] == letter.id

    code, out = cli(url, "runs", "show", run.id)
    assert code == 0 and "celery_workflow.errors.DeadLettered" in out

    code, out = cli(url, "dead-letters", "list")
    assert code == 0 and "workflow.payment" in out and run.id in out and "max-deliveries" in out
    code, out = cli(url, "dead-letters", "list", "--json")
    assert [d["id"] for d in json.loads(out)] == [letter.id]
    code, out = cli(url, "dead-letters", "show", str(letter.id), "--json")
    shown = json.loads(out)
    assert (
        shown["last_error"] == letter.last_error
        and json.loads(shown["message"])["headers"]["task"] == "workflow.payment"
    )
    code, out = cli(url, "dead-letters", "show", str(letter.id))
    assert code == 0 and "the World is on fire" in out

    code, out = cli(url, "dead-letters", "redrive")  # nothing selected: refused, nothing moved
    assert code == 2
    assert cli(url, "dead-letters", "redrive", str(letter.id)) == (0, "redrove 1 dead letter\n")
    assert cli(url, "dead-letters", "redrive", str(letter.id)) == (0, "redrove 0 dead letters\n")  # idempotent
    code, out = cli(url, "dead-letters", "show", str(letter.id))
    assert code == 2
    # the redriven delivery finds its run ended: it is dropped, not dead-lettered again
    monkeypatch.undo()
    worker.run_until_idle()
    assert dead_letter_store(wf.world).list_dead_letters() == []


def test_purge_takes_a_selection(wf: Workflows, url: str) -> None:
    store = dead_letter_store(wf.world)
    for queue in ("a", "a", "b"):
        store.put(queue, b"not a message")  # type: ignore[attr-defined]
        (claim,) = store.receive([queue])  # type: ignore[attr-defined]
        assert store.dead_letter(claim.receipt, reason="undecodable", error="undecodable: junk") is not None
    assert [d.queue for d in store.list_dead_letters()] == ["a", "a", "b"]
    assert cli(url, "dead-letters", "list", "--queue", "b")[1].count("undecodable") == 1
    assert cli(url, "dead-letters", "purge")[0] == 2
    assert cli(url, "dead-letters", "purge", "--queue", "a", "--all") == (0, "purged 2 dead letters\n")
    assert cli(url, "dead-letters", "purge", "--all") == (0, "purged 1 dead letter\n")
    assert cli(url, "dead-letters", "list") == (0, "no dead letters\n")


def test_a_world_without_dead_letters_says_so() -> None:
    with pytest.raises(ConfigurationError, match="keeps no dead letters"):
        dead_letter_store(object())


def test_a_dead_letter_whose_run_was_not_failed_is_swept_by_a_consumer(wf: Workflows) -> None:
    """The move and the run's failure are two transactions: a dead letter left unsettled by a process that died
    between them is settled by the next consumer's maintenance (its run failed with the cause)."""
    from kombu import Connection, Consumer, Queue

    @wf.workflow
    def stranded() -> None:
        return None

    run = stranded.start()
    store = dead_letter_store(wf.world)
    (claim,) = store.receive(["celery"])  # type: ignore[attr-defined]
    letter = store.dead_letter(claim.receipt, reason="max-deliveries")  # ... and the process died here
    assert letter is not None and run.status == "pending"
    assert [d.id for d in store.unsettled_dead_letters()] == [letter.id]

    spec = wf.world.broker()
    with (
        Connection(spec.url, transport=spec.transport, transport_options={**spec.options, "gc_interval": 0.05}) as conn,
        Consumer(conn.channel(), [Queue("elsewhere")], callbacks=[], accept=["json"]),
    ):
        deadline = time.monotonic() + 10
        while run.status != "failed" and time.monotonic() < deadline:
            try:
                conn.drain_events(timeout=0.1)
            except TimeoutError:
                pass
    assert run.status == "failed"
    assert (run.view().error or {})["dead_letter"] == letter.id
    assert store.unsettled_dead_letters() == []


def test_a_delivery_dead_lettered_by_a_world_outage_leaves_its_run_for_a_redrive(wf: Workflows) -> None:
    """Issue #33 item 1: the World's own failure is never the workflow's outcome, not even once the delivery ran out
    of attempts. The run stays as it was; a redrive once the World is back carries it on. A delivery that failed for
    another reason still fails its run."""
    from celery_workflow import dead_letters

    @wf.workflow
    def patient(x: int) -> int:
        return x * 2

    store = dead_letter_store(wf.world)
    runs, letters = {}, {}
    for i, kind in enumerate(("WorldUnavailable", "WorldError", "ValueError"), 1):
        runs[kind] = patient.start(i)
        (claim,) = store.receive(["celery"])  # type: ignore[attr-defined]
        letter = store.dead_letter(claim.receipt, reason="max-deliveries", error=f"{kind}: injected")
        assert letter is not None and letter.run_id == runs[kind].id
        letters[kind] = letter
    failed = dead_letters.settle(wf.world, store, list(letters.values()))
    assert failed == [runs["ValueError"].id]
    assert runs["WorldUnavailable"].status == "pending" and runs["WorldError"].status == "pending"
    assert store.unsettled_dead_letters() == []

    assert store.redrive_dead_letters([letters["WorldUnavailable"].id, letters["WorldError"].id]) == 2
    worker = LocalWorker(wf)
    assert worker.run_until_complete(runs["WorldUnavailable"]).output == 2
    assert worker.run_until_complete(runs["WorldError"]).output == 4
