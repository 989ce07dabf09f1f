"""Identifiers: ULIDs with a type prefix (``wrun_…``, ``dlv_…``) and UTC clock helpers."""

from __future__ import annotations

import os
import re
import time
from datetime import UTC, datetime

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def ulid(timestamp_ms: int | None = None, randomness: bytes | None = None) -> str:
    """A 26-character ULID: 48 bits of milliseconds, then 80 random bits, Crockford base32."""
    ms = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
    rand = os.urandom(10) if randomness is None else randomness
    value = (ms << 80) | int.from_bytes(rand, "big")
    out = []
    for _ in range(26):
        out.append(_CROCKFORD[value & 31])
        value >>= 5
    return "".join(reversed(out))


#: A run id a caller may choose: 1-200 letters, digits and ``_ - . : @`` (ids the package derives add ``~`` for a
#: successor, ``!`` for a child run, so they never collide with a chosen one).
USER_RUN_ID = re.compile(r"^[A-Za-z0-9_\-.:@]{1,200}$")


def new_run_id() -> str:
    return f"wrun_{ulid()}"


def new_delivery_id() -> str:
    return f"dlv_{ulid()}"


def utcnow() -> datetime:
    return datetime.now(UTC)


def to_utc(value: datetime) -> datetime:
    """Aware UTC datetime, truncated to microseconds (what every World stores)."""
    if value.tzinfo is None:
        raise ValueError("naive datetime; celery_workflow uses aware UTC datetimes")
    return value.astimezone(UTC)


def to_micros(value: datetime) -> int:
    v = to_utc(value)
    return (int(v.timestamp()) * 1_000_000) + v.microsecond


def from_micros(value: int) -> datetime:
    seconds, micros = divmod(value, 1_000_000)
    return datetime.fromtimestamp(seconds, UTC).replace(microsecond=micros)


def isoformat(value: datetime) -> str:
    return to_utc(value).isoformat()


def parse_iso(value: str) -> datetime:
    return to_utc(datetime.fromisoformat(value))
