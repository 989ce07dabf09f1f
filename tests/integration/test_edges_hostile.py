"""The HTTP edges against hostile and careless callers (issue #26, items 3, 10, 11, 12, 15 and 20), through Flask's
test client on SQLite Worlds in a temporary directory (and Postgres, each test its own schema, where the World's own
text handling matters):

* 3: RPC ``start`` with a run id that exists answers only what a start answers (id, workflow, status), and another
  workflow or other arguments for that id is a 409 that names neither;
* 10: manual webhook responses (``request.respond``) are checked like fixed ones: a header name or value that would
  split the response, a status outside 200-599 or a framing header gets the caller a generic 500, never the response;
  a str body is ``text/plain``;
* 11: a lone surrogate in ``list_runs``' ``cursor`` or ``workflow`` is a 400, not a 500;
* 12: hook tokens in event data (``hook_created``, ``hook_conflict``, ``hook_disposed``) are hidden in the RPC's,
  the inspector's and the command line's JSON views unless the caller may reveal them;
* 15: a webhook body of exactly the advertised size (:func:`celery_workflow.api.default_max_body`) is accepted, one
  byte more is 413, whether it is binary or text;
* 20: the inspector shows the queue a step is routed to, not the run's.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner
from flask import Flask
from flask.testing import FlaskClient

from celery_workflow import WebhookRequest, Workflows, create_hook, create_webhook
from celery_workflow.api import default_max_body, webhook_blueprint
from celery_workflow.cli import workflow as cli_group
from celery_workflow.errors import CeleryWorkflowError
from celery_workflow.events import EventType, NewEvent
from celery_workflow.inspector import blueprint as inspector_blueprint
from celery_workflow.testing import LocalWorker
from celery_workflow.world_sqlite import SQLiteWorld

PREFIX = "/v1/workflow"
TOKEN = "secret-hook-token-9f3a"

#: Manual responses a step gives, each malformed (a workflow picks one by index).
BAD_RESPONSES: list[dict[str, Any]] = [
    {"body": "hi", "headers": {"X-A\r\nSet-Cookie: evil=1": "v"}},
    {"body": "hi", "headers": {"X-A": "v\r\nSet-Cookie: evil=1"}},
    {"body": "hi", "headers": {"X-A": "v\x00w"}},
    {"body": "hi", "headers": {"X A": "v"}},
    {"body": "hi", "status": 0},
    {"body": "hi", "status": 99},
    {"body": "hi", "status": 101},
    {"body": "hi", "status": 1000},
    {"body": "hi", "status": 99999},
    {"body": "hello", "headers": {"Content-Length": "1"}},
    {"body": "hello", "headers": {"transfer-encoding": "chunked"}},
]


def make_wf(world: Any) -> Workflows:
    wf = Workflows(Celery("hostile"), world=world, broker="app", base_url="https://x.test/wf", queues=["packing"])

    @wf.workflow
    def echo(x: int) -> int:
        return x

    @wf.workflow
    def other(x: int) -> int:
        return -x

    @wf.step(max_retries=0)
    def answer(request: WebhookRequest, case: int) -> None:
        if case < 0:
            request.respond("plain words", status=201)
        else:
            request.respond(**BAD_RESPONSES[case])

    @wf.workflow
    def manual(token: str, case: int) -> str:
        request = create_webhook(token=token, respond_with="manual").wait()
        answer(request, case)
        return "answered"

    @wf.workflow
    def body_size(token: str) -> int:
        return len(create_webhook(token=token).wait().body)

    @wf.workflow
    def fixed(token: str, spec: dict[str, Any]) -> str:
        try:
            hook = create_webhook(token=token, respond_with=spec)
        except CeleryWorkflowError as exc:
            return type(exc).__name__
        return hook.wait().text()

    @wf.workflow
    def hooked() -> Any:
        return create_hook(token=TOKEN).wait()

    @wf.step(queue="packing")
    def pack(n: int) -> int:
        return n + 1

    @wf.step
    def label(n: int) -> int:
        return n * 2

    @wf.workflow
    def shipping(n: int) -> int:
        return label(pack(n))

    return wf


@pytest.fixture
def wf(tmp_path: Path) -> Iterator[Workflows]:
    workflows = make_wf(SQLiteWorld(tmp_path / "world.db"))
    yield workflows
    workflows.close()


@pytest.fixture(params=["sqlite", "postgres"])
def any_wf(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Workflows]:
    with ExitStack() as stack:
        world: Any
        if request.param == "sqlite":
            world = SQLiteWorld(tmp_path / "world.db")
        else:
            from celery_workflow.world_pg import PostgresWorld
            from tests.integration import pg_fixtures  # skips this case when PostgreSQL is unreachable

            schema = stack.enter_context(pg_fixtures.fresh_schema("cw_hostile"))
            world = PostgresWorld.open(pg_fixtures.schema_url(schema))
        workflows = make_wf(world)
        stack.callback(workflows.close)
        yield workflows


@pytest.fixture
def worker(wf: Workflows) -> LocalWorker:
    return LocalWorker(wf)


def http(wf: Workflows, **options: Any) -> FlaskClient:
    app = Flask("hostile")
    app.register_blueprint(wf.blueprint(**options), url_prefix=PREFIX)
    return app.test_client()


def rpc(client: FlaskClient, method: str, **params: Any) -> tuple[int, Any]:
    resp = client.post(f"{PREFIX}/rpc", data=json.dumps({"method": method, "params": params}),
                       content_type="application/json")  # fmt: skip
    return resp.status_code, resp.get_json()


# -- 3. start with an existing run id ----------------------------------------------------------------------------------


def test_start_with_an_existing_id_answers_only_what_a_start_answers(any_wf: Workflows) -> None:
    starter = http(any_wf, authorize=lambda request, method: method == "start")
    status, body = rpc(starter, "start", workflow="echo", args=[41], run_id="order-7")
    assert status == 200 and body["result"]["created"] is True
    assert body["result"]["run"] == {"run_id": "order-7", "workflow_name": "echo", "status": "pending"}
    LocalWorker(any_wf).run_until_idle()
    assert any_wf.world.get_run("order-7").output == 41

    status, body = rpc(starter, "start", workflow="echo", args=[41], run_id="order-7")  # the same start again
    assert status == 200 and body["result"]["created"] is False
    assert body["result"]["run"] == {"run_id": "order-7", "workflow_name": "echo", "status": "completed"}
    assert "41" not in json.dumps(body)  # neither the input nor the output


@pytest.mark.parametrize(
    ("workflow", "args"), [("echo", [42]), ("other", [41]), ("other", [42])], ids=["args", "workflow", "both"]
)
def test_start_with_an_existing_id_and_other_arguments_is_a_conflict_that_reveals_nothing(
    any_wf: Workflows, workflow: str, args: list[int]
) -> None:
    any_wf.start("echo", 41, run_id="order-8")
    starter = http(any_wf, authorize=lambda request, method: method == "start")
    status, body = rpc(starter, "start", workflow=workflow, args=args, run_id="order-8")
    assert status == 409 and body["error"]["code"] == "conflict", body
    text = json.dumps(body)
    assert "41" not in text and "echo" not in text, text  # the other run's input and workflow stay unknown
    assert any_wf.world.get_run("order-8").input == {"args": [41], "kwargs": {}}  # and it is untouched


# -- 10. manual webhook responses --------------------------------------------------------------------------------------


def answered(wf: Workflows, worker: LocalWorker, case: int) -> Any:
    """Start ``manual`` with this case, post to its webhook while the worker runs the step; the caller's response."""
    token = f"manual-{case}"
    run = wf.start("manual", token, case)
    worker.run_until_idle()
    app = Flask("manual")
    app.register_blueprint(webhook_blueprint(wf, response_timeout=20), url_prefix=PREFIX)
    client = app.test_client()
    got: list[Any] = []
    poster = threading.Thread(target=lambda: got.append(client.post(f"{PREFIX}/webhooks/{token}", data=b"{}")))
    poster.start()
    worker.run_until(lambda: run.status.terminal, timeout=20)
    poster.join(25)
    assert got, "the webhook caller got no answer"
    return got[0]


@pytest.mark.parametrize("case", range(len(BAD_RESPONSES)))
def test_a_malformed_manual_response_is_a_generic_500_never_sent(wf: Workflows, worker: LocalWorker, case: int) -> None:
    resp = answered(wf, worker, case)
    assert resp.status_code == 500, (resp.status_code, dict(resp.headers))
    assert resp.get_json()["error"]["code"] == "invalid_response"
    assert "evil" not in str(resp.headers) and "Set-Cookie" not in resp.headers
    for name, value in resp.headers.items():
        assert not set("\r\n\x00") & set(name + value)
    assert resp.headers["Content-Length"] == str(len(resp.get_data()))
    (step,) = wf.world.list_steps(wf.world.list_runs(workflow="manual").items[0].run_id)
    assert step.status.value == "failed" and step.error is not None
    assert step.error["type"].endswith("InvalidWebhookResponse")  # the step that gave it learns why
    assert step.attempt == 1  # not retried: the caller has had its 500


def test_a_manual_str_body_is_plain_text(wf: Workflows, worker: LocalWorker) -> None:
    resp = answered(wf, worker, -1)
    assert resp.status_code == 201 and resp.get_data() == b"plain words"
    assert resp.headers["Content-Type"] == "text/plain; charset=utf-8"


def test_a_fixed_str_body_is_plain_text_and_framing_headers_are_refused(wf: Workflows, worker: LocalWorker) -> None:
    run = wf.start("fixed", "fixed-text", {"status": 200, "body": "thanks"})
    worker.run_until_idle()
    resp = http(wf).post(f"{PREFIX}/webhooks/fixed-text", data=b"hello")
    assert resp.status_code == 200 and resp.get_data() == b"thanks"
    assert resp.headers["Content-Type"] == "text/plain; charset=utf-8"
    worker.run_until_complete(run)
    for spec in ({"headers": {"Content-Length": "1"}}, {"headers": {"X-A": "a\x00b"}}, {"status": 101}):
        refused = wf.start("fixed", "fixed-bad", spec)
        worker.run_until_complete(refused)
        assert refused.result() == "InvalidWebhookResponse", spec


# -- 11. lone surrogates in list_runs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["cursor", "workflow"])
def test_a_lone_surrogate_in_list_runs_is_400(any_wf: Workflows, field: str) -> None:
    any_wf.start("echo", 1)
    status, body = rpc(http(any_wf), "list_runs", **{field: "\ud800"})
    assert status == 400 and body["error"]["code"] == "invalid_params", body
    assert body["error"]["details"][0]["loc"] == [field]
    status, body = rpc(http(any_wf), "list_runs", **{field: "a\udc80b"})
    assert status == 400
    status, body = rpc(http(any_wf), "list_runs", cursor="no listing returned this")
    assert status == 400 and body["error"]["code"] == "invalid_params", body
    # the inspector's query strings are decoded by werkzeug (undecodable bytes replaced): never a 500 either
    app = Flask("inspector")
    app.register_blueprint(inspector_blueprint(any_wf), url_prefix="/inspector")
    assert app.test_client().get(f"/inspector/?{field}=%ED%A0%80").status_code in (200, 400)


# -- 12. hook tokens stay hidden in every view -------------------------------------------------------------------------


def token_run(wf: Workflows, worker: LocalWorker) -> str:
    """A run whose log holds the token in ``hook_created`` and (as logs written before 26 did) ``hook_disposed``."""
    run = wf.start("hooked")
    worker.run_until_idle()
    (hook,) = wf.world.list_hooks(run.id)
    wf.world.append(run.id, [NewEvent(EventType.HOOK_DISPOSED, hook.hook_id, {"taken_by": "wrun_x", "token": TOKEN})])
    kinds = [e.event_type for e in wf.world.list_events(run.id)]
    assert EventType.HOOK_CREATED in kinds and EventType.HOOK_DISPOSED in kinds
    return run.id


def test_hook_tokens_are_hidden_in_the_rpc_unless_revealing_is_allowed(wf: Workflows, worker: LocalWorker) -> None:
    run_id = token_run(wf, worker)
    for client in (http(wf), http(wf, authorize=lambda request, method: method != "reveal_token")):
        status, body = rpc(client, "list_events", run_id=run_id)
        assert status == 200 and TOKEN not in json.dumps(body)
        disposed = [e for e in body["result"]["events"] if e["event_type"] == "hook_disposed"]
        assert disposed[0]["data"]["token"] == "(hidden)" and disposed[0]["data"]["taken_by"] == "wrun_x"
    revealing = http(wf, authorize=lambda request, method: True)
    status, body = rpc(revealing, "list_events", run_id=run_id)
    assert json.dumps(body).count(TOKEN) == 2


def test_hook_tokens_are_hidden_in_the_inspector_and_the_cli(wf: Workflows, worker: LocalWorker) -> None:
    run_id = token_run(wf, worker)
    app = Flask("inspector")
    app.register_blueprint(inspector_blueprint(wf, allow_actions=True), url_prefix="/inspector")
    page = app.test_client().get(f"/inspector/runs/{run_id}").get_data(as_text=True)
    assert "hook_disposed" in page and TOKEN not in page
    url = f"sqlite:///{wf.world.path}"  # type: ignore[attr-defined]
    shown = CliRunner().invoke(cli_group, ["--world", url, "runs", "show", run_id, "--json"], catch_exceptions=False)
    assert shown.exit_code == 0 and "hook_disposed" in shown.stdout and TOKEN not in shown.stdout


# -- 15. the advertised webhook body limit holds -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["binary", "text"])
def test_a_webhook_body_of_the_advertised_size_is_accepted(wf: Workflows, worker: LocalWorker, kind: str) -> None:
    limit = default_max_body(wf, webhook=True)
    unit, mimetype = (b"\xff", "application/octet-stream") if kind == "binary" else ("é".encode(), "text/plain")
    client = http(wf)
    headers = {"User-Agent": "curl/8.5.0", "Accept": "*/*", "X-Request-Id": "r" * 64}
    for n, expected in ((limit, 202), (limit + 1, 413)):
        token = f"size-{kind}-{n}"
        run = wf.start("body_size", token)
        worker.run_until_idle()
        body = (unit * (n // len(unit) + 1))[:n]
        assert len(body) == n
        resp = client.post(f"{PREFIX}/webhooks/{token}", data=body, content_type=mimetype, headers=headers)
        assert resp.status_code == expected, (n, resp.get_json())
        if expected == 202:
            worker.run_until_complete(run)
            assert run.result() == limit
        else:
            assert resp.get_json()["error"]["code"] == "payload_too_large"
            assert not [e for e in wf.world.list_events(run.id) if e.event_type is EventType.HOOK_RECEIVED]


def test_webhook_headers_beyond_their_room_are_431_and_record_nothing(wf: Workflows, worker: LocalWorker) -> None:
    run = wf.start("body_size", "big-headers")
    worker.run_until_idle()
    resp = http(wf).post(f"{PREFIX}/webhooks/big-headers", data=b"x", headers={"X-Big": "a" * 17_000})
    assert resp.status_code == 431 and resp.get_json()["error"]["code"] == "request_headers_too_large"
    assert not [e for e in wf.world.list_events(run.id) if e.event_type is EventType.HOOK_RECEIVED]


# -- 20. a step's own queue --------------------------------------------------------------------------------------------


def test_the_inspector_shows_the_queue_a_step_is_routed_to(wf: Workflows, worker: LocalWorker) -> None:
    run = wf.start("shipping", 1)
    worker.run_until_complete(run)
    assert run.result() == 4
    app = Flask("inspector")
    app.register_blueprint(inspector_blueprint(wf), url_prefix="/inspector")
    page = app.test_client().get(f"/inspector/runs/{run.id}").get_data(as_text=True)
    pack = page.split('data-id="step:pack:1"')[1].split("</li>")[0]
    label = page.split('data-id="step:label:1"')[1].split("</li>")[0]
    assert 'queued on queue <span class="mono">packing</span>' in pack, pack
    assert 'on queue <span class="mono">celery</span>' in label, label
