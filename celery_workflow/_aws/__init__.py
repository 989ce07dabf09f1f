"""The AWS backend's internals (the public face is :mod:`celery_workflow.world_sqs`): DynamoDB state, SQS (standard
and FIFO) deliveries, EventBridge Scheduler for long delays (seed ``aws-world.txt``).

* :mod:`.config`: :class:`~celery_workflow._aws.config.AWSConfig` and its parts, validated at construction, and
  ``from_env()`` for the Terraform module's ``environment`` output;
* :mod:`.table`: the table's keys, indexes and limits, ``create_table``;
* :mod:`.items`: DynamoDB attribute values and the items views are stored in;
* :mod:`.dynamo`: calls with the World's error mapping (throttling and service errors are ``WorldUnavailable``);
* :mod:`.append`: the append template's steps (one ``TransactWriteItems`` conditioned on the event count);
* :mod:`.queue`: ``QUEUE#`` records, publishing to SQS and the Scheduler, claims, acks and the outbox;
* :mod:`.broker_store`: the SQS transport's broker store over :mod:`.queue` (task queues on SQS, remote control and
  events on a control store the transport hands it);
* :mod:`.streams`, :mod:`.world` (with the retention expiry), :mod:`.expressions` and :mod:`.billing` (the cost
  counter's update expressions and AWS's sizing rules).
"""

from __future__ import annotations

try:  # the optional driver: pip install 'celery-workflow[aws]'
    import boto3 as _boto3  # noqa: F401
    import botocore as _botocore  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    from celery_workflow.errors import ConfigurationError

    raise ConfigurationError("the AWS World needs boto3: pip install 'celery-workflow[aws]'") from exc
