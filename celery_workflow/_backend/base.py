"""What a World inherits instead of writing it again: ``append`` through the template, and the queue methods of a
World whose deliveries live in a queue store (SQLite, Postgres).

:class:`TemplateWorld` gives a World its :meth:`~celery_workflow.world.World.append`: check and normalise the
request, then run :func:`celery_workflow._backend.template.append` with the World's own steps (``_steps``, an
:class:`~celery_workflow._backend.template.AppendSteps`). :class:`StoreQueue` gives it ``enqueue`` / ``claim`` /
``ack`` / ``release`` / ``retry_later`` / ``extend`` on ``store`` (a :class:`~.queue_contract.QueueStore`, defined
with the rest of the queue contract and re-exported here), with the protocol's input checks;
:class:`StoreStreams` the stream methods on ``streams``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Protocol

from celery_workflow import dead_letters
from celery_workflow._backend import template
from celery_workflow._backend.checks import check_deliveries
from celery_workflow._backend.children import ParentLink, link_of
from celery_workflow._backend.listing import RunFilter
from celery_workflow._backend.queue_contract import QueueStore
from celery_workflow._backend.template import AppendRequest, AppendSteps
from celery_workflow.dead_letters import DEFAULT_MAX_DELIVERIES
from celery_workflow.errors import NotFound
from celery_workflow.events import Event, NewEvent, RunStatus, RunView
from celery_workflow.telemetry.hooks import Probe, appended
from celery_workflow.world import AppendResult, ClaimedDelivery, Delivery, Page, StreamPage

__all__ = ["QueueStore", "StoreQueue", "StoreStreams", "StreamStore", "TemplateWorld"]

log = logging.getLogger("celery_workflow")


class TemplateWorld:
    """A World whose ``append`` is the template's; the subclass sets ``_steps`` in its constructor."""

    _steps: AppendSteps[Any]
    #: what observes this World's appends (``Workflows(telemetry=...)`` sets it): nothing when None
    telemetry: Probe | None = None

    @appended
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
        """Append a batch at the next slots, apply it to the views and store the deliveries, all or nothing (see
        :meth:`celery_workflow.world.World.append`)."""
        request = AppendRequest.build(
            run_id, events, expected_count=expected_count, deliveries=deliveries, ack=ack, durable=durable
        )
        return template.append(self._steps, request, lambda: self._parent_link(run_id))

    def _parent_link(self, run_id: str) -> ParentLink | None:
        """The parent link of a run, read from its ``run_created`` (for steps whose ``load`` does not read it)."""
        try:
            first: list[Event] = self.list_events(run_id, limit=1)  # type: ignore[attr-defined]
        except NotFound:
            return None
        return link_of(first)

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
        """See :meth:`celery_workflow.world.World.list_runs`: the arguments checked once, the query the subclass's
        (:meth:`runs_listed`)."""
        wanted = RunFilter.of(
            workflow=workflow,
            status=status,
            limit=limit,
            cursor=cursor,
            run_id_prefix=run_id_prefix,
            created_from=created_from,
            created_until=created_until,
        )
        return self.runs_listed(wanted)

    def runs_listed(self, wanted: RunFilter) -> Page[RunView]:
        raise NotImplementedError


class StoreQueue:
    """The World's queue methods on its queue store ``store`` (shared with its Kombu transport)."""

    store: QueueStore

    def enqueue(self, deliveries: Sequence[Delivery]) -> list[bool]:
        check_deliveries(deliveries)
        return self.store.enqueue(deliveries)

    #: Deliveries a message gets from :meth:`claim` before it is dead-lettered and its run failed (the Celery
    #: transports apply their own ``max_deliveries`` option to what they receive).
    max_deliveries: int | None = DEFAULT_MAX_DELIVERIES

    def claim(self, queues: Sequence[str], *, limit: int = 1, lease: float = 60.0) -> list[ClaimedDelivery]:
        if lease <= 0:
            raise ValueError("lease must be positive")
        claims = self.store.claim(queues, limit=limit, lease=lease)
        if self.max_deliveries is None or all(c.attempts <= self.max_deliveries for c in claims):
            return claims
        kept = []
        for claim in claims:
            if claim.attempts <= self.max_deliveries:
                kept.append(claim)
                continue
            letter = self.store.dead_letter(claim.receipt, reason=dead_letters.MAX_DELIVERIES)
            if letter is not None:
                log.error("%s (dead letter %s)", letter.describe(), letter.id)
                dead_letters.settle(self, self.store, [letter])
        return kept

    def ack(self, receipt: str) -> None:
        self.store.ack(receipt)

    def release(self, receipt: str) -> None:
        self.store.release(receipt)

    def retry_later(self, receipt: str, delay: float, *, error: str | None = None) -> None:
        self.store.retry_later(receipt, delay, error=error)

    def extend(self, receipts: Sequence[str], lease: float) -> None:
        self.store.extend(receipts, lease)


class StreamStore(Protocol):
    """The streams of a World kept by an object of their own (the Postgres and AWS Worlds')."""

    def write(self, run_id: str, name: str, chunks: Sequence[bytes]) -> int: ...
    def close(self, run_id: str, name: str) -> None: ...
    def read(
        self, run_id: str, name: str, *, start: int = ..., limit: int | None = ..., wait: float = ...
    ) -> StreamPage: ...
    def names(self, run_id: str) -> list[str]: ...


class StoreStreams:
    """The World's stream methods on its stream store ``streams``."""

    streams: StreamStore

    def write_stream(self, run_id: str, name: str, chunks: Sequence[bytes]) -> int:
        return self.streams.write(run_id, name, chunks)

    def close_stream(self, run_id: str, name: str) -> None:
        self.streams.close(run_id, name)

    def read_stream(
        self, run_id: str, name: str, *, start: int = 0, limit: int | None = None, wait: float = 0.0
    ) -> StreamPage:
        return self.streams.read(run_id, name, start=start, limit=limit, wait=wait)

    def list_streams(self, run_id: str) -> list[str]:
        return self.streams.names(run_id)
