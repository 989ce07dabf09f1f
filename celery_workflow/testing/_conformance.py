"""Helpers shared by the World conformance suite modules (not part of the public API)."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, TypeVar

import pytest

from celery_workflow import ids
from celery_workflow.events import EventType, NewEvent, RunView
from celery_workflow.world import Capabilities, ClaimedDelivery, Delivery, NewRun, World

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

#: The attribute :func:`requires` sets on a test function.
REQUIRES = "__celery_workflow_requires__"


def requires(*capabilities: str) -> Callable[[F], F]:
    """Mark a conformance test as needing these :class:`~celery_workflow.world.Capabilities`: a World that lacks
    one skips it, saying which and why (see :class:`Conformance`)."""
    for name in capabilities:
        Capabilities.describe(name)  # KeyError for a misspelt capability

    def mark(fn: F) -> F:
        setattr(fn, REQUIRES, (*getattr(fn, REQUIRES, ()), *capabilities))
        return fn

    return mark


def skip_reason(world: World, test: Callable[..., Any]) -> str | None:
    """Why ``test`` does not apply to ``world`` (a capability it :func:`requires` that the World lacks), or None."""
    needed: tuple[str, ...] = getattr(test, REQUIRES, ())
    lacking = [name for name in needed if not getattr(world.capabilities, name)]
    if not lacking:
        return None
    reasons = "; ".join(f"{name} ({Capabilities.describe(name)})" for name in lacking)
    return f"{type(world).__name__} declares it lacks {reasons}"


class Conformance:
    """Base of every conformance class: skips a test whose :func:`requires` names a capability the World lacks."""

    @pytest.fixture(autouse=True)
    def _skip_without_capabilities(self, request: pytest.FixtureRequest, world: World) -> None:
        reason = skip_reason(world, request.function)
        if reason is not None:
            pytest.skip(reason)


#: Longest time any conformance test waits for something another thread or the clock brings about.
DEADLINE = 10.0


def unique(prefix: str) -> str:
    return f"{prefix}_{ids.ulid()}"


def in_seconds(seconds: float) -> datetime:
    return ids.utcnow() + timedelta(seconds=seconds)


def iso_in(seconds: float) -> str:
    return ids.isoformat(in_seconds(seconds))


def ev(kind: EventType, cid: str | None = None, **data: Any) -> NewEvent:
    return NewEvent(kind, cid, data)


def step_created(step_id: str, name: str = "step", args: list[Any] | None = None) -> NewEvent:
    return ev(EventType.STEP_CREATED, step_id, step_name=name, input={"args": args or [], "kwargs": {}})


def hook_created(hook_id: str, token: str, **data: Any) -> NewEvent:
    return ev(EventType.HOOK_CREATED, hook_id, token=token, **data)


def create(
    world: World,
    *,
    workflow: str = "wf",
    run_id: str | None = None,
    deliveries: tuple[Delivery, ...] = (),
    started: bool = False,
) -> RunView:
    """A new run (optionally with ``run_started`` appended)."""
    view, created = world.create_run(
        NewRun(run_id or ids.new_run_id(), workflow, {"args": [1], "kwargs": {}}), deliveries
    )
    assert created
    if started:
        view = world.append(view.run_id, [ev(EventType.RUN_STARTED)]).run
    return view


def eventually(probe: Callable[[], T | None], *, timeout: float = DEADLINE, interval: float = 0.01) -> T:
    """Poll ``probe`` until it returns something other than None; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


def claim_one(world: World, queue: str, *, lease: float = 60.0) -> ClaimedDelivery | None:
    got = world.claim([queue], limit=1, lease=lease)
    return got[0] if got else None


def drain(world: World, queue: str) -> list[ClaimedDelivery]:
    """Claim (and ack) everything claimable on ``queue`` now."""
    out: list[ClaimedDelivery] = []
    while batch := world.claim([queue], limit=100, lease=60.0):
        out.extend(batch)
        for claimed in batch:
            world.ack(claimed.receipt)
    return out


def delivery(queue: str, payload: bytes = b"m", **kwargs: Any) -> Delivery:
    return Delivery(queue, payload, **kwargs)
