"""The Terraform module in ``terraform/``: formatted and valid (its Lambda example too), then applied for real
against the moto server, an AWS World built from its ``environment`` output, a routed workflow run end to end by a
real Celery worker on the queue Terraform made, its IAM policies checked against the seed's table in both
directions and against the AWS calls the worker and the client really make, and destroyed.

One root config applies the module twice (in one apply, to save time):

* ``workflow`` (``cwtf``): the Scheduler, a standard ``backfill`` and a FIFO ``ordered`` queue, the policies attached
  to a worker and an API role; the worker and the client of the end-to-end test run on it;
* ``apps``: ``terraform/examples/step_functions``, the two examples' Tasks table, sample queues and policy;
* ``plain`` (``cwtf-plain``): no Scheduler, and ``worker_function_name`` set, so the SQS event source mappings are
  created. moto invokes a mapped function synchronously whenever a message reaches its queue (in Docker), so no
  message is ever sent to this instance's queues: only the mappings themselves are checked. ``tick_function_name``
  is set too (the same function: moto's Scheduler stores schedules and never runs them), so the every-minute tick
  schedule and its role are created.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from celery_workflow.world_sqs import AWSConfig, table_definition
from tests.acceptance.workers import APPS, Worker, imported_app, wait_for
from tests.integration.aws_fixtures import CREDENTIALS, REGION, moto_fixture  # noqa: F401
from tests.integration.terraform_fixtures import (
    MODULE_DIR,
    REPO,
    Terraform,
    allowed,
    copy_module,
    iam_requests,
    moto_provider,
    pairs,
    plugin_dir,
    read_calls,
    recording,
    statements,
    terraform_binary,
)

TERRAFORM = terraform_binary()
pytestmark = pytest.mark.skipif(TERRAFORM is None, reason="the terraform binary is not installed")

ACCOUNT = "123456789012"  # moto's
NAME = "cwtf"
PLAIN = "cwtf-plain"

#: The services the module touches: their endpoints point at the moto server.
SERVICES = ("dynamodb", "iam", "lambda", "scheduler", "sqs", "sts")

ROOT_CONFIG = """
data "aws_iam_policy_document" "lambda_trust" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["lambda.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "worker" {
  name               = "cwtf-worker-role"
  assume_role_policy = data.aws_iam_policy_document.lambda_trust.json
}

resource "aws_iam_role" "api" {
  name               = "cwtf-api-role"
  assume_role_policy = data.aws_iam_policy_document.lambda_trust.json
}

resource "aws_iam_role" "function" {
  name               = "cwtf-function-role"
  assume_role_policy = data.aws_iam_policy_document.lambda_trust.json
}

resource "aws_iam_role" "examples" {
  name               = "cwtf-examples-role"
  assume_role_policy = data.aws_iam_policy_document.lambda_trust.json
}

resource "aws_lambda_function" "worker" {
  function_name = "cwtf-worker"
  role          = aws_iam_role.function.arn
  runtime       = "python3.11"
  handler       = "worker.handler"
  filename      = "${path.module}/worker.zip"
  timeout       = 100
}

module "workflow" {
  source = "@MODULE@"

  name                = "cwtf"
  emulator_endpoint   = "@MOTO@"
  deletion_protection = false
  worker_role_name    = aws_iam_role.worker.name
  api_role_name       = aws_iam_role.api.name
  tags                = { project = "celery-workflow", suite = "terraform" }

  queues = {
    backfill = {}
    ordered  = { fifo = true, batch_size = 5, visibility_timeout_seconds = 120, max_receive_count = 3 }
  }
}

module "apps" {
  source = "@MODULE@/examples/step_functions"

  tasks_table  = "cwtf-Tasks"
  sample_queue = "cwtf-sample"
  role_name    = aws_iam_role.examples.name
}

output "apps" {
  value = module.apps
}

module "plain" {
  source = "@MODULE@"

  name                       = "cwtf-plain"
  enable_scheduler           = false
  deletion_protection        = false
  point_in_time_recovery     = false
  visibility_timeout_seconds = 120
  message_retention_seconds  = 3600
  max_receive_count          = 4
  worker_function_name       = aws_lambda_function.worker.function_name
  tick_function_name         = aws_lambda_function.worker.function_name
  worker_role_name           = aws_iam_role.function.name
  batch_size                 = 20
  maximum_concurrency        = 5

  queues = {
    bulk  = { batch_size = 100, maximum_concurrency = 3 }
    small = {}
  }
}

output "workflow" {
  value = module.workflow
}

output "plain" {
  value = module.plain
}
"""

#: The worker app of the end-to-end test: wfapp, with every AWS call of the worker (and its pool) recorded.
RECORDED_APP = """
import os

from tests.integration.terraform_fixtures import record_boto_calls

record_boto_calls(os.environ["CW_AWS_CALLS"])

from wfapp import celery_app as app  # noqa: E402
"""


def arn(service: str, resource: str) -> str:
    return f"arn:aws:{service}:{REGION}:{ACCOUNT}:{resource}"


def client(moto: str, service: str) -> Any:
    return boto3.client(service, endpoint_url=moto, **CREDENTIALS)


class Deployment:
    """The root config, applied in a background thread (:meth:`start`; a minute, mostly the AWS provider waiting for
    each SQS queue's attributes to settle, so the static checks run meanwhile) to a freshly reset moto; :meth:`wait`
    for it, then ``outputs`` holds the module instances' outputs (``workflow`` and ``plain``)."""

    def __init__(self, terraform: Terraform, moto: str) -> None:
        self.terraform = terraform
        self.moto = moto
        self.outputs: dict[str, Any] = {}
        self.destroyed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._apply, name="terraform-apply", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _apply(self) -> None:
        try:
            urllib.request.urlopen(
                urllib.request.Request(f"{self.moto}/moto-api/reset", method="POST"), timeout=10
            ).close()
            self.terraform.init()
            self.terraform.apply()
            self.outputs = self.terraform.outputs()
        except BaseException as exc:
            self._error = exc

    def wait(self) -> None:
        if self._thread.ident is None:
            self.start()
        self._thread.join(timeout=900)
        assert not self._thread.is_alive(), "terraform apply did not finish within 15 minutes"
        if self._error is not None:
            raise self._error

    @property
    def workflow(self) -> dict[str, Any]:
        return dict(self.outputs["workflow"])

    @property
    def plain(self) -> dict[str, Any]:
        return dict(self.outputs["plain"])

    def client(self, service: str) -> Any:
        return client(self.moto, service)

    def destroy(self) -> None:
        """``terraform destroy`` once (after the apply, whether it succeeded or not, if it wrote any state)."""
        if self._thread.ident is not None:
            self._thread.join(timeout=900)
        if not self.destroyed and (self.terraform.workdir / "terraform.tfstate").exists():
            self.destroyed = True
            self.terraform.destroy()


def worker_zip() -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr("worker.py", "def handler(event, context):\n    return {'batchItemFailures': []}\n")
    return out.getvalue()


@pytest.fixture(scope="module")
def terraform_setup() -> tuple[str, Path]:
    assert TERRAFORM is not None
    return TERRAFORM, plugin_dir()


@pytest.fixture(scope="module")
def applying(
    request: pytest.FixtureRequest,
    moto: str,
    terraform_setup: tuple[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Deployment]:
    """The root config being applied in the background, when a selected test of this module needs the
    ``deployment``; destroyed afterwards (if no test did)."""
    root = tmp_path_factory.mktemp("tf-root")
    (root / "main.tf").write_text(
        moto_provider(moto, *SERVICES) + ROOT_CONFIG.replace("@MOTO@", moto).replace("@MODULE@", str(MODULE_DIR))
    )
    (root / "worker.zip").write_bytes(worker_zip())
    deployed = Deployment(Terraform(*terraform_setup, root), moto)
    selected = [item for item in request.session.items if getattr(item, "module", None) is request.module]
    if any("deployment" in getattr(item, "fixturenames", ()) for item in selected):
        deployed.start()
    try:
        yield deployed
    finally:
        deployed.destroy()


@pytest.fixture(scope="module")
def deployment(applying: Deployment) -> Deployment:
    """The applied root config."""
    applying.wait()
    return applying


# -- static checks --------------------------------------------------------------------------------------------------


# These request ``applying`` only so that the apply runs while they do.


def test_module_is_formatted(terraform_setup: tuple[str, Path], applying: Deployment, tmp_path: Path) -> None:
    terraform = Terraform(terraform_setup[0], terraform_setup[1], tmp_path)
    done = terraform.run("fmt", "-check", "-recursive", "-diff", "-no-color", str(MODULE_DIR))
    assert done.stdout == ""


@pytest.mark.parametrize("folder", [".", "examples/lambda", "examples/step_functions"])
def test_module_and_lambda_example_validate(
    terraform_setup: tuple[str, Path], applying: Deployment, tmp_path: Path, folder: str
) -> None:
    copy = copy_module(tmp_path / "terraform")
    terraform = Terraform(*terraform_setup, copy / folder)
    terraform.init(backend=False)
    result = terraform.validate()
    assert result["valid"], result
    assert result["warning_count"] == 0, result["diagnostics"]


#: Module calls that each break one input rule, and what the error says.
BAD_INPUTS = {
    'name = "has.dot"': "name must be 1 to 40 letters, digits, hyphens or underscores",
    "message_retention_seconds = 600": "message_retention_seconds must be a whole number of seconds from 3600",
    "maximum_concurrency = 1": "maximum_concurrency must be null or a whole number from 2 to 1000",
    "batch_size = 10001": "batch_size must be a whole number from 1 to 10000",
    "visibility_timeout_seconds = 43201": "visibility_timeout_seconds must be a whole number of seconds from 0",
    "max_receive_count = 0": "max_receive_count must be a whole number from 1 to 1000",
    "queues = { celery = {} }": 'must not be \\"celery\\" (the default queue)',
    "queues = { tasks = {} }": 'or \\"tasks\\" (the task queue',
    "queues = { x-dlq = {} }": "must not end in -dlq",
    "queues = { ordered = { fifo = true, batch_size = 11 } }": "at most 10 for a FIFO queue",
    "queues = { q = { maximum_concurrency = 1001 } }": "queues: maximum_concurrency must be null",
    'emulator_endpoint = "127.0.0.1:4566"': "emulator_endpoint must be null or an http:// or https:// URL",
    'emulator_endpoint = "http://127.0.0.1:4566/path"': "emulator_endpoint must be null or an http:// or https:// URL",
    'emulator_credentials = { access_key_id = "", secret_access_key = "x" }': "emulator_credentials: access_key_id",
}


def test_inputs_are_checked(terraform_setup: tuple[str, Path], applying: Deployment, tmp_path: Path) -> None:
    """Each rule of the module's inputs rejects a bad value with its message (``validate`` checks the values a root
    config passes); the largest valid values pass."""
    blocks, lines, line = [], {}, 1
    for index, (argument, message) in enumerate(BAD_INPUTS.items()):
        blocks.append(f'module "bad{index}" {{\n  source = "{MODULE_DIR}"\n  {argument}\n}}\n')
        lines[line + 2] = message
        line += 4
    blocks.append(
        f'module "good" {{\n  source = "{MODULE_DIR}"\n  name = "{"n" * 40}"\n  maximum_concurrency = 1000\n'
        f"  batch_size = 10000\n  message_retention_seconds = 3600\n"
        f"  queues = {{ {'q' * 30} = {{ fifo = true, batch_size = 10 }}, b = {{ maximum_concurrency = 2 }} }}\n}}\n"
    )
    (tmp_path / "main.tf").write_text("".join(blocks))
    terraform = Terraform(*terraform_setup, tmp_path)
    terraform.init(backend=False)
    done = subprocess.run(
        [terraform.binary, "validate", "-json", "-no-color"],
        cwd=tmp_path,
        env=terraform.env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    result = json.loads(done.stdout)
    errors = {d["range"]["start"]["line"]: d["detail"] for d in result["diagnostics"] if d["severity"] == "error"}
    assert sorted(errors) == sorted(lines), result["diagnostics"]
    for at, message in lines.items():
        assert message in json.dumps(errors[at]), (at, errors[at])


def test_a_fifo_queue_needs_the_scheduler(
    moto: str, terraform_setup: tuple[str, Path], applying: Deployment, tmp_path: Path
) -> None:
    """A FIFO queue without the Scheduler fails the plan, saying why (a precondition: it involves two inputs)."""
    provider = moto_provider(moto, *SERVICES)
    (tmp_path / "main.tf").write_text(
        provider + f'module "fifo" {{\n  source = "{MODULE_DIR}"\n  enable_scheduler = false\n'
        "  queues = { ordered = { fifo = true } }\n}\n"
    )
    terraform = Terraform(*terraform_setup, tmp_path)
    terraform.init()
    with pytest.raises(AssertionError, match="Resource precondition failed") as failed:
        terraform.run("plan", "-no-color", "-input=false", "-refresh=false")
    said = " ".join(str(failed.value).split())  # Terraform wraps its messages
    assert 'queues["ordered"] is FIFO' in said
    assert "set enable_scheduler = true" in said


def test_emulator_inputs_plan_the_emulators_environment(
    moto: str, terraform_setup: tuple[str, Path], applying: Deployment, tmp_path: Path
) -> None:
    """``emulator_endpoint`` and ``emulator_credentials`` make ``emulator_environment`` (known at plan time: the
    endpoint, the provider's region, the credentials); without them it is null. The provider block is the README's
    "Against an emulator" one."""
    readme = (MODULE_DIR / "README.md").read_text()
    block = readme.split("## Against an emulator\n", 1)[1].split("```hcl\n", 1)[1]
    provider = block[: block.index("\n}\n") + 3].replace("http://127.0.0.1:4566", moto)  # its provider block
    assert provider.startswith('provider "aws" {')
    (tmp_path / "main.tf").write_text(
        provider
        + f'module "emulated" {{\n  source = "{MODULE_DIR}"\n  emulator_endpoint = "{moto}/"\n'
        + '  emulator_credentials = { access_key_id = "AKEMU", secret_access_key = "s3cr3t" }\n}\n'
        + f'module "real" {{\n  source = "{MODULE_DIR}"\n  name = "real"\n}}\n'
        + 'output "emulated" {\n  value = module.emulated.emulator_environment\n}\n'
        + 'output "real" {\n  value = module.real.emulator_environment\n}\n'
    )
    terraform = Terraform(*terraform_setup, tmp_path)
    terraform.init()
    terraform.run("plan", "-no-color", "-input=false", "-refresh=false", "-out=plan")
    planned = json.loads(terraform.run("show", "-json", "-no-color", "plan").stdout)["planned_values"]["outputs"]
    assert planned["emulated"]["value"] == {
        "AWS_ENDPOINT_URL": moto,  # without the trailing slash
        "AWS_DEFAULT_REGION": REGION,
        "AWS_ACCESS_KEY_ID": "AKEMU",
        "AWS_SECRET_ACCESS_KEY": "s3cr3t",
    }
    assert planned["real"].get("value") is None


def test_the_repository_module_holds_no_working_files() -> None:
    leftovers = [
        p for pattern in (".terraform", "*.tfstate*", ".terraform.lock.hcl") for p in MODULE_DIR.rglob(pattern)
    ]
    assert leftovers == []
    ignored = (MODULE_DIR / ".gitignore").read_text().split()
    assert {".terraform/", ".terraform.lock.hcl", "*.tfstate"} <= set(ignored)


# -- what the apply made --------------------------------------------------------------------------------------------


def test_table_is_what_create_table_makes(deployment: Deployment) -> None:
    dynamodb = deployment.client("dynamodb")
    wanted = table_definition(NAME)
    table = dynamodb.describe_table(TableName=NAME)["Table"]
    assert table["KeySchema"] == wanted["KeySchema"]
    assert sorted(table["AttributeDefinitions"], key=str) == sorted(wanted["AttributeDefinitions"], key=str)

    def shape(indexes: list[dict[str, Any]]) -> dict[str, Any]:
        return {i["IndexName"]: (i["KeySchema"], i["Projection"]) for i in indexes}

    assert shape(table["GlobalSecondaryIndexes"]) == shape(wanted["GlobalSecondaryIndexes"])
    assert table["BillingModeSummary"]["BillingMode"] == wanted["BillingMode"] == "PAY_PER_REQUEST"
    assert table["SSEDescription"]["Status"] == "ENABLED"
    ttl = dynamodb.describe_time_to_live(TableName=NAME)["TimeToLiveDescription"]
    assert (ttl["TimeToLiveStatus"], ttl["AttributeName"]) == ("ENABLED", "expires_at")  # as create_table enables it
    assert table["DeletionProtectionEnabled"] is False  # as the root config asks (the default is on)
    tags = dynamodb.list_tags_of_resource(ResourceArn=table["TableArn"])["Tags"]
    assert {t["Key"]: t["Value"] for t in tags} == {"project": "celery-workflow", "suite": "terraform"}

    def pitr(name: str) -> str:
        backups = dynamodb.describe_continuous_backups(TableName=name)["ContinuousBackupsDescription"]
        return str(backups["PointInTimeRecoveryDescription"]["PointInTimeRecoveryStatus"])

    assert pitr(NAME) == "ENABLED"  # the default
    assert pitr(PLAIN) == "DISABLED"
    assert deployment.workflow["table_arn"] == table["TableArn"] == arn("dynamodb", f"table/{NAME}")


def queue_attributes(sqs: Any, url: str) -> dict[str, Any]:
    found = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
    if "RedrivePolicy" in found:
        found["RedrivePolicy"] = json.loads(found["RedrivePolicy"])
        found["RedrivePolicy"]["maxReceiveCount"] = int(found["RedrivePolicy"]["maxReceiveCount"])
    return dict(found)


def test_queues_and_their_dead_letter_queues(deployment: Deployment) -> None:
    sqs = deployment.client("sqs")
    main = deployment.workflow
    routed = main["queues"]
    assert sorted(routed) == ["backfill", "ordered"]
    assert routed["backfill"]["name"] == "cwtf-backfill"
    assert routed["ordered"]["name"] == "cwtf-ordered.fifo"
    assert routed["ordered"]["dead_letter_arn"] == arn("sqs", "cwtf-ordered-dlq.fifo")

    cases = [  # (queue url, dead-letter url, fifo, visibility, max receives, retention)
        (main["queue_url"], main["dead_letter_queue_url"], False, 360, 10, 1209600),
        (routed["backfill"]["url"], routed["backfill"]["dead_letter_url"], False, 360, 10, 1209600),
        (routed["ordered"]["url"], routed["ordered"]["dead_letter_url"], True, 120, 3, 1209600),
        (deployment.plain["queue_url"], deployment.plain["dead_letter_queue_url"], False, 120, 4, 3600),
        (deployment.plain["queues"]["bulk"]["url"], deployment.plain["queues"]["bulk"]["dead_letter_url"],
         False, 120, 4, 3600),
    ]  # fmt: skip
    for url, dead_letter_url, fifo, visibility, receives, retention in cases:
        queue, dead_letter = queue_attributes(sqs, url), queue_attributes(sqs, dead_letter_url)
        assert int(queue["VisibilityTimeout"]) == visibility, url
        assert int(queue["MessageRetentionPeriod"]) == int(dead_letter["MessageRetentionPeriod"]) == retention, url
        assert queue["RedrivePolicy"] == {"deadLetterTargetArn": dead_letter["QueueArn"], "maxReceiveCount": receives}
        assert "RedrivePolicy" not in dead_letter
        assert queue.get("SqsManagedSseEnabled") == dead_letter.get("SqsManagedSseEnabled") == "true", url
        for attributes in (queue, dead_letter):
            assert attributes.get("FifoQueue", "false") == str(fifo).lower(), url
            assert attributes.get("ContentBasedDeduplication", "false") == str(fifo).lower(), url
    tags = sqs.list_queue_tags(QueueUrl=routed["ordered"]["url"])["Tags"]
    assert tags == {"project": "celery-workflow", "suite": "terraform"}


def test_environment_output_builds_the_world_config(deployment: Deployment) -> None:
    main = deployment.workflow
    env = main["environment"]
    assert set(env) == {
        "WORKFLOW_TABLE", "WORKFLOW_QUEUE_URL", "WORKFLOW_QUEUES", "WORKFLOW_QUEUE_ARN", "WORKFLOW_SCHEDULER_GROUP",
        "WORKFLOW_SCHEDULER_ROLE_ARN",
    }  # fmt: skip
    scheduler_client = deployment.client("scheduler")
    config = AWSConfig.from_env(env, scheduler_client=scheduler_client)
    assert config.table_name == NAME
    assert config.queue_url == main["queue_url"]
    assert set(config.queues) == {"backfill", "ordered"}  # routing names, not SQS names
    backfill, ordered = config.queues["backfill"], config.queues["ordered"]
    assert (backfill.url, backfill.arn, backfill.fifo) == (main["queues"]["backfill"]["url"], arn("sqs", "cwtf-backfill"), False)  # fmt: skip
    assert (ordered.name, ordered.arn, ordered.fifo) == ("cwtf-ordered.fifo", arn("sqs", "cwtf-ordered.fifo"), True)
    assert config.scheduler is not None
    assert config.scheduler.client is scheduler_client
    assert config.scheduler.target_arn == main["queue_arn"] == arn("sqs", "cwtf-tasks")
    assert config.scheduler.group == NAME
    assert config.scheduler.role_arn == main["scheduler_role_arn"] == f"arn:aws:iam::{ACCOUNT}:role/cwtf-scheduler"
    group = scheduler_client.get_schedule_group(Name=NAME)
    assert group["State"] == "ACTIVE"
    # the README's `eval "$(terraform output -raw shell_environment)"` exports exactly the environment output
    script = main["shell_environment"] + '\nexec python3 -c "import json, os; print(json.dumps(dict(os.environ)))"'
    exported = json.loads(subprocess.run(["bash", "-c", script], check=True, capture_output=True, text=True).stdout)
    assert {key: exported.get(key) for key in env} == env
    # with emulator_endpoint, the emulator's variables too: the World built from the exports reaches moto
    emulator = {
        "AWS_ENDPOINT_URL": deployment.moto,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
    }
    assert main["emulator_environment"] == emulator
    assert {key: exported.get(key) for key in emulator} == emulator
    assert deployment.plain["emulator_environment"] is None
    assert "AWS_" not in deployment.plain["shell_environment"]

    plain_env = deployment.plain["environment"]
    assert set(plain_env) == {"WORKFLOW_TABLE", "WORKFLOW_QUEUE_URL", "WORKFLOW_QUEUES"}
    plain = AWSConfig.from_env(plain_env)
    assert plain.scheduler is None
    assert {name: q.fifo for name, q in plain.queues.items()} == {"bulk": False, "small": False}
    assert deployment.plain["scheduler_group_name"] is None
    assert deployment.plain["scheduler_role_arn"] is None


def test_event_source_mappings_report_batch_item_failures(deployment: Deployment) -> None:
    assert deployment.workflow["event_source_mapping_uuids"] == {}  # no worker_function_name
    uuids = deployment.plain["event_source_mapping_uuids"]
    assert sorted(uuids) == ["bulk", "small", "tasks"]
    lambda_ = deployment.client("lambda")
    found = {}
    for key, uuid in uuids.items():
        mapping = lambda_.get_event_source_mapping(UUID=uuid)
        found[key] = (
            mapping["EventSourceArn"],
            mapping["FunctionResponseTypes"],
            mapping["BatchSize"],
            mapping.get("MaximumBatchingWindowInSeconds", 0),
            (mapping.get("ScalingConfig") or {}).get("MaximumConcurrency"),
        )
        assert mapping["FunctionArn"] == arn("lambda", "function:cwtf-worker")
    assert found == {
        "tasks": (arn("sqs", "cwtf-plain-tasks"), ["ReportBatchItemFailures"], 20, 1, 5),
        "bulk": (arn("sqs", "cwtf-plain-bulk"), ["ReportBatchItemFailures"], 100, 1, 3),
        "small": (arn("sqs", "cwtf-plain-small"), ["ReportBatchItemFailures"], 10, 0, 5),
    }


# -- IAM ------------------------------------------------------------------------------------------------------------

TABLE_ACTIONS = ["GetItem", "PutItem", "UpdateItem", "DeleteItem", "Query", "BatchGetItem"]


def dead_letter_name(queue: str) -> str:
    """The module's name for a queue's dead-letter queue: ``<queue>-dlq`` (``.fifo`` kept last)."""
    return f"{queue.removesuffix('.fifo')}-dlq.fifo" if queue.endswith(".fifo") else f"{queue}-dlq"


def expected_policies(name: str, queues: list[str], *, scheduler: bool) -> dict[str, set[tuple[str, str]]]:
    """The seed's IAM section, transcribed: (action, resource) pairs of the worker and the API policies.

    Both: the six item actions on the table and its indexes, sqs:SendMessage on every queue. The worker also:
    BatchWriteItem (retention deletes) on the table, ReceiveMessage, DeleteMessage, ChangeMessageVisibility and
    GetQueueAttributes on the queues; with the Scheduler, CreateSchedule and DeleteSchedule on the World's schedules
    and iam:PassRole on the Scheduler role. The API, with the Scheduler: CreateSchedule (a cancelled run schedules its
    expiry) and DeleteSchedule, and iam:PassRole on the Scheduler role, which the seed forgot (AWS requires it for a
    CreateSchedule naming the role): a documented deviation. Another: the worker may receive, delete, send to and
    change the visibility of messages on the dead-letter queues (it moves dead letters itself, and redrives them)."""
    table = arn("dynamodb", f"table/{name}")
    queue_arns = [arn("sqs", q) for q in queues]
    both = {(f"dynamodb:{a}", r) for a in TABLE_ACTIONS for r in (table, f"{table}/index/*")}
    both |= {("sqs:SendMessage", q) for q in queue_arns}
    worker = {*both, ("dynamodb:BatchWriteItem", table)}
    worker |= {(f"sqs:{a}", q) for a in ("ReceiveMessage", "DeleteMessage", "ChangeMessageVisibility",
                                          "GetQueueAttributes") for q in queue_arns}  # fmt: skip
    # a documented deviation: workers move messages to the dead-letter queues themselves (issue #12)
    worker |= {(f"sqs:{a}", arn("sqs", dead_letter_name(q))) for a in ("ReceiveMessage", "DeleteMessage",
               "ChangeMessageVisibility", "SendMessage") for q in queues}  # fmt: skip
    api = set(both)
    if scheduler:
        schedules = arn("scheduler", f"schedule/{name}/celery-workflow-*")
        role = f"arn:aws:iam::{ACCOUNT}:role/{name}-scheduler"
        for side in (worker, api):
            side |= {("scheduler:CreateSchedule", schedules), ("scheduler:DeleteSchedule", schedules)}
            side.add(("iam:PassRole", role))
    return {"worker": worker, "api": api}


def test_policies_are_exactly_the_seeds(deployment: Deployment) -> None:
    cases = [
        (deployment.workflow, NAME, ["cwtf-tasks", "cwtf-backfill", "cwtf-ordered.fifo"], True),
        (deployment.plain, PLAIN, ["cwtf-plain-tasks", "cwtf-plain-bulk", "cwtf-plain-small"], False),
    ]
    for outputs, name, queues, scheduler in cases:
        wanted = expected_policies(name, queues, scheduler=scheduler)
        for side in ("worker", "api"):
            got = pairs(outputs[f"{side}_policy_json"])
            assert got - wanted[side] == set(), f"{name} {side}: more than the seed allows"
            assert wanted[side] - got == set(), f"{name} {side}: missing"
            for statement in statements(outputs[f"{side}_policy_json"]):
                if statement["Action"] == "iam:PassRole":  # only to the Scheduler
                    assert statement["Condition"] == {
                        "StringEquals": {"iam:PassedToService": "scheduler.amazonaws.com"}
                    }
                else:
                    assert "Condition" not in statement, statement
        if not scheduler:
            everything = pairs(outputs["worker_policy_json"]) | pairs(outputs["api_policy_json"])
            assert not [p for p in everything if p[0].startswith(("scheduler:", "iam:"))]


def test_policies_in_iam_are_the_outputs_and_attached(deployment: Deployment) -> None:
    iam = deployment.client("iam")
    main = deployment.workflow
    for side, role in (("worker", "cwtf-worker-role"), ("api", "cwtf-api-role")):
        policy_arn = main[f"{side}_policy_arn"]
        assert policy_arn == f"arn:aws:iam::{ACCOUNT}:policy/{NAME}-{side}"
        version = iam.get_policy(PolicyArn=policy_arn)["Policy"]["DefaultVersionId"]
        document = iam.get_policy_version(PolicyArn=policy_arn, VersionId=version)["PolicyVersion"]["Document"]
        if isinstance(document, str):
            document = json.loads(urllib.parse.unquote(document))
        assert pairs(document) == pairs(main[f"{side}_policy_json"])
        attached = iam.list_attached_role_policies(RoleName=role)["AttachedPolicies"]
        assert [p["PolicyArn"] for p in attached] == [policy_arn]
    plain_attached = iam.list_attached_role_policies(RoleName="cwtf-function-role")["AttachedPolicies"]
    assert [p["PolicyArn"] for p in plain_attached] == [deployment.plain["worker_policy_arn"]]
    assert iam.list_entities_for_policy(PolicyArn=deployment.plain["api_policy_arn"])["PolicyRoles"] == []


def test_scheduler_role_trusts_scheduler_and_sends_to_the_queues(deployment: Deployment) -> None:
    iam = deployment.client("iam")
    role = iam.get_role(RoleName="cwtf-scheduler")["Role"]
    trust = role["AssumeRolePolicyDocument"]
    if isinstance(trust, str):
        trust = json.loads(urllib.parse.unquote(trust))
    [statement] = statements(trust)
    assert statement["Effect"] == "Allow"
    assert statement["Action"] == "sts:AssumeRole"
    assert statement["Principal"] == {"Service": "scheduler.amazonaws.com"}
    assert statement["Condition"] == {
        "StringEquals": {"aws:SourceAccount": ACCOUNT},
        "ArnEquals": {"aws:SourceArn": arn("scheduler", f"schedule-group/{NAME}")},
    }
    assert statement["Sid"] == "SchedulerAssumesRole"
    assert statements(deployment.workflow["scheduler_role_trust_policy_json"]) == [statement]

    [name] = iam.list_role_policies(RoleName="cwtf-scheduler")["PolicyNames"]
    inline = iam.get_role_policy(RoleName="cwtf-scheduler", PolicyName=name)["PolicyDocument"]
    if isinstance(inline, str):
        inline = json.loads(urllib.parse.unquote(inline))
    queues = ["cwtf-tasks", "cwtf-backfill", "cwtf-ordered.fifo"]
    assert pairs(inline) == {("sqs:SendMessage", arn("sqs", q)) for q in queues}
    assert pairs(inline) == pairs(deployment.workflow["scheduler_role_policy_json"])
    assert iam.list_attached_role_policies(RoleName="cwtf-scheduler")["AttachedPolicies"] == []
    with pytest.raises(iam.exceptions.NoSuchEntityException):
        iam.get_role(RoleName="cwtf-plain-scheduler")
    assert deployment.plain["scheduler_role_trust_policy_json"] is None


# -- a routed workflow on the deployment, by a real worker ----------------------------------------------------------


@pytest.mark.acceptance
def test_backfill_runs_on_the_terraform_queue_within_the_policies(deployment: Deployment, tmp_path: Path) -> None:
    """wfapp's ``backfill`` (routed to ``backfill``) runs to completion on a worker that consumes only the
    Terraform-made backfill queue; a run sleeping an hour routed there too gets a schedule in the module's group,
    aimed at that queue with the module's Scheduler role; every AWS call of the worker is allowed by the worker policy
    and every call of the client by the API policy."""
    main = deployment.workflow
    env = {
        "CELERY_WORKFLOW_URL": "aws://",
        "AWS_ENDPOINT_URL": deployment.moto,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        **main["environment"],
    }
    app_dir = tmp_path / "app"
    app_dir.mkdir()
    (app_dir / "recorded_wfapp.py").write_text(RECORDED_APP)
    worker_calls = tmp_path / "worker-calls.jsonl"
    pythonpath = os.pathsep.join([str(app_dir), str(APPS), str(REPO), os.environ.get("PYTHONPATH", "")])
    worker_env = {**env, "CW_AWS_CALLS": str(worker_calls), "PYTHONPATH": pythonpath}
    scheduler = deployment.client("scheduler")
    backfill_url = main["queues"]["backfill"]["url"]

    with recording() as client_calls, imported_app("wfapp", env) as app:
        worker = Worker("recorded_wfapp", worker_env, tmp_path / "worker.log", ("-c", "1", "-Q", "backfill", "-n", "tf@%h"), cwd=app_dir)  # fmt: skip
        try:
            worker.wait_ready()
            run = app.backfill.start(41)
            assert run.result(timeout=30) == 42
            assert run.view().queue == "backfill"

            app.wf.route("sleeper", "backfill")
            try:
                sleeping = app.sleeper.start(3600.0)
            finally:
                app.wf.routes.pop("sleeper", None)

            def the_schedule() -> dict[str, Any] | None:
                found = scheduler.list_schedules(GroupName=NAME).get("Schedules", [])
                return scheduler.get_schedule(Name=found[0]["Name"], GroupName=NAME) if found else None

            schedule = wait_for(the_schedule, 30, lambda: worker.log.read_text()[-3000:])
            assert schedule["Name"].startswith("celery-workflow-")
            assert schedule["Target"]["Arn"] == main["queues"]["backfill"]["arn"]
            assert schedule["Target"]["RoleArn"] == main["scheduler_role_arn"]
            sleeping.cancel()
            wait_for(lambda: sleeping.status == "cancelled", 30)
        finally:
            worker.stop()

    sent = {c["queue_url"] for c in client_calls if c["operation"] == "SendMessage"}
    assert sent == {backfill_url}  # the client published both runs' first deliveries to the backfill queue
    recorded = read_calls(worker_calls)
    received = {c["queue_url"] for c in recorded if c["operation"] == "ReceiveMessage"}
    assert received == {backfill_url}
    assert any(c["operation"] == "CreateSchedule" for c in recorded)

    for side, calls in (("worker", recorded), ("api", client_calls)):
        policy = main[f"{side}_policy_json"]
        requests = {pair for call in calls for pair in iam_requests(call, ACCOUNT, REGION)}
        denied = sorted(pair for pair in requests if not allowed(policy, *pair))
        assert denied == [], f"the {side} policy does not allow calls the code makes"
        assert requests, side


# -- destroy --------------------------------------------------------------------------------------------------------


def test_the_examples_resources_are_what_their_setup_commands_make(deployment: Deployment, tmp_path: Path) -> None:
    """terraform/examples/step_functions makes the Tasks table and the sample queues as `python -m examples.task_status
    setup` and `python -m examples.sqs_redrive setup` do, and attaches the examples' policy to the role it is given."""
    apps = deployment.outputs["apps"]
    env = {
        **os.environ,
        "PYTHONPATH": str(MODULE_DIR.parent),
        "CELERY_WORKFLOW_URL": f"sqlite:///{tmp_path / 'world.sqlite3'}",
        "AWS_ENDPOINT_URL": deployment.moto,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
    }

    def setup(example: str, *args: str, **extra: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", f"examples.{example}", "setup", *args],
            env={**env, **extra}, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        return done.stdout

    dynamodb, sqs = deployment.client("dynamodb"), deployment.client("sqs")
    setup("task_status", TASKS_TABLE="setup-Tasks")

    def shape(name: str) -> tuple[Any, ...]:
        table = dynamodb.describe_table(TableName=name)["Table"]
        attributes = sorted(table["AttributeDefinitions"], key=lambda a: a["AttributeName"])
        return table["KeySchema"], attributes, table["BillingModeSummary"]["BillingMode"]

    assert shape(apps["tasks_table"]) == shape("setup-Tasks")
    assert shape("cwtf-Tasks")[0] == [
        {"AttributeName": "taskId", "KeyType": "HASH"},
        {"AttributeName": "timestamp", "KeyType": "RANGE"},
    ]

    made = json.loads(setup("sqs_redrive", "--name", "setup-sample"))

    def queue(url: str) -> dict[str, Any]:
        attributes = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
        policy = json.loads(attributes["RedrivePolicy"])
        dlq_name = policy["deadLetterTargetArn"].rsplit(":", 1)[-1]
        return {
            "maxReceiveCount": int(policy["maxReceiveCount"]),
            "VisibilityTimeout": attributes["VisibilityTimeout"],
            "dlq": dlq_name.removeprefix(attributes["QueueArn"].rsplit(":", 1)[-1]),
        }

    assert queue(apps["sample_queue_url"]) == queue(made["queueUrl"]) == {
        "maxReceiveCount": 3, "VisibilityTimeout": "30", "dlq": "-dlq",
    }  # fmt: skip
    assert apps["dead_letter_queue_arn"] == arn("sqs", "cwtf-sample-dlq")
    iam = deployment.client("iam")
    attached = iam.list_attached_role_policies(RoleName="cwtf-examples-role")["AttachedPolicies"]
    assert [p["PolicyArn"] for p in attached] == [apps["policy_arn"]]


def test_the_tick_schedule_invokes_only_the_tick_function_every_minute(deployment: Deployment) -> None:
    assert deployment.workflow["tick_schedule_arn"] is None and deployment.workflow["tick_role_arn"] is None
    role_arn = f"arn:aws:iam::{ACCOUNT}:role/{PLAIN}-tick"
    assert deployment.plain["tick_role_arn"] == role_arn
    assert deployment.plain["tick_schedule_arn"] == arn("scheduler", f"schedule/default/{PLAIN}-tick")
    schedule = deployment.client("scheduler").get_schedule(Name=f"{PLAIN}-tick", GroupName="default")
    assert schedule["ScheduleExpression"] == "rate(1 minute)"
    assert schedule["FlexibleTimeWindow"] == {"Mode": "OFF"}
    assert schedule["State"] == "ENABLED"
    target = schedule["Target"]
    assert (target["Arn"], target["RoleArn"]) == (arn("lambda", "function:cwtf-worker"), role_arn)
    assert target["RetryPolicy"] == {"MaximumEventAgeInSeconds": 60, "MaximumRetryAttempts": 0}
    iam = deployment.client("iam")
    (name,) = iam.list_role_policies(RoleName=f"{PLAIN}-tick")["PolicyNames"]
    assert iam.list_attached_role_policies(RoleName=f"{PLAIN}-tick")["AttachedPolicies"] == []
    document = iam.get_role_policy(RoleName=f"{PLAIN}-tick", PolicyName=name)["PolicyDocument"]
    assert pairs(document) == {("lambda:InvokeFunction", arn("lambda", "function:cwtf-worker"))}
    trust = iam.get_role(RoleName=f"{PLAIN}-tick")["Role"]["AssumeRolePolicyDocument"]
    (statement,) = trust["Statement"]
    assert statement["Principal"] == {"Service": "scheduler.amazonaws.com"}
    assert statement["Condition"] == {
        "StringEquals": {"aws:SourceAccount": ACCOUNT},
        "ArnEquals": {"aws:SourceArn": arn("scheduler", "schedule-group/default")},
    }


def test_destroy_removes_everything(deployment: Deployment) -> None:
    deployment.destroy()
    dynamodb, sqs, iam = (deployment.client(s) for s in ("dynamodb", "sqs", "iam"))
    assert [t for t in dynamodb.list_tables()["TableNames"] if t.startswith("cwtf")] == []
    assert sqs.list_queues(QueueNamePrefix="cwtf").get("QueueUrls", []) == []
    assert [p for p in iam.list_policies(Scope="Local")["Policies"] if p["PolicyName"].startswith("cwtf")] == []
    assert [r for r in iam.list_roles()["Roles"] if r["RoleName"].startswith("cwtf")] == []
    groups = deployment.client("scheduler").list_schedule_groups()["ScheduleGroups"]
    assert [g for g in groups if g["Name"].startswith("cwtf")] == []
    assert deployment.client("scheduler").list_schedules(NamePrefix="cwtf")["Schedules"] == []
    assert deployment.client("lambda").list_event_source_mappings()["EventSourceMappings"] == []
