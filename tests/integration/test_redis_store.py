"""RedisStore (the SQS transport's control channel) on a real Redis: the queue-store and transport suites our SQL
stores pass, unchanged, plus claims from several processes."""

from __future__ import annotations

import multiprocessing
import multiprocessing.synchronize
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kombu import Connection

from celery_workflow._redis.store import RedisStore
from celery_workflow.errors import WorldError, WorldUnavailable
from celery_workflow.transport.base import StoreChannel, StoreTransport
from celery_workflow.world import Delivery
from tests.integration.queue_suite import Clock, QueueStoreSuite, claim_in_processes
from tests.integration.redis_fixtures import REDIS_URL, redis_prefix_fixture  # noqa: F401
from tests.integration.transport_suite import TransportSuite


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def queue(redis_prefix: str, clock: Clock) -> Iterator[RedisStore]:
    store = RedisStore(REDIS_URL, prefix=redis_prefix)
    store.clock = clock
    yield store
    store.close()


class TestRedisQueueStore(QueueStoreSuite):
    """The shared queue-store suite on Redis."""

    lists_delayed = False  # no ``delayed`` yet: ``inspect scheduled`` adds nothing from a Redis store


def test_errors_are_world_errors(redis_prefix: str) -> None:
    with pytest.raises(WorldError):
        RedisStore(REDIS_URL, prefix=redis_prefix).ack("nonsense")
    down = RedisStore("redis://127.0.0.1:1/0", prefix=redis_prefix)
    with pytest.raises(WorldUnavailable):
        down.put("q", b"x")


def _claimer(prefix: str, start: multiprocessing.synchronize.Event, out: multiprocessing.Queue[list[int]]) -> None:
    store = RedisStore(REDIS_URL, prefix=prefix)
    got: list[int] = []
    start.wait(30)
    idle = 0
    while idle < 3:
        claims = store.claim(["work"], limit=1 + len(got) % 3, lease=60)
        if not claims:
            idle += 1
            continue
        idle = 0
        for c in claims:
            got.append(int(c.payload))
            store.ack(c.receipt)
    out.put(got)


def test_concurrent_claimers_in_several_processes_get_each_message_once(redis_prefix: str) -> None:
    store = RedisStore(REDIS_URL, prefix=redis_prefix)
    total = 300
    store.enqueue([Delivery("work", str(i).encode()) for i in range(total)])
    results = claim_in_processes(multiprocessing.get_context("fork"), _claimer, (redis_prefix,), 4, timeout=60)
    assert sorted(i for r in results for i in r) == list(range(total))
    assert sum(1 for r in results if r) >= 2
    assert store.peek() == []


# -- the Kombu transport suite over this store ----------------------------------------------------------------------

_PREFIX: dict[str, str] = {}


class RedisStoreTransport(StoreTransport):
    """StoreTransport over RedisStore: what the SQS transport's control channel runs on."""

    Channel = StoreChannel
    can_parse_url = True
    driver_type = "celery_workflow_redis_control"
    driver_name = "redis"

    def open_store(self) -> Any:
        return RedisStore(REDIS_URL, prefix=_PREFIX["current"])


class TestRedisStoreTransport(TransportSuite):
    """The shared Kombu-level suite on the control channel's store."""

    @pytest.fixture
    def url(self, redis_prefix: str) -> str:
        _PREFIX["current"] = redis_prefix
        return REDIS_URL

    @pytest.fixture
    def connect(self, url: str) -> Iterator[Callable[..., Connection]]:
        opened: list[Connection] = []

        def make(**options: Any) -> Connection:
            conn = Connection(url, transport=RedisStoreTransport, transport_options=options)
            conn.connect()
            opened.append(conn)
            return conn

        yield make
        for conn in opened:
            conn.release()

    @pytest.fixture
    def store(self, url: str, redis_prefix: str) -> Iterator[RedisStore]:
        store = RedisStore(url, prefix=redis_prefix)
        yield store
        store.close()
