"""Payload limits on SQLite (see payload_suite)."""

from __future__ import annotations

from pathlib import Path

from celery_workflow.world import DEFAULT_MAX_PAYLOAD
from celery_workflow.world_sqlite import SQLiteWorld
from tests.integration.payload_suite import check_payload_limits


def test_sqlite_payload_limits(tmp_path: Path) -> None:
    world = SQLiteWorld(tmp_path / "world.db")
    try:
        assert world.max_payload == DEFAULT_MAX_PAYLOAD
        check_payload_limits(world)
    finally:
        world.close()
