"""The documentation site: it builds with ``mkdocs build --strict`` (offline, no warnings), its API reference shows
the public names, and the quickstart's marked code runs as written on a real ``celery worker``.

The quickstart marks its code with HTML comments: ``<!-- quickstart:file NAME -->`` before a block saved as
``NAME``, ``<!-- quickstart:shell -->`` before the worker command, ``<!-- quickstart:python -->`` before the blocks run
in order in one interpreter (in the directory of the file and the worker). Before a block that resumes a hook, the
test waits until the run has created it, as the page tells the reader to.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml  # type: ignore[import-untyped]  # no stubs in the test extra

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "docs" / "quickstart.md"
MARKED = re.compile(
    r"^<!-- quickstart:(?P<kind>file|shell|python)(?: (?P<arg>\S+))? -->\n```(?P<lang>\w+)\n(?P<code>.*?)^```$",
    re.S | re.M,
)
BUILD_ENV = {"NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's end-of-life banner on stderr (not a build warning)

#: What the API reference must show: (page, ids of documented objects).
REFERENCE = {
    "reference/index.html": [
        "celery_workflow.Workflows",
        "celery_workflow.Workflows.resume_hook",
        "celery_workflow.Workflow.start",
        "celery_workflow.Step",
        "celery_workflow.create_hook",
        "celery_workflow.sleep",
        "celery_workflow.get_writable",
        "celery_workflow.step_metadata",
        "celery_workflow.gather",
        "celery_workflow.Hook",
    ],
    "reference/client/index.html": ["celery_workflow.client.Run.result", "celery_workflow.client.HTTPClient"],
    "reference/errors/index.html": ["celery_workflow.errors.RetryableError", "celery_workflow.errors.StepFailed"],
    "reference/api/index.html": ["celery_workflow.api.rpc_blueprint", "celery_workflow.api.webhook_blueprint"],
    "reference/rpc/index.html": ["celery_workflow.rpc.run_json", "celery_workflow.rpc.StartParams"],
    "reference/world/index.html": ["celery_workflow.world.World", "celery_workflow.world.open_world"],
    "reference/events/index.html": ["celery_workflow.events.EventType", "celery_workflow.events.RunStatus"],
    "reference/rules/index.html": ["celery_workflow.rules.plan_append", "celery_workflow.rules.Snapshot"],
    "reference/testing/index.html": ["celery_workflow.testing.LocalWorker", "celery_workflow.testing.replay_history"],
}


@dataclass(frozen=True)
class Block:
    kind: str
    arg: str | None
    code: str


def quickstart_blocks() -> list[Block]:
    return [Block(m["kind"], m["arg"], m["code"]) for m in MARKED.finditer(QUICKSTART.read_text())]


def test_site_builds_strict_and_offline(tmp_path: Path) -> None:
    # nothing that makes a build (or a page view) reach the network: remote inventories, material's social cards
    # and privacy plugin (they download), web fonts
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    plugins = {next(iter(p)) if isinstance(p, dict) else p: p for p in config["plugins"]}
    assert not {"social", "privacy", "material/social", "material/privacy"} & set(plugins)
    python = plugins["mkdocstrings"]["mkdocstrings"]["handlers"]["python"]
    assert "inventories" not in python and "import" not in python
    assert config["theme"]["font"] is False
    site = tmp_path / "site"
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", "mkdocs.yml", "-d", str(site)],
        cwd=ROOT,
        env={**os.environ, **BUILD_ENV},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{output}"
    assert not re.findall(r"^(?:WARNING|ERROR)\b.*$", output, re.M), output
    assert time.monotonic() - started < 60, "the docs build should take seconds"
    for page, names in REFERENCE.items():
        html = (site / page).read_text()
        missing = [name for name in names if f'id="{name}"' not in html]
        assert not missing, f"{page} does not document {missing}"
    assert (site / "design-notes" / "index.html").exists()
    assert not (site / "_ext").exists(), "the Griffe extension is build code, not a page"


def test_quickstart_blocks_are_marked_and_compile() -> None:
    blocks = quickstart_blocks()
    assert [b.kind for b in blocks] == ["file", "shell", "python", "python"], blocks
    for block in blocks:
        if block.kind != "shell":
            compile(block.code, f"{QUICKSTART.name}:{block.kind}", "exec")


#: The pages whose code this change owns (design-notes.md and adding-a-world.md are kept by others).
GUIDES = [
    "index.md",
    "quickstart.md",
    "concepts.md",
    "cli.md",
    "comparison.md",
    "workflow-changes.md",
    "coming-from-celery.md",
    *(f"deploy/{p.name}" for p in sorted((ROOT / "docs" / "deploy").glob("*.md"))),
]
FENCE = re.compile(r"^```python\n(?P<code>.*?)^```$", re.S | re.M)


@pytest.mark.parametrize("page", GUIDES)
def test_guide_code_compiles_and_imports_real_names(page: str) -> None:
    """Every Python block of the guides is valid Python, and every name it imports from celery_workflow exists."""
    for number, match in enumerate(FENCE.finditer((ROOT / "docs" / page).read_text()), start=1):
        tree = ast.parse(match["code"], f"{page} block {number}")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("celery_workflow"):
                module = importlib.import_module(node.module)
                missing = [a.name for a in node.names if not hasattr(module, a.name)]
                assert not missing, f"{page} block {number}: {node.module} has no {missing}"


CLIENT = """
import json, re, sys, time
from celery_workflow import HookNotFound

namespace = {"__name__": "__main__"}
for code in json.loads(sys.argv[1]):
    for token in re.findall(r'resume_hook\\("([^"]+)"', code):  # the page: resume it once the run waits on it
        deadline = time.monotonic() + 30
        while True:
            try:
                namespace["wf"].world.get_hook_by_token(token)
                break
            except HookNotFound:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    exec(compile(code, "quickstart.md", "exec"), namespace)
run = namespace["run"]
print("RESULT " + json.dumps({
    "result": namespace["result"],
    "progress": namespace["progress"],
    "events": [[e.event_type.value, e.correlation_id] for e in run.events()],
}))
"""


@pytest.fixture
def worker_dir(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    """The quickstart's directory: its file written, its worker command running there."""
    blocks = quickstart_blocks()
    env = {k: v for k, v in os.environ.items() if k != "CELERY_WORKFLOW_URL"}  # the embedded default, in cwd
    for block in blocks:
        if block.kind == "file":
            assert block.arg
            (tmp_path / block.arg).write_text(block.code)
    (command,) = [shlex.split(b.code, comments=True) for b in blocks if b.kind == "shell"]
    assert command[:2] == ["celery", "-A"] and "worker" in command, command
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", *command, "--without-heartbeat"],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 30
        while b"ready." not in log.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the quickstart's worker did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.05)
        yield tmp_path, env
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)


@pytest.mark.acceptance
def test_quickstart_runs_as_written(worker_dir: tuple[Path, dict[str, str]]) -> None:
    cwd, env = worker_dir
    code = [b.code for b in quickstart_blocks() if b.kind == "python"]
    done = subprocess.run(
        [sys.executable, "-c", CLIENT, json.dumps(code)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    log = (cwd / "worker.log").read_text()[-3000:]
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n--- worker log ---\n{log}"
    report = json.loads(done.stdout.rsplit("RESULT ", 1)[1])
    # what the page prints
    assert report["result"] == {"status": "shipped", "receipt": "rcpt-o-1", "tracking": "trk-o-1"}
    assert report["progress"] == [{"stage": "shipped"}]
    assert "{'status': 'shipped', 'receipt': 'rcpt-o-1', 'tracking': 'trk-o-1'}\ncompleted\n" in done.stdout
    # the event log the page's "What happened" spells out
    assert report["events"] == [
        ["run_created", None],
        ["run_started", None],
        ["step_created", "step:charge:1"],
        ["step_started", "step:charge:1"],
        ["step_retrying", "step:charge:1"],
        ["step_started", "step:charge:1"],
        ["step_completed", "step:charge:1"],
        ["hook_created", "hook:1"],
        ["hook_received", "hook:1"],
        ["wait_created", "wait:1"],
        ["wait_completed", "wait:1"],
        ["step_created", "step:ship:1"],
        ["step_started", "step:ship:1"],
        ["step_completed", "step:ship:1"],
        ["run_completed", None],
    ]
