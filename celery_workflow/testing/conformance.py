"""The World conformance suite: method-level tests every World passes.

A World runs the suite by subclassing :class:`WorldConformance` in a test module and providing a ``world`` fixture
that yields a fresh World per test (kombu's ``t/integration/common.py`` style)::

    import pytest
    from celery_workflow.testing.conformance import WorldConformance
    from celery_workflow.world_sqlite import SQLiteWorld

    class TestSQLiteWorld(WorldConformance):
        @pytest.fixture
        def world(self, tmp_path):
            w = SQLiteWorld(tmp_path / "world.db")
            yield w
            w.close()

The base classes carry no ``Test`` prefix, so pytest collects only the subclasses. The suite waits on conditions with
deadlines, never on fixed sleeps; short leases (0.2 s) and due times keep it fast. What it pins down:

* storage (:class:`StorageConformance`): ``create_run`` at slot 1, idempotent by run id, atomic with its deliveries;
  appends at contiguous slots, all or nothing (a rejected batch writes no event, view or delivery), ``expected_count``;
  views and listings (newest-first runs with filters and cursor paging; steps, hooks and waits in creation order);
* the rules of :mod:`celery_workflow.rules` observed through the World (:class:`RunRulesConformance`,
  :class:`StepRulesConformance`, :class:`HookRulesConformance`, :class:`WaitRulesConformance`,
  :class:`TokenRetentionConformance`: a finished run's retained tokens);
* the queue (:class:`QueueConformance`): due times, leases, stale receipts, idempotency keys, queue names;
* streams, blocking waits and concurrent writers (:class:`StreamConformance`, :class:`WaitForTerminalConformance`,
  :class:`ConcurrencyConformance`);
* workflows under World faults (:class:`FaultConformance`): a World error at any call is retried, never the run's
  outcome; a write refused as malformed fails its run or step at once;
* fan-outs wider than one append (:class:`FanOutConformance`): the runtime splits what one delivery writes within
  the World's declared ``append_limits``, a failure between two appends is recovered, and the limits hold;
* versioned code (:class:`VersioningConformance`): ``patched()`` keeps an old run on its old path and records the
  new path of a new run, read back by its later deliveries;
* deadlines (:class:`DeadlineConformance`): a run past its deadline fails with ``RunTimedOut`` (woken from a sleep or
  a hook wait; its queued steps do not run), a step attempt past its timeout is a failed attempt;
* schedules (:class:`ScheduleConformance`): the World's schedule store (add once, compare-and-set on the version),
  and the ticker on it: one run per tick across several tickers, catch-up, overlap, pause and resume, a lease that
  ran out;
* child runs (:class:`ChildRunConformance`): a child's end writes its parent's ``child_ended`` and wake-up (in
  the same transaction on every built-in World), an ended parent takes nothing, and a parent gathers its
  children and cancels them when it is cancelled.

Capabilities: a World whose broker cannot promise everything (standard SQS: unordered claims, whole seconds, no
deduplication; DynamoDB's indexes: eventually consistent listings) says so in its ``capabilities``
(:class:`~celery_workflow.world.Capabilities`). The cases that need a capability are marked with :func:`requires`;
the suite skips exactly those on a World that lacks it, with the capability and its meaning as the skip reason
(``pytest -rs`` prints them), and runs every other case unchanged.

Behaviour the suite fixes where :mod:`celery_workflow.world` leaves room: ack/release/retry_later/extend with a stale
or unknown receipt do nothing; per-run listings of an unknown run raise :class:`~celery_workflow.errors.RunNotFound`;
a no-op append (a repeated ``run_started`` or ``run_cancelled``) still stores its deliveries; ``StreamPage.closed`` is
true when the stream is closed and the page reaches its last chunk.
"""

from __future__ import annotations

from celery_workflow.testing._conformance import Conformance, requires
from celery_workflow.testing.conformance_children import ChildRunConformance
from celery_workflow.testing.conformance_concurrency import (
    ConcurrencyConformance,
    StreamConformance,
    WaitForTerminalConformance,
)
from celery_workflow.testing.conformance_deadlines import DeadlineConformance
from celery_workflow.testing.conformance_fanout import FanOutConformance
from celery_workflow.testing.conformance_faults import FaultConformance
from celery_workflow.testing.conformance_queue import QueueConformance
from celery_workflow.testing.conformance_rules import (
    HookRulesConformance,
    RunRulesConformance,
    StepRulesConformance,
    TokenRetentionConformance,
    WaitRulesConformance,
)
from celery_workflow.testing.conformance_schedules import ScheduleConformance
from celery_workflow.testing.conformance_storage import StorageConformance
from celery_workflow.testing.conformance_versions import VersioningConformance

__all__ = [
    "ChildRunConformance",
    "ConcurrencyConformance",
    "Conformance",
    "DeadlineConformance",
    "FanOutConformance",
    "FaultConformance",
    "HookRulesConformance",
    "QueueConformance",
    "RunRulesConformance",
    "ScheduleConformance",
    "StepRulesConformance",
    "StorageConformance",
    "StreamConformance",
    "TokenRetentionConformance",
    "VersioningConformance",
    "WaitForTerminalConformance",
    "WaitRulesConformance",
    "WorldConformance",
    "requires",
]


class WorldConformance(
    StorageConformance,
    RunRulesConformance,
    StepRulesConformance,
    HookRulesConformance,
    WaitRulesConformance,
    TokenRetentionConformance,
    QueueConformance,
    StreamConformance,
    WaitForTerminalConformance,
    ConcurrencyConformance,
    FaultConformance,
    FanOutConformance,
    VersioningConformance,
    DeadlineConformance,
    ScheduleConformance,
    ChildRunConformance,
):
    """Every conformance test. Subclass it as ``Test<World>`` and provide a ``world`` fixture."""
