"""The ``list_group`` index projects keys only: a run's status changes write nothing to it, ``list_runs(workflow=…)``
takes the status from the runs' META, and a table of an earlier version (``list_group`` projecting ``status``) works
as it is and has its index rebuilt on request (issue #31)."""

from __future__ import annotations

from typing import Any

import boto3
import pytest

from celery_workflow._aws.table import outdated_indexes
from celery_workflow.aws_costs import INDEX_WRITE_UNITS, CostCounter, TableSpec
from celery_workflow.events import EventType, RunStatus
from celery_workflow.testing._conformance import create, ev
from celery_workflow.world_sqs import AWSWorld, create_table, rebuild_indexes, table_definition
from tests.integration.aws_fixtures import CREDENTIALS, TABLE, Aws, aws_fixture, moto_fixture  # noqa: F401


def _statuses(world: AWSWorld, **query: Any) -> list[tuple[str, RunStatus]]:
    """Every run the listing returns, page after page, with its status."""
    out: list[tuple[str, RunStatus]] = []
    cursor = None
    while True:
        page = world.list_runs(cursor=cursor, **query)
        out += [(r.run_id, r.status) for r in page.items]
        if page.cursor is None:
            return out
        assert len(page.items) == query.get("limit", 100)  # a page with a cursor is full
        cursor = page.cursor


def _runs(world: AWSWorld) -> dict[str, RunStatus]:
    """Nine runs of ``wf`` (every third completed, the others pending or running) and two of ``other``."""
    made = {}
    for i in range(9):
        run = create(world, run_id=f"wrun_g{i}", started=i % 3 != 2)
        if i % 3 == 0:
            run = world.append(run.run_id, [ev(EventType.RUN_COMPLETED, output=i)]).run
        made[run.run_id] = run.status
    for i in range(2):
        create(world, workflow="other", run_id=f"wrun_o{i}")
    return made


def test_a_listing_by_workflow_and_status_reads_the_status_from_meta(aws: Aws) -> None:
    world = aws.world()
    made = _runs(world)
    newest_first = sorted(made, reverse=True)
    assert [r for r, _ in _statuses(world, workflow="wf", limit=4)] == newest_first
    for status in (RunStatus.COMPLETED, RunStatus.RUNNING, RunStatus.PENDING):
        wanted = [(r, status) for r in newest_first if made[r] is status]
        for limit in (1, 2, 5):  # full pages, whatever the statuses between them in the index
            assert _statuses(world, workflow="wf", status=status, limit=limit) == wanted
    assert _statuses(world, workflow="wf", status=RunStatus.FAILED) == []
    assert [r for r, _ in _statuses(world, workflow="other", run_id_prefix="wrun_o1")] == ["wrun_o1"]
    assert len(_statuses(world, status=RunStatus.COMPLETED, limit=2)) == 3  # the list index, filtered by the query


def test_status_changes_write_nothing_to_the_list_group_index(aws: Aws) -> None:
    counter = CostCounter([TableSpec.from_definition(table_definition(TABLE))])
    dynamodb = counter.attach(boto3.client("dynamodb", endpoint_url=aws.endpoint, **CREDENTIALS))
    sqs = counter.attach(boto3.client("sqs", endpoint_url=aws.endpoint, **CREDENTIALS))
    world = AWSWorld(aws.config(), dynamodb, sqs)
    run = create(world, run_id="wrun_index", started=True)
    world.append(run.run_id, [ev(EventType.RUN_COMPLETED, output=1)])
    index = {kind: units for (unit, _, kind), units in counter.usage().counts.items() if unit == INDEX_WRITE_UNITS}
    by_index = {
        name: sum(u for kind, u in index.items() if kind.startswith(f"{name} index")) for name in ("list", "list_group")
    }
    assert by_index == {"list": 3, "list_group": 1}  # list: created, started, completed; list_group: created only


OLD = "workflow_v1"


def _old_table(aws: Aws) -> None:
    """A table as an earlier version made it: ``list_group`` projecting ``status`` too."""
    definition = table_definition(OLD)
    for index in definition["GlobalSecondaryIndexes"]:
        index["Projection"] = {"ProjectionType": "INCLUDE", "NonKeyAttributes": ["status"]}
    aws.dynamodb.create_table(**definition)


def _projections(aws: Aws, name: str) -> dict[str, Any]:
    table = aws.dynamodb.describe_table(TableName=name)["Table"]
    return {i["IndexName"]: i["Projection"]["ProjectionType"] for i in table["GlobalSecondaryIndexes"]}


def test_a_table_of_an_earlier_version_works_and_its_index_is_rebuilt(
    aws: Aws, caplog: pytest.LogCaptureFixture
) -> None:
    _old_table(aws)
    world = aws.world(table_name=OLD)
    made = _runs(world)
    pending = sorted((r for r in made if made[r] is RunStatus.PENDING), reverse=True)
    assert [r for r, _ in _statuses(world, workflow="wf", status=RunStatus.PENDING, limit=2)] == pending
    create_table(aws.dynamodb, OLD, poll=0.05)  # an existing table is kept; its outdated index is named
    assert "list_group" in caplog.text and "--rebuild-indexes" in caplog.text
    assert outdated_indexes(aws.dynamodb.describe_table(TableName=OLD)["Table"]) == ["list_group"]
    assert rebuild_indexes(aws.dynamodb, OLD, poll=0.05) == ["list_group"]
    assert _projections(aws, OLD) == {"list": "INCLUDE", "list_group": "KEYS_ONLY"}
    assert outdated_indexes(aws.dynamodb.describe_table(TableName=OLD)["Table"]) == []
    assert rebuild_indexes(aws.dynamodb, OLD, poll=0.05) == []  # nothing left to do
    assert [r for r, _ in _statuses(world, workflow="wf", status=RunStatus.PENDING, limit=2)] == pending
