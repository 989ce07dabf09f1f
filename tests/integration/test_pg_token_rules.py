"""Token retention on the Postgres World (DESIGN §3; seed postgres-world.txt, "Retention"): a run's end deletes its
hooks but keeps the tokens whose retention has not ended, and the retention sweep keeps such a run until it ends.

The rules every World follows are :class:`~celery_workflow.testing.conformance_rules.TokenRetentionConformance`
(part of the conformance suite); the sweep, the message a resume gets and concurrent claimants are the Postgres
World's own.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from celery_workflow import ids
from celery_workflow.errors import HookNotFound
from celery_workflow.events import EventType
from celery_workflow.testing._conformance import create, ev, eventually, hook_created, iso_in, unique
from celery_workflow.world_pg import PostgresWorld
from tests.integration.pg_fixtures import pg_schema_fixture, pg_url_fixture, pg_world_fixture  # noqa: F401


@pytest.fixture
def kept_world(pg_url: str) -> Iterator[PostgresWorld]:
    """A World that deletes runs one second after they end."""
    world = PostgresWorld.open(pg_url, retention=timedelta(seconds=1))
    yield world
    world.close()


def test_resuming_a_retained_token_says_its_run_ended(pg_world: PostgresWorld) -> None:
    owner = create(pg_world, started=True)
    token = unique("tok")
    until = iso_in(3600)
    pg_world.append(owner.run_id, [hook_created("h", token, token_retention_until=until)])
    pg_world.append(owner.run_id, [ev(EventType.RUN_FAILED, error={"type": "E", "message": "x"})])
    with pytest.raises(HookNotFound, match=f"run {owner.run_id}, which has ended") as raised:
        pg_world.get_hook_by_token(token)
    assert ids.parse_iso(raised.value.message.rsplit(" ", 1)[-1]) == ids.parse_iso(until)
    with pytest.raises(HookNotFound, match="no live hook owns token"):
        pg_world.get_hook_by_token(unique("tok"))


def test_the_sweep_keeps_a_run_whose_token_is_retained_until_the_retention_ends(kept_world: PostgresWorld) -> None:
    retained, plain = create(kept_world, started=True), create(kept_world, started=True)
    token = unique("tok")
    kept_world.append(retained.run_id, [hook_created("h", token, token_retention_until=iso_in(3600))])
    kept_world.append(plain.run_id, [hook_created("h", unique("tok"))])
    for run in (retained, plain):
        kept_world.append(run.run_id, [ev(EventType.RUN_COMPLETED, output=None)])
    now = ids.utcnow()
    assert kept_world.sweep_expired(now=now + timedelta(minutes=5)) == 1  # the run without a retained token
    assert kept_world.get_run(retained.run_id).status == "completed"
    claimant = create(kept_world, started=True)
    (conflict,) = kept_world.append(claimant.run_id, [hook_created("a", token)]).events
    assert conflict.event_type is EventType.HOOK_CONFLICT
    assert kept_world.sweep_expired(now=now + timedelta(hours=2)) == 1  # the token's retention has ended by then
    assert [r.run_id for r in kept_world.list_runs().items] == [claimant.run_id]
    # the run's token went with it
    (created,) = kept_world.append(claimant.run_id, [hook_created("b", token)]).events
    assert created.event_type is EventType.HOOK_CREATED


def test_concurrent_claimants_of_a_retained_token_conflict_then_exactly_one_wins(pg_world: PostgresWorld) -> None:
    owner = create(pg_world, started=True)
    token = unique("tok")
    pg_world.append(owner.run_id, [hook_created("h", token, token_retention_until=iso_in(2))])
    pg_world.append(owner.run_id, [ev(EventType.RUN_COMPLETED, output=None)])
    claimants = [create(pg_world, started=True) for _ in range(6)]

    def race(hook_id: str) -> list[Any]:
        results: list[Any] = [None] * len(claimants)
        barrier = threading.Barrier(len(claimants))

        def claim(i: int) -> None:
            barrier.wait()
            try:
                results[i] = pg_world.append(claimants[i].run_id, [hook_created(hook_id, token)]).events[0]
            except Exception as exc:
                results[i] = exc

        threads = [threading.Thread(target=claim, args=(i,)) for i in range(len(claimants))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return results

    while_retained = race("early")
    assert all(e.event_type is EventType.HOOK_CONFLICT for e in while_retained), while_retained
    assert {e.data["conflicting_run_id"] for e in while_retained} == {owner.run_id}

    eventually(lambda: True if _retention_ended(pg_world, token) else None, timeout=15, interval=0.1)
    after = race("late")
    kinds = sorted(e.event_type for e in after)
    assert kinds.count(EventType.HOOK_CREATED) == 1 and kinds.count(EventType.HOOK_CONFLICT) == 5, after
    (winner,) = [c for c, e in zip(claimants, after, strict=True) if e.event_type is EventType.HOOK_CREATED]
    assert pg_world.get_hook_by_token(token).run_id == winner.run_id
    assert {e.data["conflicting_run_id"] for e in after if e.event_type is EventType.HOOK_CONFLICT} == {winner.run_id}


def _retention_ended(world: PostgresWorld, token: str) -> bool:
    """Whether the token's retained row has outlived its retention (by this process's clock, as the World decides)."""
    try:
        world.get_hook_by_token(token)
    except HookNotFound as exc:
        return "stays reserved" not in exc.message
    return False
