"""The Celery side of the relay (:mod:`celery_workflow.relay`): publishing a World delivery on the app's broker, and
what a worker of a ``Workflows(app, world, broker="app")`` runs besides its tasks.

* :class:`CeleryPublisher` turns a claimed delivery (the stored task message :func:`celery_workflow.app.build_message`
  wrote) into an ordinary Celery task message on its queue, through Celery's own ``send_task_message`` (routing,
  queue declaration, publish retries and ``before/after_task_publish`` signals as for ``apply_async``), with the
  claim's receipt and attempts added to its headers; the task id, name, arguments and the other headers are the
  stored message's. No ETA: only due deliveries are published.
* :class:`WorkerRelay` runs in a worker's main process while it lives: the relay of the queues the worker consumes
  (elected: one per World and queue set) and the keeper that extends the World leases of the relayed deliveries the
  worker holds (reserved or running), so they are not published again while handled.
* :func:`ack_relayed`: after a relayed task returned, its claim is acked in the World (the handler acks it with its
  last write when it writes; a delivery with nothing to write, e.g. of an ended run, is acked here).
"""

from __future__ import annotations

import base64
import json
import logging
import signal
import threading
from collections.abc import Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

from celery.app.amqp import task_message

from celery_workflow.errors import PayloadError
from celery_workflow.relay import Relay, extend_held, lease_for
from celery_workflow.world import ATTEMPTS_KEY, RECEIPT_KEY, Claim, ClaimedDelivery

if TYPE_CHECKING:
    from celery_workflow.app import Workflows

__all__ = ["CeleryPublisher", "WorkerRelay", "ack_relayed", "run_relay"]

log = logging.getLogger("celery_workflow.relay")

#: How a publish is retried by Kombu before the relay gives its claims back (the relay then waits for the broker).
PUBLISH_RETRY = {"max_retries": 2, "interval_start": 0.0, "interval_step": 0.5, "interval_max": 1.0}


class CeleryPublisher:
    """Publishes claimed World deliveries on ``celery_app``'s broker (see the module docstring)."""

    def __init__(self, celery_app: Any) -> None:
        self.app = celery_app

    def message(self, claimed: ClaimedDelivery) -> tuple[str, Any]:
        """The task name and Celery ``task_message`` of a claimed delivery; PayloadError when its payload is not a
        stored task message."""
        try:
            stored = json.loads(claimed.payload)
            headers = dict(stored["headers"])
            name = str(headers["task"])
            body = stored["body"]
            properties = stored.get("properties") or {}
            if properties.get("body_encoding") == "base64":
                body = base64.b64decode(body)
            args, kwargs, embed = json.loads(body)
        except (KeyError, TypeError, ValueError) as exc:
            raise PayloadError(f"delivery {claimed.receipt} is not a stored Celery task message: {exc}") from exc
        headers.update(Claim(claimed.receipt, claimed.attempts).headers())
        headers["eta"] = None  # due now: the World kept the delay
        extra = {"correlation_id": properties.get("correlation_id") or headers.get("id")}
        if properties.get("reply_to"):
            extra["reply_to"] = properties["reply_to"]
        return name, task_message(headers=headers, properties=extra, body=(args, kwargs, embed), sent_event=None)

    def publish(self, claimed: ClaimedDelivery) -> None:
        name, message = self.message(claimed)
        with self.app.producer_or_acquire() as producer:
            self.app.amqp.send_task_message(
                producer,
                name,
                message,
                queue=claimed.queue,
                serializer="json",
                retry=True,
                retry_policy=PUBLISH_RETRY,
            )

    def ready(self) -> bool:
        try:
            with self.app.connection_for_write() as conn:
                conn.ensure_connection(max_retries=1, timeout=5)
            return True
        except Exception:
            return False

    def close(self) -> None:
        pass


def held_receipts(requests: Sequence[Any]) -> list[tuple[str, int]]:
    """The (receipt, attempts) of the relayed deliveries among a worker's requests."""
    out = []
    for request in requests:
        headers = getattr(request, "request_dict", None) or {}
        receipt = headers.get(RECEIPT_KEY)
        if receipt:
            try:
                attempts = max(1, int(headers.get(ATTEMPTS_KEY, 1)))
            except (TypeError, ValueError):
                attempts = 1
            out.append((str(receipt), attempts))
    return out


class WorkerRelay:
    """The relay of ``queues`` and the lease keeper, on threads of the calling process (a worker's main process);
    :meth:`stop` ends both."""

    def __init__(self, wf: Workflows, queues: Sequence[str]) -> None:
        self.wf = wf
        self.relay = Relay(wf.world, queues, CeleryPublisher(wf.celery_app), lease=wf.relay_lease)
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self.relay.serve, args=(self._stop,), name="celery_workflow-relay", daemon=True),
            threading.Thread(target=self._keep, name="celery_workflow-relay-keeper", daemon=True),
        ]

    def start(self) -> WorkerRelay:
        for thread in self._threads:
            thread.start()
        log.info("celery_workflow: relaying deliveries of %s to the app's broker", ", ".join(self.relay.queues))
        return self

    def _keep(self) -> None:
        from celery.worker import state

        lease = self.wf.relay_lease
        while not self._stop.wait(min(lease / 3, 60.0)):
            try:
                held = held_receipts(list(state.reserved_requests))
                by_lease: dict[float, list[str]] = {}
                for receipt, attempts in held:
                    by_lease.setdefault(lease_for(lease, attempts), []).append(receipt)
                for seconds, receipts in by_lease.items():
                    extend_held(self.wf.world, receipts, seconds)
            except Exception as exc:
                log.warning("relay: cannot extend the leases of held deliveries (%s)", exc)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout)


def ack_relayed(wf: Workflows, request: Any) -> None:
    """Ack in the World the claim a relayed message carries (its task returned); a stale receipt changes nothing."""
    claim = Claim.from_attributes(request)
    if claim is None:
        return
    try:
        wf.world.ack(claim.receipt)
    except Exception as exc:  # its lease runs out and it is published again: a duplicate, absorbed
        log.warning("relay: cannot ack delivery %s (%s)", claim.receipt, exc)


def run_relay(wf: Workflows, queues: Sequence[str], *, once: bool = False) -> int:
    """Run the relay of ``queues`` in the calling thread until SIGINT or SIGTERM (``once``: one round); the number
    of deliveries published."""
    relay = Relay(wf.world, queues, CeleryPublisher(wf.celery_app), lease=wf.relay_lease)
    if once:
        return relay.round()
    stop = threading.Event()

    def stopping(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, stopping) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        relay.serve(stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return relay.published
