"""docker-compose.yml is valid (Debian's `docker-compose config`, which needs no Docker daemon) and its example
workers run what the README documents and the acceptance tests run: the same `celery -A examples.<name> worker`
commands, setup commands and environment variables, pointed at the file's own services."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
WORKERS = {  # service -> (example module, the acceptance test that runs its worker, or None)
    "worker-shop": ("examples.shop", None),
    "worker-task-status": ("examples.task_status", "test_example_task_status.py"),
    "worker-sqs-redrive": ("examples.sqs_redrive", "test_example_sqs_redrive.py"),
}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (.ci/run installs Debian's docker-compose package)")
    done = subprocess.run(
        [binary, "-f", str(ROOT / "docker-compose.yml"), "config"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    config: dict[str, Any] = yaml.safe_load(done.stdout)
    return config


def commands_of(service: dict[str, Any]) -> list[list[str]]:
    """The service's command as the shell commands it chains (``sh -c "a && b"`` -> [a, b])."""
    command = service["command"]
    words = shlex.split(command) if isinstance(command, str) else list(command)
    if words[:2] == ["sh", "-c"]:
        return [shlex.split(part) for part in words[2].split("&&")]
    return [words]


def port_of(service: dict[str, Any]) -> int:
    return int(service["ports"][0]["target"])


def test_the_file_is_valid_and_has_the_services(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == {"postgres", "redis", "aws", "sqs-move-tasks", *WORKERS}


def test_workers_run_the_commands_the_readme_and_the_tests_use(compose: dict[str, Any]) -> None:
    for name, (module, acceptance) in WORKERS.items():
        service = compose["services"][name]
        *setup, worker = commands_of(service)
        assert worker[:4] == ["celery", "-A", module, "worker"], name
        readme_worker = " ".join(w for w in worker if not w.startswith("--loglevel"))
        assert readme_worker in README, f"the README does not give {readme_worker!r}"
        for command in setup:
            assert command[:3] == ["python", "-m", module], name
            assert " ".join(command) in README, f"the README does not give {' '.join(command)!r}"
        if acceptance is not None:
            source = (ROOT / "tests" / "acceptance" / acceptance).read_text()
            assert re.search(rf'^(EXAMPLE|MODULE) = "{re.escape(module)}"$', source, re.M), acceptance
            assert "Worker(" in source
            for command in setup:  # the tests run the setup command too
                assert f'"{command[3]}"' in source, f"{acceptance} does not run {command[3]!r}"


def test_worker_environments_point_at_the_services_and_match_the_tests(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, (module, acceptance) in WORKERS.items():
        env: dict[str, str] = services[name]["environment"]
        world = urlsplit(env["CELERY_WORKFLOW_URL"])
        assert world.scheme == "postgresql" and world.hostname == "postgres", name
        assert world.port == port_of(services["postgres"])
        for key in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_SQS"):
            if key in env:
                endpoint = urlsplit(env[key])
                assert endpoint.hostname in services, f"{name}: {key} names no service"
                assert endpoint.port == port_of(services[str(endpoint.hostname)]), f"{name}: {key}"
        if acceptance is None:
            continue
        source = (ROOT / "tests" / "acceptance" / acceptance).read_text()
        tested = set(re.findall(r'"([A-Z][A-Z0-9_]+)":', source))
        missing = set(env) - tested
        assert not missing, f"{name} sets {sorted(missing)}, which {acceptance} never sets"
        for key in env:  # and the example (or boto3, or celery_workflow) reads each
            assert (
                key.startswith(("AWS_", "CELERY_WORKFLOW_URL"))
                or key in (ROOT / Path(*module.split("."))).with_suffix(".py").read_text()
            ), f"{module} does not read {key}"


def test_the_move_task_stand_in_fronts_the_emulator(compose: dict[str, Any]) -> None:
    services = compose["services"]
    command = commands_of(services["sqs-move-tasks"])[0]
    assert command[:3] == ["python", "-m", "tools.move_tasks"]
    upstream = urlsplit(command[command.index("--upstream") + 1])
    assert upstream.hostname == "aws" and upstream.port == port_of(services["aws"])
    assert int(command[command.index("--port") + 1]) == port_of(services["sqs-move-tasks"])
    assert services["aws"]["environment"]["MOTO_PORT"] == str(port_of(services["aws"]))
