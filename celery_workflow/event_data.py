"""The event types and, for each, the typed shape of its data: one frozen dataclass per type (:data:`DATA_TYPES`).

An event's ``data`` is a JSON object; its dataclass declares which fields it has, which of them are required, and
their types. The dataclasses are a typed view of the stored dicts, not another stored form: a World stores ``data``
as it always has, :func:`data_of` reads a dict into its dataclass and :meth:`EventData.to_data` writes the dict a
writer of this version writes (an optional field is written when it differs from its default, a few always).

The view is checked at the log's edges (:mod:`celery_workflow.events`): when an event is validated for an append
(:class:`~celery_workflow.errors.EventInvalid`) and when a World reads a stored event back
(:class:`~celery_workflow.errors.EventUnreadable`). A missing required field, or a known field of another type, is
refused both ways. An unknown field is refused when writing (this version wrote it, so it is a mistake: a misspelt
optional field would otherwise be stored and never read) and ignored when reading (it stays in ``data``): optional
fields have been added release after release (``mode``, ``continues``, ``many``, ``keep_credentials``, ``force``,
``taken_by``, ``token_retention_until``, ``deadline``), and a worker of the previous release reading a run a newer one wrote to
during a rolling upgrade must keep working. What an older reader cannot safely ignore comes as a new event type,
which it refuses (:class:`~celery_workflow.errors.UnknownEventType`).

Times (``resume_at``, ``retry_after``, ``token_retention_until``, ``deadline``) are ISO 8601 strings with their offset in ``data``
and aware datetimes in the dataclasses.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, ClassVar, Literal, Self, TypeVar

from celery_workflow.errors import UnknownEventType
from celery_workflow.ids import isoformat, parse_iso


class EventType(StrEnum):
    RUN_CREATED = "run_created"
    RUN_STARTED = "run_started"
    RUN_COMPLETED = "run_completed"
    RUN_FAILED = "run_failed"
    RUN_CANCELLED = "run_cancelled"
    STEP_CREATED = "step_created"
    STEP_STARTED = "step_started"
    STEP_COMPLETED = "step_completed"
    STEP_FAILED = "step_failed"
    STEP_RETRYING = "step_retrying"
    HOOK_CREATED = "hook_created"
    HOOK_RECEIVED = "hook_received"
    HOOK_DISPOSED = "hook_disposed"
    HOOK_CONFLICT = "hook_conflict"
    WAIT_CREATED = "wait_created"
    WAIT_COMPLETED = "wait_completed"
    PATCH_APPLIED = "patch_applied"
    CHILD_STARTED = "child_started"
    CHILD_ENDED = "child_ended"

    @classmethod
    def _missing_(cls, value: object) -> EventType:
        # ``EventType("…")`` of a name this version does not know: a typed error (still a ValueError), so a stored
        # event of a newer celery_workflow's type is a clear error wherever a World decodes it
        raise UnknownEventType(
            f"unknown event type {value!r}: not one of this version's event types (written by a newer celery_workflow?)"
        )


@dataclass(frozen=True, slots=True)
class _Field:
    name: str
    required: bool
    always: bool  # written even when it holds its default
    default: Any
    read: Callable[[Any], Any] | None  # checks (and converts) a stored value; None: any JSON value
    time: bool  # a datetime, stored as ISO 8601


class EventData:
    """The typed data of one event type (``TYPE``). Subclasses are frozen dataclasses built by :func:`_event`."""

    __slots__ = ()
    TYPE: ClassVar[EventType]
    FIELDS: ClassVar[tuple[_Field, ...]]
    NAMES: ClassVar[frozenset[str]]

    @classmethod
    def from_data(cls, data: Mapping[str, Any], *, writing: bool = True) -> Self:
        """The typed view of ``data``; ValueError (naming the field) when it does not fit. ``writing``: refuse
        fields this version does not know (else they are ignored: see the module's docstring)."""
        if type(data) is not dict and not isinstance(data, Mapping):
            raise ValueError(f"data must be a JSON object, not {type(data).__name__}")
        if writing and not cls.NAMES.issuperset(data):
            unknown = ", ".join(repr(k) for k in data if k not in cls.NAMES)
            known = ", ".join(f.name for f in cls.FIELDS) or "none"
            raise ValueError(f"unknown data field {unknown} (the fields of {cls.TYPE}: {known})")
        values: dict[str, Any] = {}
        for f in cls.FIELDS:
            if f.name in data:
                value = data[f.name]
                if f.read is not None:
                    try:
                        value = f.read(value)
                    except ValueError as exc:
                        raise ValueError(f"data field {f.name!r} must be {exc}") from None
                values[f.name] = value
            elif f.required:
                raise ValueError(f"needs data field {f.name!r}")
        return cls(**values)

    def to_data(self) -> dict[str, Any]:
        """The JSON object this version writes for this data."""
        out: dict[str, Any] = {}
        for f in self.FIELDS:
            value = getattr(self, f.name)
            if f.required or f.always or value != f.default:
                out[f.name] = isoformat(value) if f.time and value is not None else value
        return out


#: The data class of each event type.
DATA_TYPES: dict[EventType, type[EventData]] = {}

E = TypeVar("E", bound=EventData)


def data_of(event_type: EventType, data: Mapping[str, Any], *, writing: bool) -> EventData:
    """The typed view of an event's ``data`` (:meth:`EventData.from_data`)."""
    return DATA_TYPES[event_type].from_data(data, writing=writing)


def _event(event_type: EventType, *, always: tuple[str, ...] = ()) -> Callable[[type[E]], type[E]]:
    """Register a dataclass as the data of ``event_type`` and derive its field checks from its annotations."""

    def register(cls: type[E]) -> type[E]:
        hints = typing.get_type_hints(cls)
        fields = []
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            required = f.default is dataclasses.MISSING
            hint = hints[f.name]
            time = datetime in (hint, *typing.get_args(hint))
            fields.append(_Field(f.name, required, f.name in always, f.default, _reader(hint), time))
        cls.TYPE = event_type
        cls.FIELDS = tuple(fields)
        cls.NAMES = frozenset(f.name for f in fields)
        DATA_TYPES[event_type] = cls
        return cls

    return register


def _reader(hint: Any) -> Callable[[Any], Any] | None:
    if hint is Any:
        return None
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        read = _reader(inner)
        if read is None:
            return None
        return lambda v: None if v is None else read(v)
    if origin is Literal:
        allowed = typing.get_args(hint)

        def one_of(v: Any) -> Any:
            if v not in allowed or not isinstance(v, str):
                raise ValueError(f"one of {', '.join(map(repr, allowed))}, not {v!r}")
            return v

        return one_of
    if hint is datetime:
        return _time
    kind = origin or hint
    what = {str: "a string", bool: "a boolean", int: "an integer", Mapping: "a JSON object"}[kind]
    check: type = kind

    def typed(v: Any) -> Any:
        if not isinstance(v, check) or (kind is int and isinstance(v, bool)):
            raise ValueError(f"{what}, not {type(v).__name__}")
        return v

    return typed


def _time(v: Any) -> datetime:
    try:
        if not isinstance(v, str):
            raise ValueError(f"got {type(v).__name__}")
        return parse_iso(v)
    except ValueError as exc:
        raise ValueError(f"an ISO 8601 time with its offset: {exc}") from None


# -- the data of each event type -------------------------------------------------------------------------------------


@_event(EventType.RUN_CREATED)
@dataclass(frozen=True, slots=True)
class RunCreatedData(EventData):
    workflow_name: str
    input: Any  # {"args": [...], "kwargs": {...}}
    queue: str | None = None
    continues: str | None = None  # the run this one continues (continue_as_new)
    deadline: datetime | None = None  # when the run times out (``@wf.workflow(timeout=...)``), fixed at creation
    traceparent: str | None = None  # the W3C trace context of the start() that created it (celery_workflow.telemetry)
    #: the run that started this one as a child run, and how its end wakes that parent
    #: (``{"run_id", "correlation_id", "wake"}``: see :mod:`celery_workflow._backend.children`)
    parent: Mapping[str, Any] | None = None


@_event(EventType.RUN_STARTED)
@dataclass(frozen=True, slots=True)
class RunStartedData(EventData):
    pass


@_event(EventType.RUN_COMPLETED, always=("output",))
@dataclass(frozen=True, slots=True)
class RunCompletedData(EventData):
    output: Any = None
    continued_as: str | None = None  # the successor a continue_as_new handed over to
    continued_with: Any = None  # and its input


@_event(EventType.RUN_FAILED)
@dataclass(frozen=True, slots=True)
class RunFailedData(EventData):
    error: Mapping[str, Any]
    code: str | None = None  # e.g. REPLAY_DIVERGENCE


@_event(EventType.RUN_CANCELLED)
@dataclass(frozen=True, slots=True)
class RunCancelledData(EventData):
    reason: str | None = None


@_event(EventType.STEP_CREATED)
@dataclass(frozen=True, slots=True)
class StepCreatedData(EventData):
    step_name: str
    input: Any
    mode: Literal["inline", "queued"] | None = None  # absent in logs written before inline steps
    queue: str | None = None  # where a queued step routed to its own queue is delivered


@_event(EventType.STEP_STARTED)
@dataclass(frozen=True, slots=True)
class StepStartedData(EventData):
    owner: str | None = None  # the delivery that runs the attempt
    attempt: int = 0  # counted by the rules when appended (0: not yet)


@_event(EventType.STEP_COMPLETED)
@dataclass(frozen=True, slots=True)
class StepCompletedData(EventData):
    result: Any


@_event(EventType.STEP_FAILED)
@dataclass(frozen=True, slots=True)
class StepFailedData(EventData):
    error: Mapping[str, Any]


@_event(EventType.STEP_RETRYING)
@dataclass(frozen=True, slots=True)
class StepRetryingData(EventData):
    error: Mapping[str, Any]
    retry_after: datetime | None = None


@_event(EventType.HOOK_CREATED, always=("metadata", "is_webhook"))
@dataclass(frozen=True, slots=True)
class HookCreatedData(EventData):
    token: str
    metadata: Any = None
    is_webhook: bool = False
    respond_with: Any = None  # a webhook's fixed response
    many: bool | None = None  # a webhook takes many requests (None: recorded before the option, which is many)
    keep_credentials: bool | None = None  # a webhook keeps credential headers (None: recorded before the option)
    force: bool = False  # take the token over from a live owner
    token_retention_until: datetime | None = None  # the token stays reserved after the run ends, until then

    def __post_init__(self) -> None:
        if not self.token:
            raise ValueError("hook_created needs a non-empty string token")

    @property
    def webhook_options(self) -> tuple[bool, bool]:
        """``(many, keep_credentials)``. Webhooks recorded before these options existed have neither: they stay
        *many* (a run in flight may iterate its webhook, and refusing its second request would strand it) and, like
        every webhook, lose their credential headers from then on (dropping a header strands nothing)."""
        return self.many is not False, bool(self.keep_credentials)


@_event(EventType.HOOK_RECEIVED)
@dataclass(frozen=True, slots=True)
class HookReceivedData(EventData):
    payload: Any


@_event(EventType.HOOK_DISPOSED)
@dataclass(frozen=True, slots=True)
class HookDisposedData(EventData):
    taken_by: str | None = None  # the run whose forced claim took the token over
    token: str | None = None  # that token, as versions before issue #26 recorded it (no longer written)


@_event(EventType.HOOK_CONFLICT)
@dataclass(frozen=True, slots=True)
class HookConflictData(EventData):
    token: str
    conflicting_run_id: str


@_event(EventType.WAIT_CREATED)
@dataclass(frozen=True, slots=True)
class WaitCreatedData(EventData):
    resume_at: datetime


@_event(EventType.WAIT_COMPLETED)
@dataclass(frozen=True, slots=True)
class WaitCompletedData(EventData):
    pass


@_event(EventType.PATCH_APPLIED)
@dataclass(frozen=True, slots=True)
class PatchAppliedData(EventData):
    """The run took the new path of a change guarded by ``patched(change_id)`` (correlation id ``patch:<id>``)."""

    change_id: str

    def __post_init__(self) -> None:
        if not self.change_id:
            raise ValueError("patch_applied needs a non-empty change_id")


@_event(EventType.CHILD_STARTED)
@dataclass(frozen=True, slots=True)
class ChildStartedData(EventData):
    """The run started a child run (``other_workflow.start(...)`` inside a workflow; correlation id ``child:<n>``)."""

    run_id: str
    workflow_name: str
    parent_close: Literal["cancel", "abandon"] = "cancel"  # what the parent's end does to the child if it still runs

    def __post_init__(self) -> None:
        if not self.run_id:
            raise ValueError("child_started needs a non-empty run_id")


@_event(EventType.CHILD_ENDED)
@dataclass(frozen=True, slots=True)
class ChildEndedData(EventData):
    """A child run ended (written by the World in the same transaction as the child's end; correlation id the
    child's ``child:<n>``). ``status``: completed, failed or cancelled; ``output`` or ``error`` as the child's."""

    run_id: str
    status: Literal["completed", "failed", "cancelled"]
    output: Any = None
    error: Mapping[str, Any] | None = None


assert set(DATA_TYPES) == set(EventType), "every event type has its data class"
