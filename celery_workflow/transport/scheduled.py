"""``celery inspect scheduled`` on our transports: the countdown and ETA tasks the store holds (issue #33, item 3).

On Redis or RabbitMQ a worker receives a task sent with ``countdown``/``eta`` at once and holds it in its ETA timer
until it is due; Celery's ``scheduled`` remote-control command lists that timer. Our store-backed transports keep
such a message in the store, with its due time, until it is due (no worker holds it, nothing is leased for the wait),
so Celery's command alone answers an empty list and so does Flower's "Scheduled tasks" table.

:func:`connect` (called when the transports are imported) connects a ``worker_init`` receiver that, in a worker
whose broker is one of our store-backed transports, replaces Celery's ``scheduled`` command (and its alias
``dump_schedule``: :meth:`celery.worker.control.Panel.register` keeps one command per name, so registering the name
again replaces it) by :func:`scheduled`: Celery's own answer (whatever the worker's ETA timer holds) followed by the
store's delayed messages of the queues this worker consumes (``delayed(queues, limit=)`` of the SQL queue stores),
soonest first, at most :data:`LIMIT`, in Celery's reply shape: ``{"eta", "priority", "request": {"id", "name",
"args", "kwargs", "type", "hostname", "time_start", "acknowledged", "delivery_info", "worker_pid"}}`` plus
``"held_by": "store"`` and ``"run_id"`` (a workflow delivery's run). ``args``/``kwargs`` are the message's
``argsrepr``/``kwargsrepr`` (the body is not deserialized in the worker's consumer thread).

Every worker consuming a queue answers with that queue's delayed messages: nobody holds them yet, so with two workers
on one queue each lists them (Celery would list each message under the one worker that received it). A worker on
another transport keeps Celery's command unchanged.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

from celery import signals

from celery_workflow.errors import WorldError

__all__ = [
    "LIMIT",
    "NO_DELAYED",
    "connect",
    "delayed_requests",
    "delayed_store",
    "install",
    "listed_queues",
    "scheduled",
]

log = logging.getLogger(__name__)

#: The most delayed messages one ``scheduled`` reply lists per worker (a store may hold millions).
LIMIT = 1000


class _Delayed(Protocol):
    """A stored message as ``delayed`` lists it (:class:`celery_workflow._backend.broker.QueuedMessage`)."""

    @property
    def queue(self) -> str: ...
    @property
    def run_id(self) -> str | None: ...
    @property
    def attempts(self) -> int: ...
    @property
    def due(self) -> float: ...
    @property
    def payload(self) -> bytes: ...


def _mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _request(message: _Delayed, hostname: str | None) -> dict[str, Any]:
    try:
        payload = json.loads(message.payload)
    except ValueError:
        payload = {}
    if not isinstance(payload, dict):
        payload = {}
    headers = _mapping(payload.get("headers"))
    props = _mapping(payload.get("properties"))
    info = _mapping(props.get("delivery_info"))
    priority = props.get("priority")
    eta = datetime.fromtimestamp(message.due, UTC).isoformat()
    return {
        "eta": eta,
        "priority": priority if isinstance(priority, int) else 0,
        "held_by": "store",
        "run_id": message.run_id,
        "request": {
            "id": headers.get("id"),
            "name": headers.get("task"),
            "args": headers.get("argsrepr"),
            "kwargs": headers.get("kwargsrepr"),
            "type": headers.get("task"),
            "hostname": hostname,
            "time_start": None,
            "acknowledged": False,
            "delivery_info": {
                "exchange": info.get("exchange", ""),
                "routing_key": info.get("routing_key", message.queue),
                "priority": priority,
                "redelivered": message.attempts > 0,
            },
            "worker_pid": None,
        },
    }


#: What the CLI and the inspector say for a World whose queue cannot list its delayed messages.
NO_DELAYED = "this World's queue cannot list its delayed messages (the SQLite and Postgres Worlds can)"


def delayed_store(world: Any) -> Any | None:
    """``world``'s queue store when it can list its delayed messages (``delayed``), else None."""
    store = getattr(world, "store", None)
    return store if callable(getattr(store, "delayed", None)) else None


def delayed_requests(
    store: Any, queues: Sequence[str], hostname: str | None, limit: int = LIMIT
) -> list[dict[str, Any]]:
    """The delayed messages ``store`` holds for ``queues``, in the shape of Celery's ``scheduled`` reply; empty when
    the store cannot list them (no ``delayed``)."""
    delayed: Callable[..., Iterable[_Delayed]] | None = getattr(store, "delayed", None)
    if delayed is None or not queues:
        return []
    return [_request(m, hostname) for m in delayed(list(queues), limit=limit)]


def listed_queues(store: Any, also: Iterable[str] = ()) -> list[str]:
    """The queues to list when none are named: every queue ``store`` knows (declared by a consumer or a publisher),
    then ``also`` (e.g. an app's workflow queues, whose deliveries may wait on a queue nobody declared yet)."""
    queues = getattr(store, "queues", None)
    names = list(queues()) if callable(queues) else []
    return list(dict.fromkeys([*names, *also]))


def _store_of(state: Any) -> Any:
    """The store of the worker's broker connection when it is one of our transports, else None."""
    from celery_workflow.transport.base import StoreTransport

    connection = getattr(state.consumer, "connection", None)
    transport = getattr(connection, "transport", None) if connection is not None else None
    return transport.store if isinstance(transport, StoreTransport) else None


def _consumed(state: Any) -> list[str]:
    task_consumer = getattr(state.consumer, "task_consumer", None)
    return [q.name for q in task_consumer.queues] if task_consumer is not None else []


def scheduled(state: Any, original: Callable[..., Any], **kwargs: Any) -> list[dict[str, Any]]:
    """Celery's ``scheduled`` answer (``original``), then the store's delayed messages of the consumed queues."""
    found: list[dict[str, Any]] = list(original(state, **kwargs))
    store = _store_of(state)
    if store is None:
        return found
    try:
        extra = delayed_requests(store, _consumed(state), getattr(state, "hostname", None))
    except WorldError as exc:
        log.warning("inspect scheduled: cannot list the store's delayed messages: %s", exc)
        return found
    seen = {entry.get("request", {}).get("id") for entry in found}
    return found + [entry for entry in extra if entry["request"]["id"] not in seen]


def install() -> None:
    """Replace Celery's ``scheduled`` remote-control command in this process by :func:`scheduled` (once)."""
    from celery.worker import control

    current = control.Panel.data.get("scheduled")
    if current is None or getattr(current, "_celery_workflow", False):
        return
    meta: Mapping[str, Any] = control.Panel.meta
    info = meta["scheduled"]

    def command(state: Any, **kwargs: Any) -> list[dict[str, Any]]:
        return scheduled(state, current, **kwargs)

    command._celery_workflow = True  # type: ignore[attr-defined]
    command.__doc__ = current.__doc__
    control.Panel.register(
        command,
        name="scheduled",
        alias=info.alias,
        type=info.type,
        visible=info.visible,
        default_timeout=info.default_timeout,
        help=info.help,
        signature=info.signature,
        args=info.args,
        variadic=info.variadic,
    )


def _on_worker_init(sender: Any = None, **_: Any) -> None:
    """``worker_init`` receiver: :func:`install` in a worker whose broker is one of our store-backed transports."""
    from celery_workflow.transport.base import StoreTransport

    conninfo = getattr(sender, "_conninfo", None)
    if conninfo is None:
        return
    try:
        transport_cls = conninfo.get_transport_cls()
    except Exception:  # an unknown transport: Celery reports it itself
        return
    if isinstance(transport_cls, type) and issubclass(transport_cls, StoreTransport):
        install()


def connect() -> None:
    """Connect the ``worker_init`` receiver that installs :func:`scheduled` (once; the transports call it)."""
    signals.worker_init.connect(_on_worker_init, weak=False, dispatch_uid="celery_workflow.inspect_scheduled")
