"""Payload limits on Postgres (see payload_suite)."""

from __future__ import annotations

from typing import Any

from celery_workflow.world import DEFAULT_MAX_PAYLOAD
from tests.integration.payload_suite import check_payload_limits
from tests.integration.pg_fixtures import pg_schema_fixture, pg_url_fixture, pg_world_fixture  # noqa: F401


def test_postgres_payload_limits(pg_world: Any) -> None:
    assert pg_world.max_payload == DEFAULT_MAX_PAYLOAD
    check_payload_limits(pg_world)
