"""An in-memory World for tests: storage, queue and streams in process memory.

:class:`MemoryWorld` implements :class:`~celery_workflow.world.World` with the same guarantees as the durable Worlds,
minus durability and cross-process access:

* every append goes through :func:`celery_workflow.rules.plan_append` (the single source of the transition rules)
  and is applied, with the deliveries handed in with it, under one lock: all or nothing, contiguous slots;
* an append is limited in size, as on DynamoDB (:data:`MEMORY_APPEND_LIMITS`, declared as ``append_limits``): small
  on purpose, so that workflows tested on it meet batches split by the runtime (a gather of a few dozen steps), and
  a batch over the limit is refused with :class:`~celery_workflow.errors.EventInvalid`;
* event data is stored as a JSON round trip of what was appended, so callers never share objects with the World
  (tuples come back as lists, exactly as from a database);
* the queue is faithful: due times, leases that hide a claimed delivery until they expire, receipts that go stale
  when a delivery is claimed again (a stale receipt changes nothing), idempotency keys that deduplicate against a
  *pending* delivery of the same run (without a run: of the same queue) and are released when the delivery is
  claimed; the same semantics as :class:`celery_workflow._sqlite.queue.SQLiteQueue`;
* waiters (:meth:`~MemoryWorld.wait_for_terminal`, :meth:`~MemoryWorld.read_stream` with ``wait``) block on a
  condition variable and wake as soon as another thread writes.

Time comes from ``clock`` (an aware UTC ``datetime`` factory, :func:`celery_workflow.ids.utcnow` by default). Tests
may pass a controllable clock to move due times and leases forward; :meth:`MemoryWorld.next_due` tells a driver when
the next delivery becomes claimable. Timeouts of blocking calls are always real seconds.

:meth:`MemoryWorld.broker` raises :class:`~celery_workflow.errors.ConfigurationError`: Celery workers in other
processes cannot reach process memory.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import TypeVar

from celery_workflow import ids, rules
from celery_workflow._backend import template
from celery_workflow._backend.base import TemplateWorld
from celery_workflow._backend.checks import check_chunks, check_deliveries, check_stream_name
from celery_workflow._backend.children import parent_data
from celery_workflow._backend.listing import RunFilter
from celery_workflow._backend.template import AppendRequest, Loaded
from celery_workflow._backend.waiting import wait_until
from celery_workflow.errors import (
    ConfigurationError,
    EventConflict,
    EventInvalid,
    HookNotFound,
    RunNotFound,
    StepNotFound,
)
from celery_workflow.events import Event, EventType, HookView, RunStatus, RunView, StepView, WaitView
from celery_workflow.schedules.memory import MemorySchedules
from celery_workflow.world import (
    DEFAULT_MAX_PAYLOAD,
    AppendLimits,
    BrokerSpec,
    Capabilities,
    ClaimedDelivery,
    Delivery,
    NewRun,
    Page,
    StreamChunk,
    StreamPage,
    Upkeep,
)

__all__ = ["MEMORY_APPEND_LIMITS", "MemoryWorld"]

R = TypeVar("R")

#: What one append of a :class:`MemoryWorld` may carry by default: 50 actions, 2 of them reserved (as DynamoDB's run
#: record and ack), an event or a delivery 1 each, and 2 MB. Small, so that a gather of a few dozen steps is split.
MEMORY_APPEND_LIMITS = AppendLimits(max_actions=50, reserved_actions=2, max_bytes=2_000_000)


@dataclass(slots=True)
class _Stream:
    chunks: list[bytes] = field(default_factory=list)
    closed: bool = False


@dataclass(slots=True)
class _Run:
    view: RunView
    events: list[Event]
    steps: dict[str, StepView] = field(default_factory=dict)  # insertion order = creation order
    hooks: dict[str, HookView] = field(default_factory=dict)
    waits: dict[str, WaitView] = field(default_factory=dict)
    streams: dict[str, _Stream] = field(default_factory=dict)
    retentions: dict[str, rules.RetainedToken] = field(default_factory=dict)  # live hooks asking for one, by id


@dataclass(slots=True)
class _Queued:
    seq: int
    queue: str
    payload: bytes
    run_id: str | None
    due: datetime
    idempotency_key: str | None
    attempts: int = 0
    receipt: str | None = None
    lease_until: datetime | None = None

    def claimable(self, now: datetime) -> bool:
        return self.due <= now and (self.lease_until is None or self.lease_until <= now)


def _key_scope(run_id: str | None, queue: str, key: str | None) -> tuple[bool, str, str] | None:
    """What an idempotency key deduplicates against: pending deliveries of the same run (without a run: of the queue)."""
    if key is None:
        return None
    return (run_id is None, queue if run_id is None else run_id, key)


class MemoryWorld(TemplateWorld):
    """A complete World in process memory, thread-safe (one lock and one condition variable)."""

    capabilities = Capabilities()
    routes: Mapping[str, str] = MappingProxyType({})
    queue_names: frozenset[str] | None = None  # the queue table takes any name
    #: The largest value it stores: the same as the SQL Worlds (the event-data limit less the event's other fields).
    max_payload: int = DEFAULT_MAX_PAYLOAD

    def __init__(
        self,
        *,
        poll_interval: float = 0.05,
        clock: Callable[[], datetime] = ids.utcnow,
        append_limits: AppendLimits = MEMORY_APPEND_LIMITS,
        batch_steps: bool = False,
    ) -> None:
        """``append_limits``: what one append may carry (``world.NO_APPEND_LIMITS``: any batch). ``batch_steps``:
        declare, as the AWS World does, that appends are paid for one by one (``AppendLimits.batch_steps``): the
        quick inline steps of a delivery then share its appends."""
        self.poll_interval = poll_interval
        self.append_limits = replace(append_limits, batch_steps=True) if batch_steps else append_limits
        self._clock = clock
        self._cond = threading.Condition(threading.Lock())
        self._runs: dict[str, _Run] = {}
        self._tokens: dict[str, tuple[str, str]] = {}  # token -> (run id, hook id) of its live owner
        self._retained: dict[str, rules.RetainedToken] = {}  # token -> its holding by an ended run (see rules)
        self._queue: dict[int, _Queued] = {}
        self._receipts: dict[str, int] = {}  # current receipt -> delivery seq
        self._keys: dict[tuple[bool, str, str], int] = {}  # key scope -> pending delivery seq (see _key_scope)
        self._seq = itertools.count(1)
        self._version = 0  # bumped by every change, under the lock: what waiters watch
        self._leases: dict[str, tuple[str, datetime]] = {}  # lease name -> (holder, until)
        self._steps = _MemoryAppend(self)
        #: The schedules (:mod:`celery_workflow.schedules`).
        self.schedule_store = MemorySchedules()

    def _now(self) -> datetime:
        return ids.to_utc(self._clock())

    def _changed(self) -> None:
        """Wake every waiter (lock held)."""
        self._version += 1
        self._cond.notify_all()

    def _wait(self, version: int, seconds: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._version != version, seconds)

    # -- what a relay watches (celery_workflow.relay): changes and named leases -----------------------------------

    def change_token(self) -> int:
        """A value every change of the World moves on."""
        with self._cond:
            return self._version

    def wait_for_change(self, token: int, timeout: float) -> bool:
        """Block until the World changed after ``token`` was taken (True), or ``timeout`` seconds pass."""
        self._wait(token, timeout)
        with self._cond:
            return self._version != token

    def hold_lease(self, name: str, holder: str, seconds: float) -> bool:
        with self._cond:
            now = self._now()
            current = self._leases.get(name)
            if current is not None and current[0] != holder and current[1] > now:
                return False
            self._leases[name] = (holder, now + timedelta(seconds=seconds))
            return True

    def drop_lease(self, name: str, holder: str) -> None:
        with self._cond:
            if self._leases.get(name, ("", None))[0] == holder:
                del self._leases[name]

    def create_run(self, run: NewRun, deliveries: Sequence[Delivery] = ()) -> tuple[RunView, bool]:
        view, event = template.prepare_run(run, deliveries, self._now())
        with self._cond:
            existing = self._runs.get(run.run_id)
            if existing is not None:
                return template.existing_run(existing.view, run)
            self._runs[run.run_id] = _Run(view, [event])
            self._insert(deliveries)
            self._changed()
            return view, True

    def _apply(self, run: _Run, plan: rules.Plan) -> None:
        run.events.extend(plan.events)
        run.view = plan.run
        run.steps.update(plan.steps)
        run.waits.update(plan.waits)
        for hook_id, hook in plan.hooks_deleted.items():
            run.hooks.pop(hook_id, None)
            run.retentions.pop(hook_id, None)
            if self._tokens.get(hook.token) == (hook.run_id, hook_id):
                del self._tokens[hook.token]
        for token in plan.tokens_reclaimed:
            self._retained.pop(token, None)
        for hook_id, hook in plan.hooks_inserted.items():
            run.hooks[hook_id] = hook
            self._tokens[hook.token] = (hook.run_id, hook_id)
        run.retentions.update(plan.retentions)
        if plan.run_ended:
            for hook_id, hook in run.hooks.items():
                if self._tokens.get(hook.token) == (hook.run_id, hook_id):
                    del self._tokens[hook.token]
            run.hooks.clear()
            run.waits.clear()
            run.retentions.clear()
            self._retained.update(plan.tokens_retained)

    def _get(self, run_id: str) -> _Run:
        run = self._runs.get(run_id)
        if run is None:
            raise RunNotFound(f"run {run_id} does not exist")
        return run

    def get_run(self, run_id: str) -> RunView:
        with self._cond:
            return self._get(run_id).view

    def get_run_with_events(self, run_id: str) -> tuple[RunView, list[Event]]:
        with self._cond:
            run = self._get(run_id)
            return run.view, list(run.events)

    def list_runs(
        self,
        *,
        workflow: str | None = None,
        status: RunStatus | str | None = None,
        limit: int = 100,
        cursor: str | None = None,
        run_id_prefix: str | None = None,
        created_from: datetime | None = None,
        created_until: datetime | None = None,
    ) -> Page[RunView]:
        wanted = RunFilter.of(
            workflow=workflow,
            status=status,
            limit=limit,
            cursor=cursor,
            run_id_prefix=run_id_prefix,
            created_from=created_from,
            created_until=created_until,
        )
        with self._cond:
            views = [r.view for r in self._runs.values() if wanted.matches(r.view)]
        return wanted.page(wanted.newest_first(views)[: limit + 1])

    def list_events(self, run_id: str, *, after_slot: int = 0, limit: int | None = None) -> list[Event]:
        with self._cond:
            log = self._get(run_id).events
            out = log[max(after_slot, 0) :]
        return out if limit is None else out[: max(limit, 0)]

    def get_step(self, run_id: str, step_id: str) -> StepView:
        with self._cond:
            step = self._get(run_id).steps.get(step_id)
        if step is None:
            raise StepNotFound(f"step {step_id} of run {run_id} does not exist")
        return step

    def list_steps(self, run_id: str) -> list[StepView]:
        with self._cond:
            return list(self._get(run_id).steps.values())

    def get_hook_by_token(self, token: str) -> HookView:
        with self._cond:
            owner = self._tokens.get(token)
            if owner is None:
                held = self._retained.get(token)
                if held is not None and held.holds(self._now()):
                    raise rules.retained_error(held)
                raise HookNotFound(f"no live hook owns token {token!r}")
            return self._runs[owner[0]].hooks[owner[1]]

    def list_hooks(self, run_id: str) -> list[HookView]:
        with self._cond:
            return list(self._get(run_id).hooks.values())

    def list_waits(self, run_id: str) -> list[WaitView]:
        with self._cond:
            return list(self._get(run_id).waits.values())

    def wait_for_terminal(self, run_id: str, timeout: float | None) -> RunView:
        return wait_until(
            lambda: self.get_run(run_id),
            lambda view: view.status.terminal,
            timeout=timeout,
            poll_interval=self.poll_interval,
            mark=lambda: self._version,
            wait=self._wait,
        )

    # -- queue -------------------------------------------------------------------------------------------------------

    def _insert(self, deliveries: Sequence[Delivery]) -> list[bool]:
        """Store deliveries (lock held). False for one deduplicated by a pending delivery's idempotency key."""
        now = self._now()
        out = []
        for d in deliveries:
            scope = _key_scope(d.run_id, d.queue, d.idempotency_key)
            if scope is not None and scope in self._keys:
                out.append(False)
                continue
            seq = next(self._seq)
            due = ids.to_utc(d.not_before) if d.not_before is not None else now
            self._queue[seq] = _Queued(seq, d.queue, d.payload, d.run_id, due, d.idempotency_key)
            if scope is not None:
                self._keys[scope] = seq
            out.append(True)
        return out

    def enqueue(self, deliveries: Sequence[Delivery]) -> list[bool]:
        check_deliveries(deliveries)
        with self._cond:
            out = self._insert(deliveries)
            self._changed()
            return out

    def claim(self, queues: Sequence[str], *, limit: int = 1, lease: float = 60.0) -> list[ClaimedDelivery]:
        if lease <= 0:
            raise ValueError("lease must be positive")
        names = set(queues)
        with self._cond:
            now = self._now()
            ready = sorted(
                (q for q in self._queue.values() if q.queue in names and q.claimable(now)),
                key=lambda q: (q.due, q.seq),
            )[: max(limit, 0)]
            out = []
            for q in ready:
                if q.receipt is not None:
                    del self._receipts[q.receipt]
                scope = _key_scope(q.run_id, q.queue, q.idempotency_key)
                if scope is not None:  # claiming releases the key
                    del self._keys[scope]
                    q.idempotency_key = None
                q.receipt = f"rcpt_{ids.ulid()}"
                q.lease_until = now + timedelta(seconds=lease)
                q.attempts += 1
                self._receipts[q.receipt] = q.seq
                out.append(ClaimedDelivery(q.receipt, q.queue, q.payload, q.attempts, q.run_id))
            return out

    def _claimed(self, receipt: str) -> _Queued | None:
        seq = self._receipts.get(receipt)
        return None if seq is None else self._queue[seq]

    def ack(self, receipt: str) -> None:
        """Delete the delivery if ``receipt`` is its current claim; a stale or unknown receipt is a no-op."""
        with self._cond:
            self._ack(receipt)

    def _ack(self, receipt: str) -> None:
        q = self._claimed(receipt)
        if q is not None:
            del self._receipts[receipt]
            del self._queue[q.seq]

    def release(self, receipt: str) -> None:
        """Clear the lease: claimable again at once, keeping its place (due time). A stale receipt is a no-op."""
        self._unlease(receipt, None)

    def retry_later(self, receipt: str, delay: float, *, error: str | None = None) -> None:
        """Clear the lease and make the delivery due ``delay`` seconds from now. A stale receipt is a no-op."""
        self._unlease(receipt, max(delay, 0.0))

    def _unlease(self, receipt: str, delay: float | None) -> None:
        with self._cond:
            q = self._claimed(receipt)
            if q is not None:
                del self._receipts[receipt]
                q.receipt = None
                q.lease_until = None
                if delay is not None:
                    q.due = self._now() + timedelta(seconds=delay)
                self._changed()

    def extend(self, receipts: Sequence[str], lease: float) -> None:
        """Set the lease of each still-held claim to ``lease`` seconds from now; stale receipts are skipped."""
        with self._cond:
            until = self._now() + timedelta(seconds=lease)
            for receipt in receipts:
                q = self._claimed(receipt)
                if q is not None:
                    q.lease_until = until

    # -- extras for test drivers -------------------------------------------------------------------------------------

    def pending(self, queues: Sequence[str] | None = None) -> list[Delivery]:
        """Every stored delivery (claimed or not), in claim order, as :class:`Delivery` records."""
        with self._cond:
            stored = sorted(self._queue.values(), key=lambda q: (q.due, q.seq))
            return [
                Delivery(q.queue, q.payload, q.run_id, q.due, q.idempotency_key)
                for q in stored
                if queues is None or q.queue in queues
            ]

    def next_due(self, queues: Sequence[str] | None = None) -> datetime | None:
        """When the next delivery of these queues becomes claimable (due and unleased); None when the queue is empty."""
        with self._cond:
            times = [
                max(q.due, q.lease_until or q.due) for q in self._queue.values() if queues is None or q.queue in queues
            ]
        return min(times, default=None)

    # -- streams -----------------------------------------------------------------------------------------------------

    def write_stream(self, run_id: str, name: str, chunks: Sequence[bytes]) -> int:
        check_stream_name(name)
        data = check_chunks(chunks)
        with self._cond:
            stream = self._get(run_id).streams.setdefault(name, _Stream())
            if stream.closed:
                raise EventConflict(f"stream {name!r} of run {run_id} is closed")
            stream.chunks.extend(data)
            self._changed()
            return len(stream.chunks)

    def close_stream(self, run_id: str, name: str) -> None:
        check_stream_name(name)
        with self._cond:
            self._get(run_id).streams.setdefault(name, _Stream()).closed = True
            self._changed()

    def read_stream(
        self, run_id: str, name: str, *, start: int = 0, limit: int | None = None, wait: float = 0.0
    ) -> StreamPage:
        if start < 0:
            raise ValueError("start must be >= 0")
        page, _ = wait_until(  # a reader of an ended run waits for nothing: it reads what is there
            lambda: self._read_stream(run_id, name, start, limit),
            lambda read: bool(read[0].chunks or read[0].closed or read[1]),
            timeout=max(wait, 0.0),
            poll_interval=self.poll_interval,
            mark=lambda: self._version,
            wait=self._wait,
        )
        return page

    def _read_stream(self, run_id: str, name: str, start: int, limit: int | None) -> tuple[StreamPage, bool]:
        """The page, and whether the run has ended."""
        with self._cond:
            run = self._get(run_id)
            ended = run.view.status.terminal
            stream = run.streams.get(name)
            chunks = stream.chunks[start:] if stream is not None else []
            closed = stream is not None and stream.closed
            total = len(stream.chunks) if stream is not None else 0
        if limit is not None:
            chunks = chunks[: max(limit, 0)]
        page = StreamPage(
            [StreamChunk(start + i, c) for i, c in enumerate(chunks)],
            closed and start + len(chunks) >= total,
            start + len(chunks),
        )
        return page, ended

    def list_streams(self, run_id: str) -> list[str]:
        with self._cond:
            return sorted(self._get(run_id).streams)

    # -- wiring ------------------------------------------------------------------------------------------------------

    def broker(self) -> BrokerSpec:
        raise ConfigurationError("MemoryWorld lives in one process; Celery workers cannot consume it")

    def start_upkeep(self) -> Upkeep | None:
        return None

    def close(self) -> None:
        with self._cond:
            self._changed()


class _MemoryAppend:
    """The append template's steps (:mod:`celery_workflow._backend.template`) for one :class:`MemoryWorld`: the
    whole append runs under the World's lock."""

    def __init__(self, world: MemoryWorld) -> None:
        self.world = world

    def now(self) -> datetime:
        return self.world._now()

    def transaction(self, body: Callable[[None], R], request: AppendRequest) -> R:
        limits = self.world.append_limits
        if not limits.unlimited:  # refused as DynamoDB refuses a transaction over its limits, before any read
            actions, size = limits.cost(request.batch, request.deliveries)
            if not limits.fits(actions, size):
                raise EventInvalid(
                    f"this append of run {request.run_id} needs {actions} actions and {size} bytes; the in-memory"
                    f" World takes at most {limits.max_actions or 'any number of'} actions and"
                    f" {limits.max_bytes or 'any number of'} bytes per append (append_limits)"
                )
        with self.world._cond:
            result = body(None)
            self.world._changed()
            return result

    def load(self, tx: None, request: AppendRequest, *, fresh: bool) -> Loaded:
        keys = request.keys
        run = self.world._runs.get(request.run_id)
        snapshot = rules.Snapshot(run.view if run is not None else None)
        if run is not None:
            snapshot.steps = {k: run.steps[k] for k in keys.steps if k in run.steps}
            snapshot.hooks = {k: run.hooks[k] for k in keys.hooks if k in run.hooks}
            snapshot.waits = {k: run.waits[k] for k in keys.waits if k in run.waits}
            if keys.hooks:
                snapshot.created_hooks = {
                    str(e.correlation_id)
                    for e in run.events
                    if e.event_type in (EventType.HOOK_CREATED, EventType.HOOK_CONFLICT)
                    and e.correlation_id in keys.hooks
                }
            for token in keys.tokens:
                owner = self.world._tokens.get(token)
                if owner is not None:
                    snapshot.token_owners[token] = self.world._runs[owner[0]].hooks[owner[1]]
                elif token in self.world._retained:
                    snapshot.retained[token] = self.world._retained[token]
            snapshot.retentions = dict(run.retentions)
            snapshot.parent, snapshot.parent_known = parent_data(run.events[:1]), True
        return Loaded(snapshot)

    def write(self, tx: None, request: AppendRequest, plan: rules.Plan) -> None:
        self.world._apply(self.world._runs[plan.run.run_id], plan)
        self.world._insert(request.deliveries)
        if request.ack is not None:
            self.world._ack(request.ack)

    def load_linked(self, tx: None, request: AppendRequest) -> rules.Snapshot:
        return self.load(tx, request, fresh=True).snapshot

    def write_linked(self, tx: None, request: AppendRequest, plan: rules.Plan, linked: template.Linked | None) -> None:
        self.write(tx, request, plan)
        if linked is not None:  # under the same lock: the child's end and the parent's wake-up are one change
            self.write(tx, linked.request, linked.plan)

    # -- storage -----------------------------------------------------------------------------------------------------
