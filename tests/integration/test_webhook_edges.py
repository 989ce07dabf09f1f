"""Webhooks are safe by default (issue #12): they answer once unless created with ``many=True`` (decided by the
World's atomic write, so two racing first requests record one), HEAD and OPTIONS never resume them, credential
headers are not recorded unless kept, a fixed response is checked when the webhook is created, and unknown and plain
hook tokens get the same 404. Through Flask's test client, on the memory, SQLite and Postgres Worlds."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from flask import Flask
from flask.testing import FlaskClient

from celery_workflow import WebhookRequest, Workflows, create_hook, create_webhook
from celery_workflow.api import webhook_blueprint
from celery_workflow.errors import CeleryWorkflowError, ConfigurationError, InvalidWebhookResponse
from celery_workflow.events import EventType, NewEvent
from celery_workflow.testing import LocalWorker, MemoryWorld
from celery_workflow.world_sqlite import SQLiteWorld

PREFIX = "/v1/workflow"
CREDENTIALS = {"Authorization": "Bearer s3cret-a", "Cookie": "session=s3cret-c", "Proxy-Authorization": "s3cret-p"}

#: Malformed fixed responses, each refused by create_webhook (a workflow picks one by index).
BAD_SPECS: list[Any] = [
    {"status": "200"},
    {"status": 99},
    {"status": 600},
    {"status": True},
    {"status": 200.0},
    {"headers": {"X-A": 1}},
    {"headers": {1: "a"}},
    {"headers": ["X-A"]},
    {"headers": {"X-A": "one\r\nSet-Cookie: evil=1"}},
    {"headers": {"bad name": "a"}},
    {"body": {1, 2}},
    {"body": b"bytes"},
    {"body": float("nan")},
    {"status": 200, "extra": 1},
    "automatic",
    42,
]


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def wf(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Workflows]:
    with ExitStack() as stack:
        world: Any
        if request.param == "memory":
            world = MemoryWorld()
        elif request.param == "sqlite":
            world = SQLiteWorld(tmp_path / "world.db")
        else:
            from celery_workflow.world_pg import PostgresWorld
            from tests.integration import pg_fixtures  # skips this case when PostgreSQL is unreachable

            schema = stack.enter_context(pg_fixtures.fresh_schema("cw_webhook"))
            world = PostgresWorld.open(pg_fixtures.schema_url(schema))
        workflows = Workflows(Celery("webhooks"), world=world, broker="app", base_url="https://x.test/wf")
        stack.callback(workflows.world.close)
        _register(workflows)
        yield workflows


def _register(wf: Workflows) -> None:
    @wf.workflow
    def once(token: str) -> Any:
        return create_webhook(token=token).wait().json()

    @wf.workflow
    def many(token: str, n: int) -> list[Any]:
        hook = create_webhook(token=token, many=True)
        return [hook.wait().json() for _ in range(n)]

    @wf.workflow
    def twice(token: str) -> Any:
        hook = create_webhook(token=token)
        hook.wait()
        return hook.wait().json()

    @wf.workflow
    def headers(token: str, keep: bool) -> dict[str, str]:
        return create_webhook(token=token, keep_credentials=keep).wait().headers

    @wf.workflow
    def plain(token: str) -> Any:
        return create_hook(token=token).wait()

    @wf.workflow
    def bad_spec(case: int) -> dict[str, str]:
        try:
            create_webhook(respond_with=BAD_SPECS[case])
        except CeleryWorkflowError as exc:
            return {"error": type(exc).__name__, "message": exc.message}
        return {"error": ""}

    @wf.workflow
    def fixed(token: str) -> Any:
        spec = {"status": 201, "headers": {"X-Fixed": "yes"}, "body": {"ok": True}}
        return create_webhook(token=token, respond_with=spec).wait().json()


@pytest.fixture
def worker(wf: Workflows) -> LocalWorker:
    return LocalWorker(wf)


def _app(wf: Workflows) -> Flask:
    app = Flask("webhook-edges")
    app.register_blueprint(webhook_blueprint(wf), url_prefix=PREFIX)
    return app


@pytest.fixture
def http(wf: Workflows) -> FlaskClient:
    return _app(wf).test_client()


def _received(wf: Workflows, run_id: str) -> list[Any]:
    return [e.data["payload"] for e in wf.world.list_events(run_id) if e.event_type is EventType.HOOK_RECEIVED]


def _waiting(wf: Workflows, worker: LocalWorker, name: str, *args: Any) -> str:
    run = wf.start(name, *args)
    worker.run_until_idle()
    assert wf.world.list_hooks(run.id), "the run should be waiting on its hook"
    return run.id


# -- 1. a webhook answers once by default ------------------------------------------------------------------------------


def test_a_webhook_answers_once_then_410_and_records_nothing(
    wf: Workflows, worker: LocalWorker, http: FlaskClient
) -> None:
    run_id = _waiting(wf, worker, "once", "tok-once")
    first = http.post(f"{PREFIX}/webhooks/tok-once", json={"n": 1})
    assert first.status_code == 202
    events = wf.world.list_events(run_id)
    second = http.post(f"{PREFIX}/webhooks/tok-once", json={"n": 2})
    assert second.status_code == 410
    assert second.get_json()["error"]["code"] == "webhook_used"
    assert wf.world.list_events(run_id) == events  # nothing recorded
    worker.run_until_idle()
    assert wf.get_run(run_id).result(timeout=0) == {"n": 1}
    # the run has ended: its hooks are gone and the token is unknown
    assert http.post(f"{PREFIX}/webhooks/tok-once", json={"n": 3}).status_code == 404


def test_a_webhook_created_with_many_records_every_request(
    wf: Workflows, worker: LocalWorker, http: FlaskClient
) -> None:
    run_id = _waiting(wf, worker, "many", "tok-many", 3)
    for n in range(3):
        assert http.post(f"{PREFIX}/webhooks/tok-many", json={"n": n}).status_code == 202
    worker.run_until_idle()
    assert wf.get_run(run_id).result(timeout=0) == [{"n": 0}, {"n": 1}, {"n": 2}]


def test_waiting_twice_on_a_webhook_that_answers_once_fails_clearly(
    wf: Workflows, worker: LocalWorker, http: FlaskClient
) -> None:
    run_id = _waiting(wf, worker, "twice", "tok-twice")
    assert http.post(f"{PREFIX}/webhooks/tok-twice", json={}).status_code == 202
    worker.run_until_idle()
    run = wf.get_run(run_id)
    assert run.status == "failed"
    assert "many=True" in json.dumps(wf.world.get_run(run_id).error)


def test_a_webhook_recorded_without_the_flag_behaves_as_many(wf: Workflows, worker: LocalWorker) -> None:
    """A hook_created event written before ``many`` existed (no key) keeps accepting requests."""
    run_id = _waiting(wf, worker, "plain", "tok-legacy-plain")  # any waiting run: add an old-format webhook to it
    legacy = {"token": "tok-legacy", "metadata": None, "is_webhook": True}
    wf.world.append(run_id, [NewEvent(EventType.HOOK_CREATED, "hook:legacy", legacy)])
    http = _app(wf).test_client()
    for n in range(2):
        assert http.post(f"{PREFIX}/webhooks/tok-legacy", json={"n": n}).status_code == 202
    assert [WebhookRequest.from_payload(p).json() for p in _received(wf, run_id)] == [{"n": 0}, {"n": 1}]


def test_two_simultaneous_first_requests_record_exactly_one(
    wf: Workflows, worker: LocalWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both requests have read the webhook as unused before either writes (a barrier holds each request's first
    hook_received append until the other one gets there): the World's write decides, one 202 and one 410."""
    run_id = _waiting(wf, worker, "once", "tok-race")
    barrier = threading.Barrier(2, timeout=20)
    held = threading.local()
    append = wf.world.append

    def racing_append(run: str, events: Any, **kwargs: Any) -> Any:
        if any(e.event_type is EventType.HOOK_RECEIVED for e in events) and not getattr(held, "done", False):
            held.done = True
            barrier.wait()
        return append(run, events, **kwargs)

    monkeypatch.setattr(wf.world, "append", racing_append)
    app = _app(wf)
    statuses: list[int] = []

    def send(n: int) -> None:
        statuses.append(app.test_client().post(f"{PREFIX}/webhooks/tok-race", json={"n": n}).status_code)

    threads = [threading.Thread(target=send, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(statuses) == [202, 410]
    assert len(_received(wf, run_id)) == 1


# -- 2. HEAD and OPTIONS never consume it ------------------------------------------------------------------------------


def test_head_and_options_never_resume_the_webhook(wf: Workflows, worker: LocalWorker, http: FlaskClient) -> None:
    run_id = _waiting(wf, worker, "once", "tok-probe")
    events = wf.world.list_events(run_id)
    head = http.head(f"{PREFIX}/webhooks/tok-probe")
    assert head.status_code == 204 and head.get_data() == b""
    options = http.options(f"{PREFIX}/webhooks/tok-probe")
    assert options.status_code == 204
    assert {"POST", "GET", "HEAD", "OPTIONS"} <= {m.strip() for m in options.headers["Allow"].split(",")}
    assert wf.world.list_events(run_id) == events  # nothing recorded, nothing resumed
    assert http.post(f"{PREFIX}/webhooks/tok-probe", json={"n": 1}).status_code == 202  # still unused


# -- 3. credentials are not stored -------------------------------------------------------------------------------------


def test_credential_headers_are_dropped_unless_kept(wf: Workflows, worker: LocalWorker, http: FlaskClient) -> None:
    dropped = _waiting(wf, worker, "headers", "tok-creds", False)
    kept = _waiting(wf, worker, "headers", "tok-keep", True)
    sent = {k: v for k, v in CREDENTIALS.items() if k != "Cookie"} | {"X-Other": "visible"}
    http.set_cookie("session", "s3cret-c")  # the test client sends its own cookie jar as the Cookie header
    assert http.post(f"{PREFIX}/webhooks/tok-creds", json={}, headers=sent).status_code == 202
    assert http.post(f"{PREFIX}/webhooks/tok-keep", json={}, headers=sent).status_code == 202
    stored = json.dumps([e.data for e in wf.world.list_events(dropped)])
    assert "s3cret" not in stored and "visible" in stored
    worker.run_until_idle()
    without = wf.get_run(dropped).result(timeout=0)
    assert {k.lower() for k in without} & {"authorization", "cookie", "proxy-authorization"} == set()
    assert without["X-Other"] == "visible"
    with_them = wf.get_run(kept).result(timeout=0)
    assert {k: with_them[k] for k in CREDENTIALS} == CREDENTIALS


def test_credential_header_names_compare_case_insensitively(wf: Workflows, worker: LocalWorker) -> None:
    run_id = _waiting(wf, worker, "headers", "tok-case", False)
    raw = {"AUTHORIZATION": "s3cret-1", "cookie": "s3cret-2", "proxy-AUTHORIZATION": "s3cret-3", "X-A": "b"}
    wf.runtime.resume_webhook("tok-case", WebhookRequest.build("POST", raw, b"{}"))
    (payload,) = _received(wf, run_id)
    assert payload["headers"] == {"X-A": "b"}


# -- 4. a fixed response is checked when the webhook is created --------------------------------------------------------


@pytest.mark.parametrize("case", range(len(BAD_SPECS)))
def test_a_malformed_fixed_response_is_refused_at_creation(wf: Workflows, worker: LocalWorker, case: int) -> None:
    run = wf.start("bad_spec", case)
    worker.run_until_idle()
    result = wf.get_run(run.id).result(timeout=0)
    assert result["error"] == "InvalidWebhookResponse", result
    assert issubclass(InvalidWebhookResponse, ConfigurationError)
    assert EventType.HOOK_CREATED not in {e.event_type for e in wf.world.list_events(run.id)}  # nothing written
    assert wf.world.list_hooks(run.id) == []


def test_a_wellformed_fixed_response_is_served(wf: Workflows, worker: LocalWorker, http: FlaskClient) -> None:
    _waiting(wf, worker, "fixed", "tok-fixed")
    resp = http.post(f"{PREFIX}/webhooks/tok-fixed", json={"a": 1})
    assert (resp.status_code, resp.headers["X-Fixed"], resp.get_json()) == (201, "yes", {"ok": True})


# -- 5. unknown and plain hook tokens look the same --------------------------------------------------------------------


@pytest.mark.parametrize("method", ["POST", "GET", "HEAD", "PUT"])
def test_unknown_and_plain_hook_tokens_get_the_same_404(
    wf: Workflows, worker: LocalWorker, http: FlaskClient, method: str
) -> None:
    run_id = _waiting(wf, worker, "plain", "tok-plain")
    events = wf.world.list_events(run_id)
    plain = http.open(f"{PREFIX}/webhooks/tok-plain", method=method, json={"x": 1})
    unknown = http.open(f"{PREFIX}/webhooks/tok-nobody", method=method, json={"x": 1})
    assert plain.status_code == unknown.status_code == 404
    assert plain.get_data() == unknown.get_data()
    if method != "HEAD":
        assert plain.get_json()["error"]["code"] == "hook_not_found"
    assert wf.world.list_events(run_id) == events
