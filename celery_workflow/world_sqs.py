"""The AWS World: workflow state in one DynamoDB table, deliveries on SQS standard and FIFO queues, EventBridge
Scheduler for deliveries due more than 15 minutes ahead (seed ``aws-world.txt``).

.. code-block:: python

    import boto3
    from celery_workflow.world_sqs import AWSConfig, AWSWorld, QueueConfig, SchedulerConfig

    world = AWSWorld(
        AWSConfig(
            base_url="https://workflows.example.com/v1/workflow",
            table_name="workflow",
            queue_url="https://sqs.eu-west-1.amazonaws.com/123456789012/workflow-tasks",
            queues={"ordered": QueueConfig(url=…, arn=…, fifo=True)},
            routes={"ledger": "ordered"},
            scheduler=SchedulerConfig(boto3.client("scheduler"), target_arn=…, role_arn=…),
        ),
        boto3.client("dynamodb"),
        boto3.client("sqs"),
    )
    world = AWSWorld.from_env()        # the same, from the Terraform module's environment output (WORKFLOW_*)

``AWSWorld(...)`` makes no AWS call. Create the table with the Terraform module, :func:`create_table` or
``celery-workflow create-table NAME``. Run deliveries with the Lambda queue handler
(:func:`celery_workflow.aws_lambda.queue_handler`) and serve RPC and webhooks with
:func:`celery_workflow.aws_lambda.http_handler`. ``pip install 'celery-workflow[aws]'``.

This module is the public face of the backend; its internals live in :mod:`celery_workflow._aws`.
"""

from __future__ import annotations

from celery_workflow._aws.config import AWSConfig, QueueConfig, SchedulerConfig
from celery_workflow._aws.table import create_table, rebuild_indexes, table_definition
from celery_workflow._aws.world import AWSWorld

__all__ = [
    "AWSConfig",
    "AWSWorld",
    "QueueConfig",
    "SchedulerConfig",
    "create_table",
    "rebuild_indexes",
    "table_definition",
]
