"""Payload limits on DynamoDB + SQS (moto; see payload_suite): the AWS World's smaller limit, derived from the
400 KB item, holds a value beside an input as large."""

from __future__ import annotations

from celery_workflow._aws.table import MAX_ITEM_BYTES
from celery_workflow.world import DEFAULT_MAX_PAYLOAD
from tests.integration.aws_fixtures import Aws, aws_fixture, moto_fixture  # noqa: F401
from tests.integration.payload_suite import check_payload_limits


def test_aws_payload_limits(aws: Aws) -> None:
    world = aws.world()
    try:
        assert world.max_payload < min(DEFAULT_MAX_PAYLOAD, MAX_ITEM_BYTES // 2)
        check_payload_limits(world)
    finally:
        world.close()
