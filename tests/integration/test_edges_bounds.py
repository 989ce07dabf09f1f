"""Every listing the HTTP edges serve is paged and bounded in bytes, whatever a run holds (issue #26, item 9).

On a SQLite World in a temporary directory, runs are built with large values (300 steps whose results are 300 KB
each, streams of large chunks, thousands of stream names) and the RPC's listings and the inspector's pages are
measured: each answer stays under :data:`BOUND`, values over the listing limit are left out with a marker saying
so, cursors lead through everything, and every value can still be had whole (``get_step``, a page of one item, the
inspector's step, event, value and single-chunk pages; ``HTTPRun`` does so by itself). A size check, not a timing
one.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from flask import Flask
from flask.testing import FlaskClient
from werkzeug.serving import make_server

from celery_workflow import Workflows
from celery_workflow.client import HTTPClient
from celery_workflow.events import EventType, NewEvent
from celery_workflow.inspector import blueprint as inspector_blueprint
from celery_workflow.rpc import MAX_LISTED_VALUE
from celery_workflow.world_sqlite import SQLiteWorld

PREFIX = "/v1/workflow"
#: The most bytes any one answer here may take.
BOUND = 2 * 1_048_576
STEPS = 300
RESULT = 300_000


@pytest.fixture
def wf(tmp_path: Path) -> Iterator[Workflows]:
    workflows = Workflows(Celery("bounds"), world=SQLiteWorld(tmp_path / "world.db"), broker="app")

    @workflows.step
    def produce(n: int) -> str:
        return str(n)

    @workflows.workflow
    def big(n: int) -> int:
        return n

    yield workflows
    workflows.close()


def result_of(i: int) -> str:
    return f"{i:04d}" + "x" * (RESULT - 4)


@pytest.fixture
def big_run(wf: Workflows) -> str:
    """A run of :data:`STEPS` completed steps, each with a result of :data:`RESULT` bytes, written as its log."""
    view, _ = wf.runtime.start("big", [1], {}, run_id="big-run")
    world = wf.world
    for first in range(0, STEPS, 20):
        events: list[NewEvent] = []
        for i in range(first, first + 20):
            cid = f"step:produce:{i + 1}"
            events += [
                NewEvent(EventType.STEP_CREATED, cid, {"step_name": "produce", "input": [i], "mode": "queued"}),
                NewEvent(EventType.STEP_STARTED, cid, {"owner": "bench"}),
                NewEvent(EventType.STEP_COMPLETED, cid, {"result": result_of(i)}),
            ]
        world.append(view.run_id, events)
    world.write_stream(view.run_id, "large", [b"j1" + json.dumps("c" * RESULT).encode()] * 30)
    for s in range(12):
        world.write_stream(view.run_id, f"s{s:02d}", [b"j1" + json.dumps(f"{s}" * 40_000).encode()] * 25)
    return view.run_id


def rpc_client(wf: Workflows) -> FlaskClient:
    app = Flask("bounds")
    app.register_blueprint(wf.blueprint(), url_prefix=PREFIX)
    return app.test_client()


def rpc(client: FlaskClient, method: str, **params: Any) -> tuple[int, dict[str, Any]]:
    resp = client.post(f"{PREFIX}/rpc", json={"method": method, "params": params})
    assert resp.status_code == 200, resp.get_data()[:300]
    assert len(resp.get_data()) < BOUND, f"{method} answered {len(resp.get_data())} bytes"
    return len(resp.get_data()), resp.get_json()["result"]


def inspector(wf: Workflows) -> FlaskClient:
    app = Flask("bounds-inspector")
    app.register_blueprint(inspector_blueprint(wf), url_prefix="/inspector")
    return app.test_client()


def page(client: FlaskClient, path: str) -> str:
    resp = client.get(f"/inspector{path}")
    assert resp.status_code == 200, path
    assert len(resp.get_data()) < BOUND, f"{path} is {len(resp.get_data())} bytes"
    return resp.get_data(as_text=True)


def test_rpc_steps_are_paged_and_large_results_left_out(wf: Workflows, big_run: str) -> None:
    http = rpc_client(wf)
    seen: list[str] = []
    params: dict[str, Any] = {"run_id": big_run}
    while True:
        _, answer = rpc(http, "list_steps", **params)
        for step in answer["steps"]:
            assert step["output"] is None and step["truncated"] == {"output": RESULT + 2}  # its JSON: quotes
            seen.append(step["step_id"])
        if answer["cursor"] is None:
            break
        params = {"run_id": big_run, "after": answer["cursor"]}
    assert seen == [f"step:produce:{i + 1}" for i in range(STEPS)]
    _, one = rpc(http, "get_step", run_id=big_run, step_id="step:produce:7")
    assert one["step"]["output"] == result_of(6)  # whole
    _, alone = rpc(http, "list_steps", run_id=big_run, after="step:produce:6", limit=1)
    assert alone["steps"][0]["output"] == result_of(6) and alone["cursor"] == "step:produce:7"
    status = http.post(f"{PREFIX}/rpc", json={"method": "list_steps", "params": {"run_id": big_run, "after": "x"}})
    assert status.status_code == 400 and status.get_json()["error"]["code"] == "invalid_params"


def test_rpc_events_and_chunks_are_bounded_and_whole_alone(wf: Workflows, big_run: str) -> None:
    http = rpc_client(wf)
    _, answer = rpc(http, "list_events", run_id=big_run, limit=1000)
    events = answer["events"]
    assert len(events) == 1 + 3 * STEPS and answer["cursor"] is None
    completed = [e for e in events if e["event_type"] == "step_completed"]
    assert all(e["data"]["result"] is None and e["truncated"] == {"data.result": RESULT + 2} for e in completed)
    slot = completed[0]["slot"]
    _, alone = rpc(http, "list_events", run_id=big_run, after_slot=slot - 1, limit=1)
    assert alone["events"][0]["data"]["result"] == result_of(0)

    _, chunks = rpc(http, "read_stream", run_id=big_run, name="large", limit=100)
    assert [c["index"] for c in chunks["chunks"]] == list(range(30)) and chunks["next_index"] == 30
    assert all(c["value"] is None and c["truncated"]["value"] > MAX_LISTED_VALUE for c in chunks["chunks"])
    _, first = rpc(http, "read_stream", run_id=big_run, name="large", start=3, limit=1)
    assert first["chunks"][0]["value"] == "c" * RESULT and first["next_index"] == 4


def test_the_inspector_pages_stay_bounded_and_link_to_whole_values(wf: Workflows, big_run: str) -> None:
    http = inspector(wf)
    run = page(http, f"/runs/{big_run}")
    assert run.count('class="whole" href=') >= 200  # results and event data cut, each with its link
    assert f'href="/inspector/runs/{big_run}/steps/step:produce:1"' in run
    assert run.count('<li class="item k-step') == 200 and "later items" in run  # the timeline is paged
    rest = page(http, f"/runs/{big_run}?item=200")
    assert rest.count('<li class="item k-step') == STEPS - 200 and 'data-id="step:produce:300"' in rest
    step = page(http, f"/runs/{big_run}/steps/step:produce:1")
    assert result_of(0) in step
    event = page(http, f"/runs/{big_run}/events/4")
    assert result_of(0) in event
    stream = page(http, f"/runs/{big_run}/streams/large")
    assert stream.count("<li data-index=") == 30 and stream.count("whole chunk") == 30
    alone = page(http, f"/runs/{big_run}/streams/large?start=3&limit=1")
    assert "c" * RESULT in alone and "whole chunk" not in alone


def test_thousands_of_stream_names_are_paged(wf: Workflows) -> None:
    view, _ = wf.runtime.start("big", [2], {}, run_id="named")
    names = [f"n{i:05d}-" + "y" * 290 for i in range(2500)]
    for name in names:
        wf.world.write_stream(view.run_id, name, [b'j1"v"'])
    http = inspector(wf)
    run = page(http, "/runs/named")
    assert len(run.encode()) < 512 * 1024
    assert 'href="/inspector/runs/named/streams">all streams</a>' in run
    listed: list[str] = []
    path = "/runs/named/streams"
    while True:
        body = page(http, path)
        listed += [name for name in names if f">{name}</a>" in body]
        later = body.split('rel="next"')[0].rsplit('href="', 1)[-1].split('"')[0] if 'rel="next"' in body else None
        if later is None:
            break
        path = later.removeprefix("/inspector").replace("&amp;", "&")
    assert listed == names


def test_the_http_client_reads_every_value_whole(wf: Workflows, big_run: str) -> None:
    app = Flask("bounds-server")
    app.register_blueprint(wf.blueprint(), url_prefix=PREFIX)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        run = HTTPClient(f"http://127.0.0.1:{server.server_port}{PREFIX}").get_run(big_run)
        steps = run.steps()
        assert [s["output"] for s in steps] == [result_of(i) for i in range(STEPS)]
        results = [e["data"]["result"] for e in run.events() if e["event_type"] == "step_completed"]
        assert results == [result_of(i) for i in range(STEPS)]
        wf.world.close_stream(big_run, "large")
        assert list(run.stream("large", timeout=10)) == ["c" * RESULT] * 30
    finally:
        server.shutdown()
        thread.join(5)
