"""Terraform in the tests: the binary and its AWS provider, scratch working directories, and the AWS calls a process
makes, recorded so a test can check them against the module's IAM policies.

* :func:`terraform_binary` / :func:`plugin_dir`: ``terraform`` on the ``PATH`` and the local provider mirror
  (``TF_PLUGIN_DIR``, else the usual places such as ``/opt/tf-plugins`` or ``~/.terraform.d/plugins``): nothing is
  ever downloaded, every ``init`` runs with ``-plugin-dir``.
* :class:`Terraform`: one working directory (always a scratch copy or a root config in ``tmp_path``, never the
  repository's ``terraform/`` folder, which must stay free of ``.terraform`` and state files).
* :func:`record_boto_calls` / :func:`recording`: a botocore ``before-parameter-build`` hook on boto3's default
  session (the session ``AWSWorld.from_env`` builds its clients from) that writes what each call touches;
  :func:`iam_requests` turns a call into the (IAM action, resource ARN) pairs AWS authorizes, and
  :func:`allowed` evaluates them against a policy document.
"""

from __future__ import annotations

import fnmatch
import json
import os
import platform
import shutil
import subprocess
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
MODULE_DIR = REPO / "terraform"
PROVIDER = Path("registry.terraform.io") / "hashicorp" / "aws"
#: Terraform's working files: never copied out of (or left in) the repository's module.
WORKING_FILES = (".terraform", ".terraform.lock.hcl", "*.tfstate", "*.tfstate.*", "*.tfplan")


def moto_provider(endpoint: str, *services: str) -> str:
    """The root config's ``terraform`` and ``provider "aws"`` blocks for the moto server at ``endpoint``: test
    credentials, no validation, and the endpoints of ``services`` pointing at it (a service the config touches but
    ``services`` leaves out would reach the real AWS)."""
    width = max(len(name) for name in services)
    endpoints = "".join(f'    {name:{width}} = "{endpoint}"\n' for name in services)
    return f"""terraform {{
  required_providers {{
    aws = {{ source = "hashicorp/aws" }}
  }}
}}

provider "aws" {{
  region                      = "us-east-1"
  access_key                  = "testing"
  secret_key                  = "testing"
  skip_credentials_validation = true
  skip_metadata_api_check     = true
  skip_region_validation      = true

  endpoints {{
{endpoints}  }}
}}

"""


def terraform_binary() -> str | None:
    return shutil.which("terraform")


def _platform() -> str:
    machine = platform.machine().lower()
    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(machine, machine)
    return f"{platform.system().lower()}_{arch}"


def _has_aws_provider(folder: Path) -> bool:
    return any((folder / PROVIDER).glob(f"*/{_platform()}/terraform-provider-aws*"))


def plugin_dir() -> Path:
    """The local provider mirror holding ``hashicorp/aws`` for this platform (``TF_PLUGIN_DIR`` when set); fails the
    test with what was searched when there is none (the binary is there, so this is a broken setup, not a skip)."""
    configured = os.environ.get("TF_PLUGIN_DIR")
    if configured:
        if not _has_aws_provider(Path(configured)):
            pytest.fail(f"TF_PLUGIN_DIR={configured} holds no {PROVIDER}/<version>/{_platform()} provider")
        return Path(configured)
    home = Path.home()
    data = Path(os.environ.get("XDG_DATA_HOME") or home / ".local" / "share")
    candidates = [
        Path("/opt/tf-plugins"),
        home / ".terraform.d" / "plugins",
        data / "terraform" / "plugins",
        Path("/usr/local/share/terraform/plugins"),
        Path("/usr/share/terraform/plugins"),
    ]
    for candidate in candidates:
        if _has_aws_provider(candidate):
            return candidate
    searched = ", ".join(str(c) for c in candidates)
    pytest.fail(
        f"terraform is installed but no local mirror of the {PROVIDER} provider for {_platform()} was found "
        f"(searched {searched}); set TF_PLUGIN_DIR to a folder laid out as {PROVIDER}/<version>/{_platform()}/"
    )


def copy_module(dest: Path) -> Path:
    """A scratch copy of the repository's ``terraform/`` folder (its examples included), without working files."""
    shutil.copytree(MODULE_DIR, dest, ignore=shutil.ignore_patterns(*WORKING_FILES))
    return dest


class Terraform:
    """``terraform`` commands in one working directory, without prompts, colours or version checks."""

    def __init__(self, binary: str, plugins: Path, workdir: Path) -> None:
        self.binary = binary
        self.plugins = plugins
        self.workdir = workdir
        self.env = {**os.environ, "TF_IN_AUTOMATION": "1", "TF_INPUT": "0", "CHECKPOINT_DISABLE": "1"}
        cli_config = os.environ.get("TF_CLI_CONFIG_FILE")
        if cli_config and not Path(cli_config).exists():  # a dangling setting only makes every command warn
            empty = workdir.parent / f".{workdir.name}.terraformrc"
            empty.write_text("")
            self.env["TF_CLI_CONFIG_FILE"] = str(empty)

    def run(self, *args: str, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
        """Run ``terraform <args>``; AssertionError with its output when it fails."""
        done = subprocess.run(
            [self.binary, *args],
            cwd=self.workdir,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            raise AssertionError(
                f"terraform {' '.join(args)} failed ({done.returncode}) in {self.workdir}:\n"
                f"{done.stdout[-6000:]}\n{done.stderr[-6000:]}"
            )
        return done

    def init(self, *, backend: bool = True) -> None:
        args = ["init", "-no-color", "-input=false", f"-plugin-dir={self.plugins}"]
        self.run(*args, *([] if backend else ["-backend=false"]))

    def validate(self) -> dict[str, Any]:
        return dict(json.loads(self.run("validate", "-json", "-no-color").stdout))

    def apply(self, *extra: str) -> None:
        self.run("apply", "-auto-approve", "-no-color", "-input=false", "-parallelism=30", *extra, timeout=600)

    def destroy(self) -> None:
        # No refresh: the state is this run's own, and refreshing every resource costs the provider many seconds.
        self.run("destroy", "-auto-approve", "-no-color", "-input=false", "-parallelism=30", "-refresh=false",
                 timeout=600)  # fmt: skip

    def outputs(self) -> dict[str, Any]:
        raw = json.loads(self.run("output", "-json", "-no-color").stdout)
        return {name: value["value"] for name, value in raw.items()}


# -- the AWS calls a process makes ----------------------------------------------------------------------------------


def _summary(service: str, operation: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """What a call touches, as JSON (no item values): tables and the item action on each, queue URLs, schedules and
    the role a schedule names."""
    found: dict[str, Any] = {"service": service, "operation": operation}
    if "TableName" in params:
        found["table"] = params["TableName"]
    if "IndexName" in params:
        found["index"] = params["IndexName"]
    if "RequestItems" in params:
        found["tables"] = sorted(params["RequestItems"])
    if "TransactItems" in params:
        found["items"] = [
            [kind, action["TableName"]] for entry in params["TransactItems"] for kind, action in entry.items()
        ]
    if "QueueUrl" in params:
        found["queue_url"] = params["QueueUrl"]
    if service == "scheduler":
        found["group"] = params.get("GroupName") or "default"
        found["name"] = params.get("Name")
        role = (params.get("Target") or {}).get("RoleArn")
        if role:
            found["role_arn"] = role
    return found


def _service_of(event_name: str) -> tuple[str, str]:
    _, service, operation = event_name.split(".", 2)
    return service, operation


def record_boto_calls(path: str | os.PathLike[str]) -> None:
    """Append a JSON line per AWS call of this process (and its forked children) to ``path``: a hook on boto3's
    default session, so install it before the clients are made."""
    import boto3

    lock = threading.Lock()

    def hook(event_name: str, params: Mapping[str, Any], **_: Any) -> None:
        line = json.dumps(_summary(*_service_of(event_name), params))
        with lock, open(path, "a", encoding="utf-8") as out:
            out.write(line + "\n")

    boto3._get_default_session().events.register("before-parameter-build", hook)


def read_calls(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@contextmanager
def recording() -> Iterator[list[dict[str, Any]]]:
    """The AWS calls this process makes through boto3's default session while the block runs."""
    import boto3

    calls: list[dict[str, Any]] = []

    def hook(event_name: str, params: Mapping[str, Any], **_: Any) -> None:
        calls.append(_summary(*_service_of(event_name), params))

    events = boto3._get_default_session().events
    events.register("before-parameter-build", hook, unique_id="celery-workflow-terraform-test")
    try:
        yield calls
    finally:
        events.unregister("before-parameter-build", hook, unique_id="celery-workflow-terraform-test")


#: The item action IAM authorizes for each action of a transaction.
TRANSACT_ACTIONS = {"Put": "PutItem", "Update": "UpdateItem", "Delete": "DeleteItem", "Get": "GetItem",
                    "ConditionCheck": "ConditionCheckItem"}  # fmt: skip


def iam_requests(call: Mapping[str, Any], account: str, region: str) -> list[tuple[str, str]]:
    """The (action, resource ARN) pairs IAM authorizes for one recorded call."""

    def table(name: str) -> str:
        return f"arn:aws:dynamodb:{region}:{account}:table/{name}"

    service, operation = call["service"], call["operation"]
    if service == "dynamodb":
        if "items" in call:
            return [(f"dynamodb:{TRANSACT_ACTIONS[kind]}", table(name)) for kind, name in call["items"]]
        if "tables" in call:
            return [(f"dynamodb:{operation}", table(name)) for name in call["tables"]]
        arn = table(call["table"])
        if call.get("index"):
            arn += f"/index/{call['index']}"
        return [(f"dynamodb:{operation}", arn)]
    if service == "sqs":
        name = call["queue_url"].rstrip("/").rsplit("/", 1)[-1]
        action = {"SendMessageBatch": "SendMessage", "DeleteMessageBatch": "DeleteMessage",
                  "ChangeMessageVisibilityBatch": "ChangeMessageVisibility"}.get(operation, operation)  # fmt: skip
        return [(f"sqs:{action}", f"arn:aws:sqs:{region}:{account}:{name}")]
    if service == "scheduler":
        pairs = [
            (f"scheduler:{operation}", f"arn:aws:scheduler:{region}:{account}:schedule/{call['group']}/{call['name']}")
        ]
        if call.get("role_arn"):
            pairs.append(("iam:PassRole", call["role_arn"]))
        return pairs
    if service == "sts" and operation == "GetCallerIdentity":
        return []  # needs no permission
    return [(f"{service}:{operation}", "*")]


def _listed(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def statements(policy: Mapping[str, Any] | str) -> list[dict[str, Any]]:
    document = json.loads(policy) if isinstance(policy, str) else policy
    return [dict(s) for s in _listed(document["Statement"])]  # type: ignore[arg-type]


def pairs(policy: Mapping[str, Any] | str) -> set[tuple[str, str]]:
    """Every (action, resource) an Allow statement names."""
    found = set()
    for statement in statements(policy):
        assert statement["Effect"] == "Allow", statement
        for action in _listed(statement["Action"]):
            for resource in _listed(statement["Resource"]):
                found.add((action, resource))
    return found


def allowed(policy: Mapping[str, Any] | str, action: str, resource: str) -> bool:
    """Whether an Allow statement of ``policy`` matches ``action`` on ``resource`` (wildcards as IAM reads them;
    conditions are not evaluated)."""
    return any(
        fnmatch.fnmatchcase(action.lower(), pattern_action.lower()) and fnmatch.fnmatchcase(resource, pattern)
        for statement in statements(policy)
        if statement["Effect"] == "Allow"
        for pattern_action in _listed(statement["Action"])
        for pattern in _listed(statement["Resource"])
    )
