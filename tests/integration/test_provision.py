"""``celery-workflow provision``: the AWS World's table and queues on the emulator, named as the Terraform module
names them, and their environment, which builds the World's config."""

from __future__ import annotations

import io
import json
import os
import shlex
from typing import Any

import pytest

from celery_workflow._aws.provision import provision
from celery_workflow.cli import main
from celery_workflow.errors import ConfigurationError
from celery_workflow.world_sqs import AWSConfig, table_definition
from tests.integration.aws_fixtures import ROLE_ARN, Aws, aws_fixture, moto_fixture  # noqa: F401


def attributes(aws: Aws, url: str) -> dict[str, str]:
    return dict(aws.sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"])


def test_provision_makes_the_modules_resources_and_environment(aws: Aws) -> None:
    env = provision(
        "cwp",
        {"backfill": False, "ordered": True},
        dynamodb=aws.dynamodb,
        sqs=aws.sqs,
        scheduler=aws.scheduler,
        scheduler_role_arn=ROLE_ARN,
        max_receive_count=3,
        visibility_timeout=120,
    )
    table = aws.dynamodb.describe_table(TableName="cwp")["Table"]
    assert {i["IndexName"] for i in table["GlobalSecondaryIndexes"]} == {
        i["IndexName"] for i in table_definition("cwp")["GlobalSecondaryIndexes"]
    }
    queues = json.loads(env["WORKFLOW_QUEUES"])
    assert env["WORKFLOW_QUEUE_URL"].endswith("/cwp-tasks")
    assert queues["backfill"]["url"].endswith("/cwp-backfill") and queues["backfill"]["fifo"] is False
    assert queues["ordered"]["url"].endswith("/cwp-ordered.fifo") and queues["ordered"]["fifo"] is True
    for url, dlq in (
        (env["WORKFLOW_QUEUE_URL"], "cwp-tasks-dlq"),
        (queues["backfill"]["url"], "cwp-backfill-dlq"),
        (queues["ordered"]["url"], "cwp-ordered-dlq.fifo"),
    ):
        seen = attributes(aws, url)
        redrive = json.loads(seen["RedrivePolicy"])
        assert redrive["deadLetterTargetArn"].endswith(f":{dlq}")
        assert int(redrive["maxReceiveCount"]) == 3
        assert seen["VisibilityTimeout"] == "120"
    assert attributes(aws, queues["ordered"]["url"])["ContentBasedDeduplication"] == "true"
    assert env["WORKFLOW_SCHEDULER_GROUP"] == "cwp"
    assert aws.scheduler.get_schedule_group(Name="cwp")["Name"] == "cwp"
    config = AWSConfig.from_env(env, scheduler_client=aws.scheduler)
    assert config.table_name == "cwp"
    assert config.queue("ordered").fifo
    assert config.scheduler is not None and config.scheduler.role_arn == ROLE_ARN
    again = provision(
        "cwp",
        {"backfill": False, "ordered": True},
        dynamodb=aws.dynamodb,
        sqs=aws.sqs,
        scheduler=aws.scheduler,
        scheduler_role_arn=ROLE_ARN,
        max_receive_count=3,
        visibility_timeout=120,
    )
    assert again == env  # idempotent: what exists is taken as it is


@pytest.mark.parametrize(
    ("name", "queues", "says"),
    [
        ("has.dot", {}, "1 to 40 letters"),
        ("ok", {"celery": False}, '"celery" (the default queue)'),
        ("ok", {"x-dlq": False}, "not ending in -dlq"),
        ("ok", {"ordered": True}, "a FIFO queue needs the Scheduler"),
    ],
)
def test_provision_refuses_what_the_module_refuses(aws: Aws, name: str, queues: dict[str, bool], says: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        provision(name, queues, dynamodb=aws.dynamodb, sqs=aws.sqs)
    assert says in str(refused.value)
    assert aws.dynamodb.list_tables()["TableNames"] == ["workflow"]  # the fixture's: nothing was made


def test_the_command_prints_export_lines_a_shell_can_eval(aws: Aws, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {
        "AWS_ENDPOINT_URL": aws.endpoint,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
    }.items():
        monkeypatch.setenv(key, value)
    out = io.StringIO()
    assert main(["provision", "cwcli", "--queue", "backfill", "--wait", "5"], out=out) == 0
    lines = out.getvalue().splitlines()
    assert all(line.startswith("export ") for line in lines), lines
    env: dict[str, Any] = dict(shlex.split(line)[1].split("=", 1) for line in lines)
    assert env["CELERY_WORKFLOW_URL"] == "aws://"
    assert env["WORKFLOW_TABLE"] == "cwcli"
    assert json.loads(env["WORKFLOW_QUEUES"])["backfill"]["url"].endswith("/cwcli-backfill")
    assert "WORKFLOW_SCHEDULER_ROLE_ARN" not in env
    AWSConfig.from_env(env)  # a valid World config
    as_json = io.StringIO()
    assert main(["provision", "cwcli", "--queue", "backfill", "--json"], out=as_json) == 0  # idempotent, as JSON
    assert json.loads(as_json.getvalue()) == env
    assert main(["provision", "cwcli", "--fifo-queue", "ordered"], out=io.StringIO()) == 2  # no Scheduler
    assert os.environ["AWS_ENDPOINT_URL"] == aws.endpoint
