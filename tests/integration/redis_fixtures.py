"""Redis fixtures: a key prefix of the test's own on the server at ``REDIS_URL`` (default redis://127.0.0.1:6379/0).

Importing this module skips the importing test module when Redis cannot be reached, with the reason in the report.
``redis_prefix`` yields a fresh prefix and deletes every key under it afterwards.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import pytest
import redis

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


def _unreachable() -> str | None:
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3).ping()
    except redis.RedisError as exc:
        return f"Redis is not reachable at REDIS_URL={REDIS_URL!r}: {exc}"
    return None


UNREACHABLE = _unreachable()
if UNREACHABLE is not None:
    pytest.skip(UNREACHABLE, allow_module_level=True)


def delete_prefix(prefix: str) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture(name="redis_prefix")
def redis_prefix_fixture() -> Iterator[str]:
    prefix = f"cw_test_{secrets.token_hex(6)}:"
    yield prefix
    delete_prefix(prefix)
