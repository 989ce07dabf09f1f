"""Input checks every World applies before it writes (deliveries, stream names and chunks, event copies).

These are shape checks, not transition rules (those live in :mod:`celery_workflow.events` only). Each raises before
anything is written, so a bad input changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from celery_workflow import codec, ids, rules
from celery_workflow.errors import EventInvalid
from celery_workflow.events import NewEvent
from celery_workflow.world import Delivery

#: The largest stored stream chunk: a payload of :data:`codec.MAX_PAYLOAD_BYTES` plus its two-byte format tag.
MAX_CHUNK_BYTES = codec.MAX_PAYLOAD_BYTES + 2
MAX_NAME_LENGTH = 512


def check_delivery(delivery: Delivery) -> None:
    """Reject a malformed delivery (ValueError/TypeError): an empty queue name, a non-bytes payload, a naive time."""
    if not isinstance(delivery.queue, str) or not delivery.queue:
        raise ValueError(f"a delivery needs a non-empty queue name, got {delivery.queue!r}")
    if not isinstance(delivery.payload, bytes):
        raise TypeError(f"a delivery payload must be bytes, got {type(delivery.payload).__name__}")
    if delivery.not_before is not None:
        ids.to_utc(delivery.not_before)  # ValueError for naive datetimes


def check_deliveries(deliveries: Sequence[Delivery]) -> None:
    for delivery in deliveries:
        check_delivery(delivery)


def check_stream_name(name: str) -> None:
    """EventInvalid unless ``name`` is a non-empty string of at most :data:`MAX_NAME_LENGTH` characters."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LENGTH:
        raise EventInvalid(f"a stream name must be a non-empty string of at most {MAX_NAME_LENGTH} characters")


def check_chunks(chunks: Sequence[bytes]) -> list[bytes]:
    """Stream chunks as bytes; EventInvalid for a non-bytes or oversized chunk."""
    out = []
    for chunk in chunks:
        if not isinstance(chunk, (bytes, bytearray, memoryview)):
            raise EventInvalid(f"a stream chunk must be bytes, got {type(chunk).__name__}")
        data = bytes(chunk)
        if len(data) > MAX_CHUNK_BYTES:
            raise EventInvalid(f"stream chunk of {len(data)} bytes exceeds the limit of {MAX_CHUNK_BYTES} bytes")
        out.append(data)
    return out


def normalise(new_events: Sequence[NewEvent]) -> list[NewEvent]:
    """Validate each event (:func:`rules.validate`, EventInvalid) and copy its data through JSON.

    The copy is what a database gives back (tuples become lists), so an append's result equals later reads and
    the World never shares objects with its caller.
    """
    out = []
    for ev in new_events:
        blob = rules.validate(ev)
        out.append(NewEvent(ev.event_type, ev.correlation_id, codec.loads(blob)))
    return out
