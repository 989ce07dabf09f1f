"""The World protocol: storage (event log and views), queue (deliveries) and streams.

A World is everything durable about workflows. Every World applies the rules of :mod:`celery_workflow.events`
(:func:`~celery_workflow.rules.plan_append`) and stores each append atomically: the events at contiguous slots, the
view changes and the deliveries handed in with them. The shape fits a DynamoDB World too: an append is one
conditional transaction on the run's event count (at most 100 items), reads are consistent, and every listing goes
through a key or an index.

Deliveries are opaque bytes to a World (a Celery message envelope built by :mod:`celery_workflow.app`); the World
stores them on a named queue with a due time and an optional idempotency key, which deduplicates against a *pending*
delivery of the same run (claiming a delivery releases its key, so a delivery queued during execution is never lost).

Worlds are selected by URL with :func:`open_world`. The scheme names an entry point of the group
``celery_workflow.worlds`` (:data:`ENTRY_POINT_GROUP`): this package registers ``sqlite`` (the embedded default),
``postgresql`` and ``postgres``; a third-party World registers its own scheme the same way, in its package metadata::

    [options.entry_points]
    celery_workflow.worlds =
        mystore = my_package.world:MyWorld.from_url    # called as factory(url, **options) -> World

A World's queue methods are :class:`~celery_workflow._backend.queue_contract.WorldQueue`'s, the first layer of the
queue contract every queue store and transport store in the package shares.

This module names no backend: it only defines what every World is (``docs/adding-a-world.md`` walks through writing
one) and resolves URLs through that table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from importlib.metadata import entry_points
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from celery_workflow import codec
from celery_workflow._backend.queue_contract import WorldQueue
from celery_workflow.errors import ConfigurationError
from celery_workflow.event_data import RunCreatedData
from celery_workflow.events import Event, HookView, NewEvent, RunStatus, RunView, StepView, WaitView

T = TypeVar("T")

#: The queue that carries deliveries of unrouted workflows (Celery's default queue name).
DEFAULT_QUEUE = "celery"

#: :attr:`World.max_payload` of a World whose views keep no more than the event data does (SQLite, Postgres, the
#: in-memory World), and of one that declares none: the event-data limit every World checks
#: (:data:`codec.MAX_PAYLOAD_BYTES`) less the room the event keeps for its other fields (:data:`codec.EVENT_ROOM`).
DEFAULT_MAX_PAYLOAD = codec.MAX_PAYLOAD_BYTES - codec.EVENT_ROOM


@dataclass(frozen=True, slots=True)
class Delivery:
    """A message to put on a queue."""

    queue: str
    payload: bytes
    run_id: str | None = None
    not_before: datetime | None = None
    idempotency_key: str | None = None


@dataclass(frozen=True, slots=True)
class ClaimedDelivery:
    """A delivery claimed with a lease. ``receipt`` identifies this claim for ack/release/extend."""

    receipt: str
    queue: str
    payload: bytes
    attempts: int
    run_id: str | None = None


#: The keys under which a transport puts its claim in a message's ``delivery_info`` (see :class:`Claim`).
RECEIPT_KEY = "cw_receipt"
ATTEMPTS_KEY = "cw_attempts"


@dataclass(frozen=True, slots=True)
class Claim:
    """A transport's claim of the delivery being handled, as the runtime receives it: the ``receipt`` that acks it
    (``World.append(ack=…)``) and how many times it was received, this time included.

    A transport puts it in the message's ``delivery_info`` (:meth:`delivery_info`); the worker side reads it back
    with :meth:`from_delivery_info`, so the two keys are written and read in one place.
    """

    receipt: str
    attempts: int = 1

    def delivery_info(self) -> dict[str, Any]:
        return {RECEIPT_KEY: self.receipt, ATTEMPTS_KEY: self.attempts}

    def headers(self) -> dict[str, Any]:
        """The claim as message headers (the relay's messages on the app's broker carry it there)."""
        return {RECEIPT_KEY: self.receipt, ATTEMPTS_KEY: self.attempts}

    @classmethod
    def from_attributes(cls, request: Any) -> Claim | None:
        """The claim the relay put in a message's headers, read from what shows them as attributes (a Celery task's
        request); None for a message without one."""
        return cls.from_delivery_info(
            {RECEIPT_KEY: getattr(request, RECEIPT_KEY, None), ATTEMPTS_KEY: getattr(request, ATTEMPTS_KEY, 1)}
        )

    @classmethod
    def from_delivery_info(cls, info: Mapping[str, Any] | None) -> Claim | None:
        """The claim a transport of ours put in ``info``; None for a message that did not come from one."""
        receipt = (info or {}).get(RECEIPT_KEY)
        if not receipt:
            return None
        try:
            attempts = max(1, int((info or {}).get(ATTEMPTS_KEY, 1)))
        except (TypeError, ValueError):
            attempts = 1
        return cls(str(receipt), attempts)


@dataclass(frozen=True, slots=True)
class NewRun:
    run_id: str
    workflow_name: str
    input: Any  # JSON: {"args": [...], "kwargs": {...}}
    queue: str | None = None
    #: the run this one continues (``continue_as_new``); recorded in its ``run_created``
    continues: str | None = None
    #: when the run times out (its workflow's ``timeout`` from its creation); recorded in its ``run_created``
    deadline: datetime | None = None
    #: the W3C traceparent of the span that started the run (telemetry on); recorded in its ``run_created``
    traceparent: str | None = None
    #: the parent link of a child run (:class:`celery_workflow._backend.children.ParentLink`'s data); recorded in
    #: its ``run_created``
    parent: Mapping[str, Any] | None = None

    def event_data(self) -> dict[str, Any]:
        """The data of the run's ``run_created``."""
        return RunCreatedData(
            self.workflow_name,
            self.input,
            self.queue,
            self.continues,
            self.deadline,
            traceparent=self.traceparent,
            parent=self.parent,
        ).to_data()


@dataclass(frozen=True, slots=True)
class AppendResult:
    events: list[Event]
    run: RunView


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    items: list[T]
    cursor: str | None = None  # pass back to get the next page; None when there is none


@dataclass(frozen=True, slots=True)
class StreamChunk:
    index: int
    data: bytes  # codec-tagged (codec.dumps_chunk)


@dataclass(frozen=True, slots=True)
class StreamPage:
    chunks: list[StreamChunk]
    closed: bool
    next_index: int  # the index after the last chunk returned (or ``start`` when none)


@dataclass(frozen=True, slots=True)
class BrokerSpec:
    """How Celery reaches this World's queue: a Kombu transport class path, a URL, transport options, Celery
    settings the broker needs (e.g. remote control off where the broker cannot carry it), and ``defaults``: Celery
    settings applied where the app has none of its own (e.g. the Postgres World's ``worker_concurrency``)."""

    transport: str
    url: str
    options: Mapping[str, Any] = field(default_factory=dict)
    settings: Mapping[str, Any] = field(default_factory=dict)
    defaults: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a World's queue and listings promise beyond the protocol's minimum.

    Every field defaults to True, which is what the SQLite, Postgres and in-memory Worlds give. A World on a broker
    without one of them (standard SQS: unordered, whole seconds, no deduplication; DynamoDB's indexes: eventually
    consistent) sets it to False; the conformance suite then skips exactly the cases that need it, saying why.
    """

    ordered_claims: bool = field(
        default=True,
        metadata={"doc": "claims take the oldest due deliveries first; a released delivery keeps its place"},
    )
    subsecond_times: bool = field(
        default=True, metadata={"doc": "due times, leases and retry delays are honoured to well under a second"}
    )
    dedup_pending: bool = field(
        default=True,
        metadata={"doc": "an idempotency key deduplicates against a pending delivery (of the same run, or queue)"},
    )
    consistent_listings: bool = field(
        default=True, metadata={"doc": "list_runs shows a run as soon as create_run returned"}
    )

    def lacking(self) -> list[str]:
        """The names of the capabilities this World does not have."""
        return [f.name for f in fields(self) if not getattr(self, f.name)]

    @staticmethod
    def describe(name: str) -> str:
        """What the capability ``name`` promises (KeyError for an unknown name)."""
        return str({f.name: f.metadata["doc"] for f in fields(Capabilities)}[name])


@dataclass(frozen=True, slots=True)
class AppendLimits:
    """How much one :meth:`World.append` may carry, in the World's own measure; the runtime splits what one delivery
    writes into appends that fit (:mod:`celery_workflow.runtime.batches`).

    *Actions*: an append costs ``reserved_actions`` (the World's own writes: the run's record, the ack, a run end's
    bookkeeping), plus each event's actions (``event_actions`` by event type value, else ``default_event_actions``)
    and each delivery's ``delivery_actions``; at most ``max_actions``.

    *Bytes*: ``reserved_bytes``, plus per event its data's JSON size times the copies the World writes of it
    (``event_copies`` by type, else ``default_event_copies``: the event and, say, the step view holding the same
    input) plus what its write holds besides (``event_overhead`` by type, else ``default_event_overhead``: the items'
    other attributes; an update of a view counted as the whole item, where the store counts it so), plus per delivery
    its payload and ``delivery_overhead``; at most ``max_bytes``.

    ``None`` means no limit: a World that declares nothing (:data:`NO_APPEND_LIMITS`) takes any batch in one append
    (SQLite; Postgres, which splits its statements inside its one transaction). Each figure must be an upper bound of
    what the World's append really counts, so that a batch the runtime packs within them is never refused for its
    size (the conformance suite checks it).

    ``batch_steps``: each append is paid for on its own (a DynamoDB transaction), so the World wants fewer, fuller
    ones: the quick inline steps of one delivery start unwritten and are written together with the delivery's next
    write, within these limits and a short window (:mod:`celery_workflow.runtime.holding`); a crash before that write
    runs them again. False (the default): a step's start is written before its body runs, as on the SQL Worlds.
    """

    max_actions: int | None = None
    max_bytes: int | None = None
    reserved_actions: int = 0
    reserved_bytes: int = 0
    event_actions: Mapping[str, int] = field(default_factory=dict)
    default_event_actions: int = 1
    delivery_actions: int = 1
    event_copies: Mapping[str, int] = field(default_factory=dict)
    default_event_copies: int = 1
    event_overhead: Mapping[str, int] = field(default_factory=dict)
    default_event_overhead: int = 0
    delivery_overhead: int = 0
    batch_steps: bool = False

    def __post_init__(self) -> None:
        costs: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "batch_steps":
                if not isinstance(value, bool):
                    raise ConfigurationError(f"AppendLimits.batch_steps must be a bool, not {value!r}")
                continue
            if isinstance(value, Mapping):
                costs.update({f"{f.name}[{k}]": v for k, v in value.items()})
            else:
                costs[f.name] = value
        for name, value in costs.items():
            if value is None and name.startswith("max_"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigurationError(f"AppendLimits.{name} must be an int >= 0, not {value!r}")
        for name in ("max_actions", "max_bytes"):
            limit, reserved = getattr(self, name), getattr(self, name.replace("max_", "reserved_"))
            if limit is not None and limit <= reserved:
                raise ConfigurationError(
                    f"AppendLimits.{name} ({limit}) leaves no room beside what every append reserves"
                )

    @property
    def unlimited(self) -> bool:
        """Whether any batch fits in one append."""
        return self.max_actions is None and self.max_bytes is None

    def event_cost(self, event: NewEvent) -> tuple[int, int]:
        """The actions and bytes ``event`` adds to an append (bytes 0 when the World counts none)."""
        kind = event.event_type.value
        actions = self.event_actions.get(kind, self.default_event_actions)
        if self.max_bytes is None:
            return actions, 0
        copies = self.event_copies.get(kind, self.default_event_copies)
        overhead = self.event_overhead.get(kind, self.default_event_overhead)
        return actions, copies * codec.encoded_size(event.data) + overhead

    def delivery_cost(self, delivery: Delivery) -> tuple[int, int]:
        """The actions and bytes ``delivery`` adds to an append."""
        return self.delivery_actions, len(delivery.payload) + self.delivery_overhead

    def cost(self, events: Sequence[NewEvent], deliveries: Sequence[Delivery]) -> tuple[int, int]:
        """The actions and bytes of one append of ``events`` and ``deliveries`` (what it reserves included)."""
        actions, size = self.reserved_actions, self.reserved_bytes
        for cost in [*map(self.event_cost, events), *map(self.delivery_cost, deliveries)]:
            actions += cost[0]
            size += cost[1]
        return actions, size

    def fits(self, actions: int, size: int) -> bool:
        """Whether an append costing ``actions`` and ``size`` bytes is within the limits."""
        return (self.max_actions is None or actions <= self.max_actions) and (
            self.max_bytes is None or size <= self.max_bytes
        )


#: The limits of a World that declares none: any batch is one append.
NO_APPEND_LIMITS = AppendLimits()


def append_limits(world: object) -> AppendLimits:
    """The :attr:`World.append_limits` of ``world`` (:data:`NO_APPEND_LIMITS` for a World that declares none)."""
    declared = getattr(world, "append_limits", None)
    return declared if isinstance(declared, AppendLimits) else NO_APPEND_LIMITS


@runtime_checkable
class WakeHolds(Protocol):
    """An optional part of a World whose queue does not deduplicate a run's wake-ups (standard SQS; the AWS World).

    While one delivery writes a batch split into several appends (a wide fan-out), the steps of its first appends
    already run and their results wake the run: a second delivery would replay beside the writer, meet creations not
    yet written, and the two would restart each other from the whole log until the writer is done. A held run's
    appends queue no wake-up: the holding delivery reads the log again before it is done (its last append is
    conditioned on the event count, and a result caught up with between two appends makes its replay restart).
    """

    def hold_wakes(self, run_id: str, receipt: str) -> bool:
        """Hold ``run_id``'s wake-ups for the claimed delivery ``receipt`` until the append that acks it, a
        :meth:`release_wakes`, or the next claim of that delivery (a redelivery after its writer died), whichever
        comes first. False (nothing held) when another wake-up of the run is queued and not yet taken, or the
        receipt is not this World's or no longer the delivery's current claim."""
        ...

    def release_wakes(self, run_id: str, receipt: str) -> None:
        """End a hold of :meth:`hold_wakes` before the holding delivery reads the log again (a write that failed
        between two appends); nothing when the hold is over already."""
        ...


def wake_holds(world: object) -> WakeHolds | None:
    """``world`` when it holds wake-ups (:class:`WakeHolds`), else None."""
    return world if isinstance(world, WakeHolds) else None


class Upkeep(Protocol):
    """Background work a World runs while a worker lives (e.g. retention sweeps); stopped at worker shutdown."""

    def stop(self, timeout: float = ...) -> None: ...


@runtime_checkable
class World(WorldQueue, Protocol):
    """Storage, queue and streams of workflow runs. All methods are thread-safe and fork-safe.

    Optional attributes (read with a default, so a World without them still is one): ``base_url`` (webhook URLs,
    unless ``Workflows`` has its own) and ``append_limits``, an :class:`AppendLimits` saying how much one append may
    carry: the runtime splits what one delivery writes into appends within them (a fan-out of 10,000 steps on
    DynamoDB's 100 actions per transaction). Without it, or with :data:`NO_APPEND_LIMITS`, any batch is one append
    (read it with :func:`append_limits`).
    """

    #: Longest time a waiter sleeps between checks when nothing wakes it.
    poll_interval: float
    #: What this World promises beyond the protocol's minimum.
    capabilities: Capabilities
    #: Workflow name -> queue, as the World's own configuration routes them (``Workflows`` applies them).
    routes: Mapping[str, str]
    #: The queue names this World can deliver to, or None when any name goes (a queue table takes any).
    queue_names: frozenset[str] | None
    #: The largest value it stores, in bytes of its JSON encoding: a run's input or output, a step's input or result,
    #: a hook's payload. The runtime checks values against it where they are produced, so an oversized one fails
    #: with :class:`~celery_workflow.errors.PayloadTooLarge` before any append is refused (e.g.
    #: :data:`DEFAULT_MAX_PAYLOAD`); the HTTP edges size their body limit from it.
    max_payload: int

    # -- storage -------------------------------------------------------------------------------------------------

    def create_run(self, run: NewRun, deliveries: Sequence[Delivery] = ()) -> tuple[RunView, bool]:
        """Write ``run_created`` at slot 1 and the deliveries, atomically.

        Idempotent by run id: when the run exists, nothing is written and ``(existing, False)`` is returned
        (:class:`~celery_workflow.errors.EntityExists` when it belongs to another workflow).
        """
        ...

    def append(
        self,
        run_id: str,
        events: Sequence[NewEvent],
        *,
        expected_count: int | None = None,
        deliveries: Sequence[Delivery] = (),
        ack: str | None = None,
        durable: bool = True,
    ) -> AppendResult:
        """Append a batch at the next slots, apply it to the views and store the deliveries, all or nothing.

        ``ack``: the receipt of a claimed delivery to delete in the same transaction (a stale receipt deletes
        nothing). ``durable=False`` lets the World commit without waiting for the write to reach disk (Postgres:
        ``synchronous_commit = off``): the write is visible at once and becomes durable with the next durable commit
        of the database. The runtime uses it for the intermediate writes of a delivery, whose last write is durable
        and acks the delivery, so a database crash in between only re-runs that delivery.
        """
        ...

    def get_run(self, run_id: str) -> RunView: ...

    def get_run_with_events(self, run_id: str) -> tuple[RunView, list[Event]]:
        """The run and all its events, read at one point in time (what a replay needs). RunNotFound if unknown."""
        ...

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
        """Runs, newest first: by creation time, descending (ties by run id, descending). ``cursor``: the page's
        cursor of the previous page (InvalidCursor for anything else). ``run_id_prefix``: runs whose id starts with
        it; ``created_from`` (inclusive) and ``created_until`` (exclusive): aware datetimes bounding the creation time
        (ValueError for an empty prefix or a naive time)."""
        ...

    def list_events(self, run_id: str, *, after_slot: int = 0, limit: int | None = None) -> list[Event]:
        """Events with slot > ``after_slot``, ascending. Raises RunNotFound for an unknown run."""
        ...

    def get_step(self, run_id: str, step_id: str) -> StepView: ...

    def list_steps(self, run_id: str) -> list[StepView]: ...

    def get_hook_by_token(self, token: str) -> HookView:
        """The live hook owning ``token``; HookNotFound otherwise."""
        ...

    def list_hooks(self, run_id: str) -> list[HookView]: ...

    def list_waits(self, run_id: str) -> list[WaitView]: ...

    def wait_for_terminal(self, run_id: str, timeout: float | None) -> RunView:
        """Block until the run is terminal or ``timeout`` seconds pass; return the run as it is then."""
        ...

    # -- queue: enqueue, claim, ack, release, retry_later, extend (WorldQueue's, inherited) ------------------------

    # -- streams -------------------------------------------------------------------------------------------------

    def write_stream(self, run_id: str, name: str, chunks: Sequence[bytes]) -> int:
        """Append chunks at the stream's next indexes; return the index after the last. RunNotFound if no run."""
        ...

    def close_stream(self, run_id: str, name: str) -> None:
        """Mark the stream closed (idempotent); writes after that raise EventConflict."""
        ...

    def read_stream(
        self, run_id: str, name: str, *, start: int = 0, limit: int | None = None, wait: float = 0.0
    ) -> StreamPage:
        """Chunks from index ``start``; when none are there yet and the stream is open, wait up to ``wait`` s."""
        ...

    def list_streams(self, run_id: str) -> list[str]: ...

    # -- wiring --------------------------------------------------------------------------------------------------

    def broker(self) -> BrokerSpec:
        """The Kombu transport Celery uses to consume this World's queue."""
        ...

    def start_upkeep(self) -> Upkeep | None:
        """Start this World's background upkeep in the calling process (e.g. retention sweeps), or return None when
        it needs none. A worker's main process calls it once it is ready and stops it at shutdown."""
        ...

    def close(self) -> None: ...


#: The entry-point group World URL schemes are registered in (see the module docstring).
ENTRY_POINT_GROUP = "celery_workflow.worlds"


def world_schemes() -> dict[str, Callable[..., World]]:
    """Every registered World URL scheme and its factory (loaded lazily: a backend's driver is imported only when
    one of its URLs is opened)."""
    found: dict[str, Callable[..., World]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name.lower(), _lazy(ep.load))
    return found


def _lazy(load: Callable[[], Any]) -> Callable[..., World]:
    def factory(url: str, **options: Any) -> World:
        world: World = load()(url, **options)
        return world

    return factory


def open_world(url: str, **options: Any) -> World:
    """A World from a URL whose scheme a World registered (``sqlite:///relative.db``, ``sqlite:////abs/path.db``,
    ``postgresql://…``, or a third party's); ConfigurationError for an empty URL and for an unknown scheme, naming the
    known ones."""
    if not isinstance(url, str) or not url.strip():
        raise ConfigurationError(f"a World URL is needed (sqlite:///path.db, postgresql://…, aws://), got {url!r}")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    schemes = world_schemes()
    factory = schemes.get(scheme)
    if factory is None:
        known = ", ".join(f"{name}://" for name in sorted(schemes)) or "none (is celery-workflow installed?)"
        raise ConfigurationError(f"unknown World URL scheme {scheme!r}; registered schemes: {known}")
    return factory(url, **options)
