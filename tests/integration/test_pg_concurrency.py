"""``PostgresConfig.concurrency`` is the deliveries one worker runs at once (issue #27, item 10): the app's
``worker_concurrency`` unless it sets its own, and pools sized per process (``size_pool``). A real worker's banner
and its children's pools are checked in ``tests/acceptance/test_worker_queues.py``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery
from psycopg_pool import ConnectionPool

from celery_workflow import Workflows
from celery_workflow.worker_setup import PoolSized
from celery_workflow.world_pg import PostgresWorld
from tests.integration.pg_fixtures import pg_schema_fixture, pg_url_fixture  # noqa: F401


@pytest.fixture(name="world")
def world_fixture(pg_url: str) -> Iterator[PostgresWorld]:
    world = PostgresWorld.open(pg_url, concurrency=3)
    yield world
    world.close()


def test_concurrency_becomes_the_workers(world: PostgresWorld) -> None:
    wf = Workflows(Celery("concurrency"), world)
    assert wf.celery_app.conf.worker_concurrency == 3


def test_the_apps_own_worker_concurrency_wins(world: PostgresWorld) -> None:
    app = Celery("own")
    app.conf.worker_concurrency = 7
    Workflows(app, world)
    assert app.conf.worker_concurrency == 7


def test_a_process_pool_is_sized_for_its_deliveries(world: PostgresWorld) -> None:
    assert isinstance(world, PoolSized)
    assert world.db.pool.max_size == 3 + 5  # not a worker: room for API calls beside the deliveries
    world.size_pool(1)  # a prefork child
    assert (world.db.max_size, world.db.pool.max_size) == (2, 2)
    world.size_pool(8)  # a threads pool of 8
    assert (world.db.max_size, world.db.pool.max_size) == (9, 9)
    assert world.list_runs().items == []  # still usable


def test_a_callers_pool_is_not_resized(pg_url: str) -> None:
    with ConnectionPool(pg_url, min_size=1, max_size=4) as pool:
        world = PostgresWorld(pool)
        world.size_pool(1)
        assert pool.max_size == 4
        world.close()
