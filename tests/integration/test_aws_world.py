"""AWSWorld on a real moto server (DynamoDB, SQS, Scheduler): the World conformance suite, then what only AWS shows."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from celery_workflow.errors import ConfigurationError
from celery_workflow.testing.conformance import WorldConformance
from celery_workflow.world import World
from celery_workflow.world_sqs import AWSWorld, QueueConfig
from tests.integration.aws_fixtures import Aws, aws_fixture, moto_fixture  # noqa: F401


class QueuesOnDemand(AWSWorld):
    """For the conformance suite, whose tests make up queue names: an unknown name gets a new SQS queue (a real AWS
    World only knows the queues of its config)."""

    def __init__(self, aws: Aws, **config: Any) -> None:
        super().__init__(aws.config(**config), aws.dynamodb, aws.sqs)
        self._aws = aws
        self._made: dict[str, QueueConfig] = {}

    def queue_config(self, name: str) -> QueueConfig:
        try:
            return super().queue_config(name)
        except ConfigurationError:
            if name not in self._made:
                self._made[name] = self._aws.queue(name)
            return self._made[name]


class TestAWSWorld(WorldConformance):
    @pytest.fixture
    def world(self, aws: Aws) -> Iterator[World]:
        w = QueuesOnDemand(aws)
        yield w
        w.close()
