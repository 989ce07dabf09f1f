"""The RPC and webhook endpoints through Flask's test client: every method, every error status, and a fuzz test."""

from __future__ import annotations

import json
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_workflow import Workflows, create_hook, create_webhook, get_writable
from celery_workflow.api import METHODS, CeleryWorkflow, blueprint, rpc_blueprint, webhook_blueprint
from celery_workflow.testing import LocalWorker


@pytest.fixture
def flows(wf: Workflows) -> Workflows:
    @wf.step
    def emit(n: int) -> None:
        out = get_writable()
        for i in range(n):
            out.write({"i": i})
        out.write(b"\xff")
        out.close()

    @wf.workflow
    def emitter(n: int) -> int:
        emit(n)
        return n

    @wf.workflow
    def hooked() -> Any:
        return create_hook(token="api-hook").wait()

    @wf.workflow
    def webhooked() -> Any:
        return create_webhook(token="api-webhook").wait().json()

    return wf


@pytest.fixture
def http(flows: Workflows) -> FlaskClient:
    app = Flask("test")
    app.register_blueprint(flows.blueprint(), url_prefix="/v1/workflow")
    return app.test_client()


def rpc(http: FlaskClient, method: str, **params: Any) -> tuple[int, Any]:
    resp = http.post("/v1/workflow/rpc", json={"method": method, "params": params})
    return resp.status_code, resp.get_json()


def test_start_get_list_events_steps_cancel(http: FlaskClient, flows: Workflows, worker: LocalWorker) -> None:
    status, body = rpc(http, "start", workflow="emitter", args=[2])
    assert status == 200 and body["result"]["created"] is True
    run_id = body["result"]["run"]["run_id"]
    worker.run_until_idle()
    status, body = rpc(http, "get_run", run_id=run_id)
    assert body["result"]["run"]["status"] == "completed" and body["result"]["run"]["output"] == 2
    status, body = rpc(http, "start", workflow="emitter", args=[2], run_id=run_id)
    assert body["result"]["created"] is False
    _, body = rpc(http, "list_events", run_id=run_id, limit=3)
    first = body["result"]["events"]
    assert [e["slot"] for e in first] == [1, 2, 3] and body["result"]["cursor"] == 3
    _, body = rpc(http, "list_events", run_id=run_id, after_slot=3)
    assert body["result"]["events"][-1]["event_type"] == "run_completed" and body["result"]["cursor"] is None
    _, body = rpc(http, "list_steps", run_id=run_id)
    assert body["result"]["steps"][0]["step_name"] == "emit"
    _, body = rpc(http, "read_stream", run_id=run_id, start=1)
    assert body["result"]["chunks"] == [{"index": 1, "value": {"i": 1}}, {"index": 2, "bytes_b64": "/w=="}]
    assert body["result"]["closed"] is True
    status, body = rpc(http, "cancel", run_id=run_id)
    assert status == 409 and body["error"]["code"] == "conflict"


def test_list_runs_pages_with_a_cursor(http: FlaskClient, flows: Workflows) -> None:
    ids = [rpc(http, "start", workflow="emitter", args=[0])[1]["result"]["run"]["run_id"] for _ in range(5)]
    seen: list[str] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 2, "workflow": "emitter"}
        if cursor:
            params["cursor"] = cursor
        _, body = rpc(http, "list_runs", **params)
        seen += [r["run_id"] for r in body["result"]["runs"]]
        cursor = body["result"]["cursor"]
        if cursor is None:
            break
    assert seen == ids[::-1]  # newest first: by creation time, whatever the ids


def test_resume_hook_and_cancel(http: FlaskClient, flows: Workflows, worker: LocalWorker) -> None:
    run_id = rpc(http, "start", workflow="hooked")[1]["result"]["run"]["run_id"]
    worker.run_until_idle()
    status, body = rpc(http, "resume_hook", token="api-hook", payload={"ok": 1})
    assert status == 200 and body["result"]["hook"]["run_id"] == run_id
    worker.run_until_idle()
    assert rpc(http, "get_run", run_id=run_id)[1]["result"]["run"]["output"] == {"ok": 1}
    other = rpc(http, "start", workflow="hooked")[1]["result"]["run"]["run_id"]
    worker.run_until_idle()
    status, body = rpc(http, "cancel", run_id=other, reason="test")
    assert status == 200 and body["result"]["run"]["status"] == "cancelled"


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"not json", 400, "invalid_request"),
        (b"[1, 2]", 400, "invalid_request"),
        (b'{"method": 3}', 400, "invalid_request"),
        (b'{"method": "start", "params": [], "x": 1}', 400, "invalid_request"),
        (b'{"method": "nope"}', 404, "method_not_found"),
        (b'{"method": "start", "params": []}', 400, "invalid_params"),
        (b'{"method": "start", "params": {"workflow": 5}}', 400, "invalid_params"),
        (b'{"method": "start", "params": {"workflow": "x", "bogus": 1}}', 400, "invalid_params"),
        (b'{"method": "list_runs", "params": {"limit": 0}}', 400, "invalid_params"),
        (b'{"method": "list_runs", "params": {"status": "sleeping"}}', 400, "invalid_params"),
        (b'{"method": "get_run", "params": {"run_id": "wrun_x", "wait": 99}}', 400, "invalid_params"),
        (b'{"method": "start", "params": {"workflow": "unknown"}}', 404, "workflow_not_found"),
        (b'{"method": "start", "params": {"workflow": "emitter", "args": ["x", "y"]}}', 400, "invalid_params"),
        (
            b'{"method": "start", "params": {"workflow": "emitter", "args": [1], "run_id": "a b"}}',
            400,
            "invalid_params",
        ),
        (b'{"method": "get_run", "params": {"run_id": "wrun_missing"}}', 404, "run_not_found"),
        (b'{"method": "read_stream", "params": {"run_id": "wrun_missing"}}', 404, "run_not_found"),
        (b'{"method": "resume_hook", "params": {"token": "missing"}}', 404, "hook_not_found"),
        # bad input, never a 500 or a 503: nesting past the parser, integers past 64 bits, NUL in ids and names
        (b'{"method": "start", "params": {"workflow": "emitter", "args": [' + b"[" * 100_000 + b"]" * 100_000 + b"]}}",
         400, "invalid_request"),
        (b'{"method": "list_events", "params": {"run_id": "wrun_x", "after_slot": 9223372036854775808}}', 400,
         "invalid_params"),
        (b'{"method": "read_stream", "params": {"run_id": "wrun_x", "start": 18446744073709551616}}', 400,
         "invalid_params"),
        (b'{"method": "list_runs", "params": {"limit": 9223372036854775808}}', 400, "invalid_params"),
        (b'{"method": "get_run", "params": {"run_id": "wrun_\\u0000x"}}', 400, "invalid_params"),
        (b'{"method": "start", "params": {"workflow": "emit\\u0000ter"}}', 400, "invalid_params"),
        (b'{"method": "list_runs", "params": {"cursor": "\\u0000"}}', 400, "invalid_params"),
        (b'{"method": "resume_hook", "params": {"token": "a\\u0000b"}}', 400, "invalid_params"),
        (b'{"method": "read_stream", "params": {"run_id": "wrun_x", "name": "s\\u0000"}}', 400, "invalid_params"),
    ],
)  # fmt: skip
def test_bad_requests_get_typed_errors(
    http: FlaskClient, flows: Workflows, body: bytes, status: int, code: str
) -> None:
    resp = http.post("/v1/workflow/rpc", data=body, content_type="application/json")
    assert resp.status_code == status, resp.get_json()
    assert resp.get_json()["error"]["code"] == code
    assert flows.list_runs() == []


def test_too_large_and_wrong_method(http: FlaskClient, flows: Workflows) -> None:
    big = json.dumps({"method": "start", "params": {"workflow": "emitter", "args": ["x" * 2_000_000]}})
    resp = http.post("/v1/workflow/rpc", data=big, content_type="application/json")
    assert resp.status_code == 413 and resp.get_json()["error"]["code"] == "payload_too_large"
    resp = http.get("/v1/workflow/rpc")
    assert resp.status_code == 405 and resp.headers["Allow"] == "POST"
    payload = {"method": "start", "params": {"workflow": "emitter", "args": ["y" * 400_000]}}
    resp = http.post("/v1/workflow/rpc", json=payload)  # under the body limit, over the payload limit
    assert resp.status_code == 413
    assert flows.list_runs() == []


def test_webhook_endpoint(http: FlaskClient, flows: Workflows, worker: LocalWorker) -> None:
    rpc(http, "start", workflow="hooked")
    run_id = rpc(http, "start", workflow="webhooked")[1]["result"]["run"]["run_id"]
    worker.run_until_idle()
    assert http.post("/v1/workflow/webhooks/api-hook", json={}).status_code == 404  # a plain hook
    assert http.post("/v1/workflow/webhooks/unknown", json={}).status_code == 404
    resp = http.post("/v1/workflow/webhooks/api-webhook", json={"paid": True})
    assert resp.status_code == 202
    worker.run_until_idle()
    assert rpc(http, "get_run", run_id=run_id)[1]["result"]["run"]["output"] == {"paid": True}


def test_blueprints_alone_and_extension(flows: Workflows) -> None:
    public = Flask("public")
    public.register_blueprint(webhook_blueprint(flows), url_prefix="/hooks")
    assert public.test_client().post("/hooks/rpc", json={}).status_code == 404  # no RPC on the public app
    private = Flask("private")
    private.register_blueprint(rpc_blueprint(flows), url_prefix="/internal")
    assert private.test_client().post("/internal/rpc", json={"method": "list_runs"}).status_code == 200
    app = Flask("ext")
    ext = CeleryWorkflow(wf=flows)
    ext.init_app(app)
    assert app.extensions["celery_workflow"] is flows
    assert app.test_client().post("/v1/workflow/rpc", json={"method": "list_runs"}).status_code == 200
    with app.app_context():
        assert CeleryWorkflow.current() is flows
    both = Flask("both")
    both.register_blueprint(blueprint(flows, name="a"), url_prefix="/a")
    assert both.test_client().post("/a/rpc", json={"method": "list_runs"}).status_code == 200


# -- fuzz ------------------------------------------------------------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
_names = st.sampled_from(sorted(METHODS)) | st.text(max_size=12)
_keys = st.sampled_from(
    [
        "workflow",
        "args",
        "kwargs",
        "run_id",
        "wait",
        "status",
        "limit",
        "cursor",
        "after_slot",
        "token",
        "payload",
        "name",
        "start",
        "reason",
        "x",
    ]
)
_params = st.dictionaries(_keys, _json, max_size=5) | _json
_bodies = st.builds(lambda m, p: json.dumps({"method": m, "params": p}).encode(), _names, _params) | st.binary(
    max_size=64
)


def _state(wf: Workflows) -> Any:
    runs = wf.world.list_runs(limit=1000).items
    return [(r, wf.world.list_events(r.run_id)) for r in runs]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=_bodies)
def test_fuzzed_rpc_bodies_never_500_and_never_change_state_on_error(
    http: FlaskClient, flows: Workflows, body: bytes
) -> None:
    before = _state(flows)
    resp = http.post("/v1/workflow/rpc", data=body, content_type="application/json")
    assert resp.status_code in (200, 400, 404, 409, 413), (resp.status_code, resp.get_data())
    data = resp.get_json()
    if resp.status_code != 200:
        assert set(data["error"]) >= {"code", "message"}
        assert _state(flows) == before


def test_rpc_takes_json_only(http: FlaskClient, flows: Workflows) -> None:
    """A browser form or a text/plain post (no CORS preflight) cannot reach the RPC: 415, and nothing starts."""
    body = json.dumps({"method": "start", "params": {"workflow": "emitter", "args": [1]}})
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        resp = http.post("/v1/workflow/rpc", data=body, content_type=content_type)
        assert resp.status_code == 415, content_type
        assert resp.get_json()["error"]["code"] == "unsupported_media_type"
    assert flows.list_runs() == []
    resp = http.post("/v1/workflow/rpc", data=body, content_type="application/json; charset=utf-8")
    assert resp.status_code == 200


def test_authorize_guards_every_rpc_method(flows: Workflows, caplog: pytest.LogCaptureFixture) -> None:
    seen: list[tuple[str, str | None]] = []

    def authorize(request: Any, method: str) -> bool:
        seen.append((method, request.headers.get("Authorization")))
        return request.headers.get("Authorization") == "Bearer good" and method != "cancel"

    app = Flask("guarded")
    app.register_blueprint(flows.blueprint(authorize=authorize), url_prefix="/v1/workflow")
    assert "without authorize" not in caplog.text
    http = app.test_client()
    call = {"method": "start", "params": {"workflow": "emitter", "args": [1]}}
    resp = http.post("/v1/workflow/rpc", json=call)
    assert resp.status_code == 401 and resp.get_json()["error"]["code"] == "unauthorized"
    resp = http.post("/v1/workflow/rpc", json=call, headers={"Authorization": "Bearer bad"})
    assert resp.status_code == 403 and resp.get_json()["error"]["code"] == "forbidden"
    resp = http.post("/v1/workflow/rpc", json={"method": "no_such", "params": {}})
    assert resp.status_code == 401  # the method list is not shown to a caller who may not call
    assert flows.list_runs() == []
    resp = http.post("/v1/workflow/rpc", json=call, headers={"Authorization": "Bearer good"})
    assert resp.status_code == 200
    run_id = resp.get_json()["result"]["run"]["run_id"]
    cancel = {"method": "cancel", "params": {"run_id": run_id}}
    assert http.post("/v1/workflow/rpc", json=cancel, headers={"Authorization": "Bearer good"}).status_code == 403
    assert flows.world.get_run(run_id).status.value == "pending"
    assert seen[:2] == [("start", None), ("start", "Bearer bad")]
    # webhooks are authorised by their tokens alone, whatever authorize says
    assert http.post("/v1/workflow/webhooks/nope", json={}).status_code == 404
    ext_app = Flask("ext")
    CeleryWorkflow(ext_app, flows, authorize=lambda request, method: False)
    assert ext_app.test_client().post("/v1/workflow/rpc", json=call).status_code == 401


def test_rpc_without_authorize_is_named_in_a_warning(flows: Workflows, caplog: pytest.LogCaptureFixture) -> None:
    rpc_blueprint(flows, name="open_rpc")
    assert "RPC blueprint 'open_rpc' registered without authorize=" in caplog.text


def test_list_runs_answers_are_bounded(http: FlaskClient, flows: Workflows, monkeypatch: pytest.MonkeyPatch) -> None:
    """A page over the response limit comes back shorter, with a cursor that continues exactly after it."""
    from celery_workflow import rpc as rpc_module

    for n in range(6):
        flows.runtime.start("emitter", ["x" * 1000], {}, run_id=f"big-{n}")
    monkeypatch.setattr(rpc_module, "MAX_RESPONSE", 3500)  # about two runs' worth
    seen: list[str] = []
    cursor = None
    while True:
        status, body = rpc(http, "list_runs", limit=6, **({"cursor": cursor} if cursor else {}))
        assert status == 200
        page = [r["run_id"] for r in body["result"]["runs"]]
        assert 1 <= len(page) <= 3
        seen += page
        cursor = body["result"]["cursor"]
        if cursor is None:
            break
    assert sorted(seen) == [f"big-{n}" for n in range(6)]


def test_resume_hook_waits_for_a_hook_the_run_has_not_reached(http: FlaskClient, flows: Workflows) -> None:
    """RPC ``resume_hook`` with ``wait``: a resume sent right after ``start`` finds the hook once the run reaches it
    (issue #26 item 21); without ``wait`` it is 404 at once, and a ``wait`` out of range is 400."""
    import threading

    run_id = rpc(http, "start", workflow="hooked")[1]["result"]["run"]["run_id"]
    assert rpc(http, "resume_hook", token="api-hook", payload={"ok": 2})[0] == 404
    assert rpc(http, "resume_hook", token="api-hook", wait=-1)[0] == 400
    assert rpc(http, "resume_hook", token="api-hook", wait=31)[0] == 400
    answers: list[tuple[int, Any]] = []
    thread = threading.Thread(
        target=lambda: answers.append(rpc(http, "resume_hook", token="api-hook", payload={"ok": 2}, wait=20))
    )
    thread.start()
    worker = LocalWorker(flows)
    worker.run_until(lambda: bool(answers), timeout=20)
    thread.join(timeout=20)
    assert answers[0][0] == 200 and answers[0][1]["result"]["hook"]["run_id"] == run_id
    worker.run_until(lambda: flows.world.get_run(run_id).status.terminal, timeout=20)
    assert rpc(http, "get_run", run_id=run_id)[1]["result"]["run"]["output"] == {"ok": 2}


def test_get_run_says_what_the_run_waits_for_with_the_token_only_when_revealed(
    http: FlaskClient, flows: Workflows, worker: LocalWorker
) -> None:
    run_id = rpc(http, "start", workflow="hooked")[1]["result"]["run"]["run_id"]
    worker.run_until_idle()
    (waiting,) = rpc(http, "get_run", run_id=run_id)[1]["result"]["run"]["waiting_on"]
    assert waiting["kind"] == "hook" and waiting["hook_id"] == "hook:1" and waiting["token"] is None
    assert "api-hook" not in json.dumps(waiting)
    app = Flask("revealing")
    app.register_blueprint(flows.blueprint(authorize=lambda request, action: True), url_prefix="/v1/workflow")
    (revealed,) = rpc(app.test_client(), "get_run", run_id=run_id)[1]["result"]["run"]["waiting_on"]
    assert revealed["token"] == "api-hook"
    rpc(http, "resume_hook", token="api-hook", payload={"ok": 1})
    worker.run_until_idle()
    assert rpc(http, "get_run", run_id=run_id)[1]["result"]["run"]["waiting_on"] == []
