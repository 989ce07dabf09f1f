"""``terraform apply`` upgrades a World table made by an earlier version of the module (issue #31).

An earlier ``terraform/dynamodb.tf`` gave the ``list_group`` index the projection ``INCLUDE`` of ``status``; the
current one makes it ``KEYS_ONLY`` and says the apply rebuilds it. A root config in ``tmp_path`` holds the
repository's ``variables.tf``, a provider pointed at the moto server and ``dynamodb.tf``: first the current file with
the ``list_group`` block rewritten to the old projection (applied, then a few runs written through an AWS World), then
the repository's file as it is, applied again on the same state.

What the AWS provider does (5.x): it plans an in-place update of the table (``1 changed, 0 destroyed``, never a
replacement), and applies it as two ``UpdateTable`` calls: ``Delete`` of ``list_group``, a wait until the index is
gone, then ``Create`` with the new projection, and a wait until it is ``ACTIVE``. The table and its items are
untouched; on AWS the new index is backfilled from them while it is ``CREATING`` (listings by workflow fail
meanwhile, see ``rebuild_indexes``).

What moto does: it keeps no index data. A query of an index reads the table's items at query time and projects them
with the index's current projection, and a created index is ``ACTIVE`` at once. So the "backfill" here is immediate
by construction: the test proves that the provider's calls leave a table whose ``list_group`` index has the new
projection (its query returns keys only, where it returned ``status`` before) and that the World lists the runs
written before the upgrade, not how long AWS takes to backfill.

It takes 30 to 50 s, nearly all of it the AWS provider starting (about 3 s each, three or four times per
``terraform`` command); the calls to moto take well under a second.
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from celery_workflow._aws.table import outdated_indexes
from celery_workflow.events import EventType, RunStatus
from celery_workflow.testing._conformance import create, ev
from celery_workflow.world_sqs import AWSConfig, AWSWorld
from tests.integration.aws_fixtures import CREDENTIALS, moto_fixture  # noqa: F401
from tests.integration.terraform_fixtures import MODULE_DIR, Terraform, moto_provider, plugin_dir, terraform_binary

TERRAFORM = terraform_binary()
pytestmark = pytest.mark.skipif(TERRAFORM is None, reason="the terraform binary is not installed")

NAME = "cwtf-upgrade"

#: kms too: reading the table's encryption describes the AWS managed key, which must not leave loopback.
SERVICES = ("dynamodb", "kms", "sts")

TFVARS = f"""
name                = "{NAME}"
deletion_protection = false
tags                = {{ suite = "terraform-upgrade" }}
"""

#: The ``list_group`` block of ``dynamodb.tf`` (up to its closing brace) and its projection line.
LIST_GROUP_BLOCK = re.compile(r'global_secondary_index \{[^}]*name\s*=\s*"list_group"[^}]*\}')
KEYS_ONLY = re.compile(r'projection_type\s*=\s*"KEYS_ONLY"')


def earlier_module(current: str) -> str:
    """``current`` (the repository's ``dynamodb.tf``) with ``list_group`` projecting ``status``, as an earlier
    version of the module had it. Fails when the file no longer has the block this rewrites."""
    blocks = LIST_GROUP_BLOCK.findall(current)
    assert len(blocks) == 1, "dynamodb.tf: expected exactly one list_group index block"
    old_block, replaced = KEYS_ONLY.subn('projection_type = "INCLUDE"\n    non_key_attributes = ["status"]', blocks[0])
    assert replaced == 1, f"dynamodb.tf: list_group is not KEYS_ONLY any more:\n{blocks[0]}"
    return current.replace(blocks[0], old_block)


def indexes(dynamodb: Any) -> dict[str, dict[str, Any]]:
    table = dynamodb.describe_table(TableName=NAME)["Table"]
    return {i["IndexName"]: i for i in table["GlobalSecondaryIndexes"]}


def list_group_items(dynamodb: Any, workflow: str) -> list[dict[str, Any]]:
    """What a query of ``list_group`` returns for ``workflow``'s runs (``RUNS#<workflow>``, the index's projection
    applied)."""
    page = dynamodb.query(
        TableName=NAME,
        IndexName="list_group",
        KeyConditionExpression="list_group_pk = :pk",
        ExpressionAttributeValues={":pk": {"S": f"RUNS#{workflow}"}},
    )
    return list(page["Items"])


def statuses(world: AWSWorld, **query: Any) -> dict[str, RunStatus]:
    page = world.list_runs(limit=100, **query)
    assert page.cursor is None
    return {r.run_id: r.status for r in page.items}


@pytest.fixture(name="clients")
def clients_fixture(moto: str) -> Iterator[tuple[Any, Any]]:
    """DynamoDB and SQS clients on a freshly reset moto, closed afterwards."""
    urllib.request.urlopen(urllib.request.Request(f"{moto}/moto-api/reset", method="POST"), timeout=10).close()
    dynamodb = boto3.client("dynamodb", endpoint_url=moto, **CREDENTIALS)
    sqs = boto3.client("sqs", endpoint_url=moto, **CREDENTIALS)
    try:
        yield dynamodb, sqs
    finally:
        dynamodb.close()
        sqs.close()


def test_apply_upgrades_a_table_of_an_earlier_version_in_place(
    moto: str, clients: tuple[Any, Any], tmp_path: Path
) -> None:
    assert TERRAFORM is not None
    dynamodb, sqs = clients

    root = tmp_path / "root"
    root.mkdir()
    (root / "provider.tf").write_text(moto_provider(moto, *SERVICES))
    (root / "variables.tf").write_text((MODULE_DIR / "variables.tf").read_text())
    (root / "terraform.tfvars").write_text(TFVARS)
    current = (MODULE_DIR / "dynamodb.tf").read_text()
    (root / "dynamodb.tf").write_text(earlier_module(current))
    tf = Terraform(TERRAFORM, plugin_dir(), root)
    tf.init()

    # 1. the earlier module's table
    tf.apply()
    before = indexes(dynamodb)
    assert before["list_group"]["Projection"] == {"ProjectionType": "INCLUDE", "NonKeyAttributes": ["status"]}
    assert before["list"]["Projection"] == {"ProjectionType": "INCLUDE", "NonKeyAttributes": ["status"]}
    assert outdated_indexes(dynamodb.describe_table(TableName=NAME)["Table"]) == ["list_group"]

    # 2. runs written through a World on it
    queue_url = sqs.create_queue(QueueName=f"{NAME}-tasks")["QueueUrl"]
    world = AWSWorld(AWSConfig(base_url=None, table_name=NAME, queue_url=queue_url, poll_interval=0.05), dynamodb, sqs)
    made = {}
    for i in range(4):
        run = create(world, workflow="wf", run_id=f"wrun_up{i}", started=i % 2 == 1)
        if i == 3:
            run = world.append(run.run_id, [ev(EventType.RUN_COMPLETED, output=i)]).run
        made[run.run_id] = run.status
    create(world, workflow="other", run_id="wrun_other")
    assert statuses(world, workflow="wf") == made
    assert set(made.values()) == {RunStatus.PENDING, RunStatus.RUNNING, RunStatus.COMPLETED}
    assert all("status" in item for item in list_group_items(dynamodb, "wf"))  # the old index projects it

    # 3. the repository's module as it is, on the same state: an in-place update, not a replacement
    (root / "dynamodb.tf").write_text(current)
    applied = tf.run("apply", "-auto-approve", "-no-color", "-input=false", timeout=600).stdout
    assert "0 added, 1 changed, 0 destroyed" in applied, applied
    assert "must be replaced" not in applied and "destroy and then create" not in applied, applied
    after = indexes(dynamodb)
    assert after["list_group"]["Projection"] == {"ProjectionType": "KEYS_ONLY"}
    assert after["list_group"]["KeySchema"] == before["list_group"]["KeySchema"]
    assert after["list_group"]["IndexStatus"] == "ACTIVE"
    assert after["list"] == before["list"]
    assert outdated_indexes(dynamodb.describe_table(TableName=NAME)["Table"]) == []
    # -detailed-exitcode: 0 is "no changes", 2 would be a diff left over (Terraform.run fails on anything but 0)
    planned = tf.run("plan", "-detailed-exitcode", "-no-color", "-input=false", timeout=600).stdout
    assert "No changes." in planned, planned

    # the runs written before the upgrade, listed by workflow through the rebuilt index (status from META)
    groups = list_group_items(dynamodb, "wf")
    assert len(groups) == len(made) and not any("status" in item for item in groups)
    assert statuses(world, workflow="wf") == made
    for status in (RunStatus.PENDING, RunStatus.RUNNING, RunStatus.COMPLETED):
        assert statuses(world, workflow="wf", status=status) == {r: s for r, s in made.items() if s is status}
    assert statuses(world, workflow="other") == {"wrun_other": RunStatus.PENDING}
    # and the World goes on: a run after the upgrade, and a run of before it completed now
    create(world, workflow="wf", run_id="wrun_up9")
    world.append("wrun_up0", [ev(EventType.RUN_STARTED), ev(EventType.RUN_COMPLETED, output=0)])
    assert statuses(world, workflow="wf") == {**made, "wrun_up0": RunStatus.COMPLETED, "wrun_up9": RunStatus.PENDING}
