"""The HTTP edges with a real HTTP server on loopback and a real Celery worker (SQLite World)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from werkzeug.serving import make_server

from celery_workflow import RunNotFound, WorkflowNotFound
from celery_workflow.client import HTTPClient
from celery_workflow.errors import HookNotFound

from .workers import Worker, free_port, imported_app

pytestmark = pytest.mark.acceptance


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("http")
    (base / "markers").mkdir()
    port = free_port()
    return {
        "CELERY_WORKFLOW_URL": f"sqlite:///{base / 'world.sqlite3'}",
        "CW_MARKERS": str(base / "markers"),
        "CW_BASE_URL": f"http://127.0.0.1:{port}/v1/workflow",
        "CW_PORT": str(port),
    }


@pytest.fixture(scope="module")
def app(env: dict[str, str]) -> Iterator[ModuleType]:
    with imported_app("httpapp", env) as module:
        yield module


@pytest.fixture(scope="module")
def server(app: ModuleType, env: dict[str, str]) -> Iterator[str]:
    srv = make_server("127.0.0.1", int(env["CW_PORT"]), app.create_app(), threaded=True)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield env["CW_BASE_URL"]
    srv.shutdown()
    thread.join(timeout=5)


@pytest.fixture(scope="module")
def worker(app: ModuleType, env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    w = Worker("httpapp", env, tmp_path_factory.mktemp("logs") / "http-worker.log", ["-c", "2"])
    w.wait_ready()
    yield w
    w.stop()


@pytest.fixture
def client(server: str) -> HTTPClient:
    return HTTPClient(server, timeout=30)


def wait_for_file(path: Path, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)
    return path.read_text()


def send(
    url: str, method: str = "POST", body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_run_started_over_http_completes(client: HTTPClient, worker: Worker) -> None:
    run = client.start("adder", 20, 22)
    assert run.result(timeout=30) == 42
    assert run.status == "completed"
    assert [e["event_type"] for e in run.events()][-1] == "run_completed"
    assert run.steps()[0]["step_name"] == "add"
    assert run.id in [r.id for r in client.list_runs(workflow="adder")]
    again = client.start("adder", 20, 22, run_id=run.id)
    assert again.id == run.id


def test_errors_come_back_typed(client: HTTPClient, worker: Worker) -> None:
    with pytest.raises(WorkflowNotFound):
        client.start("no_such_workflow")
    with pytest.raises(RunNotFound):
        client.get_run("wrun_missing")
    with pytest.raises(HookNotFound):
        client.resume_hook("no-such-token", 1)


def test_stream_is_read_over_http_while_it_is_written(client: HTTPClient, worker: Worker, env: dict[str, str]) -> None:
    run = client.start("ticks", 3)
    seen: list[Any] = []
    for value in run.stream("ticks", timeout=60):
        seen.append(value)
        if isinstance(value, dict):  # the step waits for this before writing the next value
            Path(env["CW_MARKERS"], f"http-tick-{run.id}-{value['tick']}").touch()
    assert seen == [{"tick": 0}, {"tick": 1}, {"tick": 2}, b"\x00\x01"]
    run.result(timeout=30)


def test_webhook_default_answers_202_and_resumes_the_run(
    client: HTTPClient, worker: Worker, env: dict[str, str]
) -> None:
    run = client.start("accepts_webhook")
    url = wait_for_file(Path(env["CW_MARKERS"], f"webhook-url-{run.id}"))
    assert url.startswith(env["CW_BASE_URL"] + "/webhooks/")
    status, _, body = send(url + "?source=test", "POST", b'{"order": 7}', {"content-type": "application/json"})
    assert status == 202, body
    assert run.result(timeout=30) == {"method": "POST", "json": {"order": 7}, "query": "source=test"}
    status, _, body = send(url, "POST", b"{}")  # the hook is gone with its run
    assert status == 404 and json.loads(body)["error"]["code"] == "hook_not_found"


def test_webhook_fixed_response(client: HTTPClient, worker: Worker, env: dict[str, str]) -> None:
    run = client.start("fixed_webhook")
    url = wait_for_file(Path(env["CW_MARKERS"], f"webhook-url-{run.id}"))
    status, headers, body = send(url, "PUT", b"payload")
    assert status == 201 and headers.get("x-fixed") == "yes" and json.loads(body) == {"ok": True}
    assert run.result(timeout=30) == "payload"


def test_webhook_response_produced_by_a_step(client: HTTPClient, worker: Worker, env: dict[str, str]) -> None:
    run = client.start("manual_webhook")
    url = wait_for_file(Path(env["CW_MARKERS"], f"webhook-url-{run.id}"))
    status, headers, body = send(url, "POST", b'{"n": 21}', {"content-type": "application/json"})
    assert status == 200, body
    assert headers.get("x-answered-by") == "step"
    assert json.loads(body) == {"echo": {"n": 21}, "doubled": 42}
    assert run.result(timeout=30) == 21


def test_plain_hooks_are_not_reachable_as_webhooks(app: ModuleType, server: str) -> None:
    status, _, _ = send(f"{server}/webhooks/not-a-webhook", "POST", b"{}")
    assert status == 404


def test_rpc_answers_405_json_for_get(server: str) -> None:
    status, headers, body = send(f"{server}/rpc", "GET")
    assert status == 405 and headers.get("Allow") == "POST"
    assert json.loads(body)["error"]["code"] == "method_not_allowed"
