"""The run inspector through Flask's test client, on the SQLite and Postgres Worlds (and a smoke run on the AWS World
through moto): list filters and paging, 404 and 400 pages, escaping, hidden tokens, the guard of the actions, CSRF,
hook resumes with bad JSON, dead letter redrives and the live tail."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from flask import Flask
from flask.testing import FlaskClient

from celery_workflow import (
    Workflows,
    continue_as_new,
    create_hook,
    create_webhook,
    gather,
    get_writable,
    patched,
    sleep,
)
from celery_workflow.api import inspector_blueprint
from celery_workflow.dead_letters import dead_letter_store
from celery_workflow.events import EventType
from celery_workflow.inspector import blueprint
from celery_workflow.inspector.server import make_app
from celery_workflow.inspector.views import RUN_CHUNKS
from celery_workflow.testing import LocalWorker
from tests.integration.aws_fixtures import Aws, aws_fixture, moto_fixture  # noqa: F401

TOKEN = "tok-secret-5f2a"
PREFIX = "/inspector"


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'inspector.sqlite3'}"
        return
    from tests.integration import pg_fixtures

    with pg_fixtures.fresh_schema("cw_inspector") as schema:
        yield pg_fixtures.schema_url(schema)


@pytest.fixture
def wf(url: str) -> Iterator[Workflows]:
    workflows = Workflows(Celery("inspector"), world=url, broker="app", base_url="https://wf.example.test")
    register(workflows)
    yield workflows
    workflows.close()


def register(wf: Workflows) -> None:
    failures: dict[str, int] = {}

    @wf.step
    def hello(name: str) -> str:
        get_writable("progress").write({"hello": name})
        return f"hello {name}"

    @wf.workflow
    def greet(name: str) -> str:
        return hello(name)

    @wf.step(max_retries=3, retry_backoff=0.01)
    def wobbly(key: str) -> int:
        failures[key] = failures.get(key, 0) + 1
        if failures[key] == 1:
            raise RuntimeError("first attempt fails <b>loudly</b>")
        return failures[key]

    @wf.workflow
    def approve(key: str) -> Any:
        wobbly(key)
        decision = create_hook(token=TOKEN).wait()
        sleep(3600)
        return decision

    @wf.workflow
    def called() -> Any:
        return create_webhook().wait().json()

    @wf.workflow
    def handing_over(n: int) -> int:
        if n < 1:
            continue_as_new(n + 1)
        return n

    @wf.workflow
    def changed(name: str) -> str:
        return hello(name) if patched("greet-by-name") else "hi"

    @wf.workflow
    def family(names: list[str]) -> list[str]:
        return list(gather(*[changed.start(name) for name in names]))


@pytest.fixture
def worker(wf: Workflows) -> LocalWorker:
    return LocalWorker(wf)


def client(wf: Workflows, **options: Any) -> FlaskClient:
    app = Flask("inspector-test")
    app.register_blueprint(blueprint(wf, **options), url_prefix=PREFIX)
    return app.test_client()


def csrf(http: FlaskClient, path: str) -> str:
    """The CSRF token of a page's forms (the page also sets the cookie)."""
    page = http.get(path).get_data(as_text=True)
    found = re.search(r'name="csrf_token" value="([^"]+)"', page)
    assert found, "the page has no form"
    return found.group(1)


def rows(html: str) -> list[str]:
    return re.findall(r'<tr class="run" data-run-id="([^"]+)"', html)


def message(html: str) -> str:
    found = re.search(r'<p class="message">(.*?)</p>', html, re.S)
    return found.group(1) if found else ""


def sse(body: str) -> list[tuple[str, str | None, Any]]:
    """(event, id, data) of each server-sent event of a body (comments and the retry line left out)."""
    out = []
    for block in body.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line and not line.startswith(":"))
        if "event" in fields:
            out.append((fields["event"], fields.get("id"), json.loads(fields["data"])))
    return out


def newest_first(wf: Workflows, run_ids: list[str]) -> list[str]:
    """The runs in the order the World lists them: newest first by creation time, ties by run id."""
    return sorted(run_ids, key=lambda r: (wf.world.get_run(r).created_at, r), reverse=True)


def waiting_on_hook(wf: Workflows, worker: LocalWorker, key: str = "k") -> str:
    run = wf.start("approve", key)
    worker.run_until(lambda: bool(wf.world.list_hooks(run.id)), timeout=20)
    return run.id


# -- the runs list -----------------------------------------------------------------------------------------------------


def test_the_list_filters_by_workflow_and_status_and_counts_per_status(wf: Workflows, worker: LocalWorker) -> None:
    greeted = [wf.start("greet", name).id for name in ("ann", "bob", "cy")]
    worker.run_until_idle()
    waiting = waiting_on_hook(wf, worker)
    http = client(wf)

    everything = http.get(f"{PREFIX}/").get_data(as_text=True)
    assert rows(everything) == newest_first(wf, [*greeted, waiting])
    assert re.search(r'data-status="completed">3<', everything) and re.search(r'data-status="running">1<', everything)
    assert rows(http.get(f"{PREFIX}/?workflow=greet").get_data(as_text=True)) == newest_first(wf, greeted)
    assert rows(http.get(f"{PREFIX}/?status=running").get_data(as_text=True)) == [waiting]
    assert rows(http.get(f"{PREFIX}/?workflow=greet&status=running").get_data(as_text=True)) == []
    assert rows(http.get(f"{PREFIX}/?workflow=nobody").get_data(as_text=True)) == []
    only_greet = http.get(f"{PREFIX}/?workflow=greet").get_data(as_text=True)
    assert re.search(r'data-status="running">0<', only_greet)  # counts follow the workflow filter
    assert '<option value="completed" selected>' in http.get(f"{PREFIX}/?status=completed").get_data(as_text=True)


def test_the_list_searches_by_run_id_prefix_and_creation_time_and_refreshes(wf: Workflows, worker: LocalWorker) -> None:
    first = wf.start("greet", "ann", run_id="wrun_search_a1").id
    second = wf.start("greet", "bob", run_id="wrun_search_b2").id
    third = wf.start("greet", "cy", run_id="wrun_other_c3").id
    worker.run_until_idle()
    created = {r: wf.world.get_run(r).created_at for r in (first, second, third)}
    http = client(wf)

    def listed(query: str) -> list[str]:
        answer = http.get(f"{PREFIX}/?{query}")
        assert answer.status_code == 200, answer.get_data(as_text=True)
        return rows(answer.get_data(as_text=True))

    assert listed("run=wrun_search") == newest_first(wf, [first, second])
    assert listed("run=wrun_search_b&workflow=greet&status=completed") == [second]
    assert listed("run=wrun_none") == []
    since = created[second].replace(tzinfo=None).isoformat()  # a datetime-local value: UTC without an offset
    assert set(listed(f"from={since}")) == {r for r in (first, second, third) if created[r] >= created[second]}
    until = created[second].isoformat()
    assert set(listed(f"until={until.replace('+', '%2B')}")) == {
        r for r in (first, second, third) if created[r] < created[second]
    }
    assert http.get(f"{PREFIX}/?from=yesterday").status_code == 400
    assert http.get(f"{PREFIX}/?refresh=-1").status_code == 400
    page = http.get(f"{PREFIX}/?run=wrun_search&refresh=15").get_data(as_text=True)
    assert '<meta http-equiv="refresh" content="15">' in page and 'value="wrun_search"' in page
    assert "http-equiv" not in http.get(f"{PREFIX}/").get_data(as_text=True)


def test_a_runs_history_downloads_as_replay_history_reads_it(wf: Workflows, worker: LocalWorker) -> None:
    from celery_workflow.testing import History, replay_history

    run_id = waiting_on_hook(wf, worker)
    assert client(wf).get(f"{PREFIX}/runs/{run_id}/history.json").status_code == 403  # it holds the hook's token
    assert "download the history" not in client(wf).get(f"{PREFIX}/runs/{run_id}").get_data(as_text=True)
    http = client(wf, allow_actions=True)
    assert "download the history" in http.get(f"{PREFIX}/runs/{run_id}").get_data(as_text=True)
    answer = http.get(f"{PREFIX}/runs/{run_id}/history.json")
    assert answer.status_code == 200 and answer.mimetype == "application/json"
    assert f'filename="{run_id}.history.json"' in answer.headers["Content-Disposition"]
    history = History.from_json(json.loads(answer.get_data(as_text=True)))
    assert history.run_id == run_id and len(history.events) == wf.world.get_run(run_id).event_count
    replay_history(wf, history)  # the code replays its own history without a divergence
    assert http.get(f"{PREFIX}/runs/wrun_nobody/history.json").status_code == 404


def test_the_queues_page_shows_depth_and_consumers(wf: Workflows) -> None:
    wf.start("greet", "ann")
    wf.start("greet", "bob")
    page = client(wf).get(f"{PREFIX}/queues").get_data(as_text=True)
    found = re.search(r'<tr class="queue" data-queue="celery">.*?data-messages="(\d+)"', page, re.S)
    assert found and int(found.group(1)) == 2, page
    assert "no consumer" in page  # nothing consumes it in this test


def test_the_list_pages_with_the_worlds_cursors(wf: Workflows, worker: LocalWorker) -> None:
    started = [wf.start("greet", f"n{i}").id for i in range(5)]
    http = client(wf)
    seen: list[str] = []
    path: str | None = f"{PREFIX}/?limit=2&workflow=greet"
    pages = 0
    while path is not None:
        html = http.get(path).get_data(as_text=True)
        page = rows(html)
        assert 0 < len(page) <= 2
        seen.extend(page)
        found = re.search(r'<a href="([^"]+)" rel="next">', html)
        path = found.group(1).replace("&amp;", "&") if found else None
        pages += 1
        if path is not None:
            assert "workflow=greet" in path and "limit=2" in path and "cursor=" in path
    assert pages == 3 and seen == started[::-1]  # newest first: by creation time, whatever the ids


# -- hostile input -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "query",
    ["status=bogus", "status=RUNNING", "limit=0", "limit=201", "limit=abc", "limit=%C2%B2", "workflow=a%00b"],
)
def test_bad_list_parameters_get_400(wf: Workflows, query: str) -> None:
    resp = client(wf).get(f"{PREFIX}/?{query}")
    assert resp.status_code == 400 and "Bad request" in resp.get_data(as_text=True)


def test_unknown_runs_get_404_pages_and_bad_slots_400(wf: Workflows, worker: LocalWorker) -> None:
    http = client(wf)
    for path in ("/runs/nope", "/runs/nope/streams/progress", "/runs/nope/streams/progress/tail"):
        resp = http.get(PREFIX + path)
        assert resp.status_code == 404, path
        assert resp.mimetype == "text/html" and "Not found" in resp.get_data(as_text=True)
    run = wf.start("greet", "ann")
    worker.run_until_complete(run)
    assert http.get(f"{PREFIX}/runs/{run.id}?after_slot=-1").status_code == 400
    assert http.get(f"{PREFIX}/runs/{run.id}?after_slot=99999999999999999999").status_code == 400
    assert http.get(f"{PREFIX}/dead-letters?after=99999999999999999999").status_code == 400


def test_everything_shown_is_html_escaped(wf: Workflows, worker: LocalWorker) -> None:
    script = '<script>alert("x")</script>'
    run = wf.start("greet", script)
    worker.run_until_complete(run)
    retried = waiting_on_hook(wf, worker, key=script)
    http = client(wf)
    for path in (f"/runs/{run.id}", f"/runs/{retried}", "/", f"/runs/{run.id}/streams/progress"):
        html = http.get(PREFIX + path).get_data(as_text=True)
        assert "<script>alert" not in html and "<b>loudly" not in html, path
    page = http.get(f"{PREFIX}/runs/{run.id}").get_data(as_text=True)
    assert page.count("&lt;script&gt;alert(") >= 3  # the input, the output and the stream chunk, as JSON
    retried_page = http.get(f"{PREFIX}/runs/{retried}").get_data(as_text=True)
    assert "first attempt fails &lt;b&gt;loudly&lt;/b&gt;" in retried_page
    missing = http.get(f"{PREFIX}/runs/<img src=x onerror=alert(1)>")
    assert missing.status_code == 404 and "<img" not in missing.get_data(as_text=True)
    tail = http.get(f"{PREFIX}/runs/{run.id}/streams/progress/tail").get_data(as_text=True)
    assert "event: chunk" in tail and "event: end" in tail  # JSON in the events; the page inserts it as text


def test_hook_tokens_are_hidden_unless_revealed(wf: Workflows, worker: LocalWorker) -> None:
    run_id = waiting_on_hook(wf, worker)
    page = client(wf).get(f"{PREFIX}/runs/{run_id}").get_data(as_text=True)
    assert TOKEN not in page  # neither in the hooks table nor in the event log's hook_created
    assert "hidden" in page and ">reveal<" not in page  # read-only: no reveal control
    assert client(wf).get(f"{PREFIX}/runs/{run_id}?reveal=hook:1").status_code == 403

    actions = client(wf, allow_actions=True)
    page = actions.get(f"{PREFIX}/runs/{run_id}").get_data(as_text=True)
    assert TOKEN not in page and ">reveal<" in page
    revealed = actions.get(f"{PREFIX}/runs/{run_id}?reveal=hook:1")
    assert revealed.status_code == 200 and TOKEN in revealed.get_data(as_text=True)
    assert revealed.headers["Cache-Control"] == "no-store"
    events = revealed.get_data(as_text=True).split('id="events"')[1]
    assert TOKEN not in events  # the event log keeps it hidden even then


def test_a_webhooks_url_is_shown_only_when_revealed(wf: Workflows, worker: LocalWorker) -> None:
    run = wf.start("called")
    worker.run_until(lambda: bool(wf.world.list_hooks(run.id)))
    (hook,) = wf.world.list_hooks(run.id)
    http = client(wf, allow_actions=True)
    assert hook.token not in http.get(f"{PREFIX}/runs/{run.id}").get_data(as_text=True)
    page = http.get(f"{PREFIX}/runs/{run.id}?reveal={hook.hook_id}").get_data(as_text=True)
    assert f"https://wf.example.test/webhooks/{hook.token}" in page
    assert 'class="action resume"' not in page  # a webhook is resumed at its URL, not here


# -- actions -----------------------------------------------------------------------------------------------------------


def test_actions_are_refused_without_authorize_unless_allowed(wf: Workflows, worker: LocalWorker) -> None:
    run_id = waiting_on_hook(wf, worker)
    http = client(wf)
    page = http.get(f"{PREFIX}/runs/{run_id}").get_data(as_text=True)
    assert "Cancel run" not in page and "read-only" in page
    token = re.search(r'name="csrf_token" value="([^"]+)"', page)
    assert token is None  # no forms at all
    for path, data in (
        (f"/runs/{run_id}/cancel", {}),
        (f"/runs/{run_id}/hooks/hook:1/resume", {"payload": "{}"}),
        ("/dead-letters/1/redrive", {}),
    ):
        resp = http.post(PREFIX + path, data=data)
        assert resp.status_code == 403 and "read-only" in message(resp.get_data(as_text=True)), path
    assert wf.world.get_run(run_id).status == "running"

    allowed = client(wf, allow_actions=True)
    token_value = csrf(allowed, f"{PREFIX}/runs/{run_id}")
    resp = allowed.post(f"{PREFIX}/runs/{run_id}/cancel", data={"csrf_token": token_value, "reason": "enough"})
    assert resp.status_code == 303 and resp.headers["Location"].endswith(f"/runs/{run_id}")
    assert wf.world.get_run(run_id).status == "cancelled"
    cancelled = [e for e in wf.world.list_events(run_id) if e.event_type is EventType.RUN_CANCELLED]
    assert cancelled[0].data == {"reason": "enough"}


def test_authorize_guards_pages_reveals_and_actions(wf: Workflows, worker: LocalWorker) -> None:
    run_id = waiting_on_hook(wf, worker)
    asked: list[str] = []

    def authorize(request: Any, action: str) -> bool:
        asked.append(action)
        header = request.headers.get("Authorization", "")
        return header == "Bearer admin" or (header == "Bearer viewer" and action == "view")

    http = client(wf, authorize=authorize)
    assert http.get(f"{PREFIX}/").status_code == 401
    assert http.get(f"{PREFIX}/runs/{run_id}", headers={"Authorization": "Bearer nobody"}).status_code == 403
    viewer = {"Authorization": "Bearer viewer"}
    page = http.get(f"{PREFIX}/runs/{run_id}", headers=viewer).get_data(as_text=True)
    assert "Cancel run" not in page and ">reveal<" not in page  # the forms follow authorize
    assert http.get(f"{PREFIX}/runs/{run_id}?reveal=hook:1", headers=viewer).status_code == 403
    admin = {"Authorization": "Bearer admin"}
    token = re.search(
        r'name="csrf_token" value="([^"]+)"', http.get(f"{PREFIX}/runs/{run_id}", headers=admin).get_data(as_text=True)
    )
    assert token is not None
    form = {"csrf_token": token.group(1)}
    assert http.post(f"{PREFIX}/runs/{run_id}/cancel", data=form).status_code == 401
    assert http.post(f"{PREFIX}/runs/{run_id}/cancel", data=form, headers=viewer).status_code == 403
    assert wf.world.get_run(run_id).status == "running"
    assert http.post(f"{PREFIX}/runs/{run_id}/cancel", data=form, headers=admin).status_code == 303
    assert wf.world.get_run(run_id).status == "cancelled"
    assert {"view", "reveal_token", "cancel"} <= set(asked)


def test_api_inspector_blueprint_is_the_same_blueprint(wf: Workflows, worker: LocalWorker) -> None:
    run_id = waiting_on_hook(wf, worker)
    app = Flask("api-inspector")
    app.register_blueprint(inspector_blueprint(wf, authorize=lambda request, action: True), url_prefix="/i")
    http = app.test_client()
    token = csrf(http, f"/i/runs/{run_id}")
    assert http.post(f"/i/runs/{run_id}/cancel", data={"csrf_token": token}).status_code == 303


def test_posts_without_a_matching_csrf_token_are_refused(wf: Workflows, worker: LocalWorker) -> None:
    run_id = waiting_on_hook(wf, worker)
    http = client(wf, allow_actions=True)
    cancel = f"{PREFIX}/runs/{run_id}/cancel"
    fresh = client(wf, allow_actions=True)  # never saw a page: no cookie
    assert "cookie is missing" in message(fresh.post(cancel, data={"csrf_token": "x" * 43}).get_data(as_text=True))
    token = csrf(http, f"{PREFIX}/runs/{run_id}")
    for data, headers, why in (
        ({}, {}, "does not match"),
        ({"csrf_token": "y" * 43}, {}, "does not match"),
        ({"csrf_token": token}, {"Origin": "https://evil.example"}, "another origin"),
        ({"csrf_token": token}, {"Origin": "null"}, "another origin"),
    ):
        resp = http.post(cancel, data=data, headers=headers)
        assert resp.status_code == 403 and why in message(resp.get_data(as_text=True)), why
    assert wf.world.get_run(run_id).status == "running"
    assert http.post(cancel, data={"csrf_token": token}, headers={"Origin": "http://localhost"}).status_code == 303


def test_resuming_a_hook_with_bad_json_is_400_and_writes_nothing(wf: Workflows, worker: LocalWorker) -> None:
    run_id = waiting_on_hook(wf, worker)
    http = client(wf, allow_actions=True)
    token = csrf(http, f"{PREFIX}/runs/{run_id}")
    resume = f"{PREFIX}/runs/{run_id}/hooks/hook:1/resume"
    count = wf.world.get_run(run_id).event_count
    for text, why in (
        ("{ok: yes}", "not valid JSON"),
        ("", "empty"),
        ("NaN", "not valid JSON"),
        ("[" * 100_000, "deeper"),
    ):
        resp = http.post(resume, data={"csrf_token": token, "payload": text})
        html = resp.get_data(as_text=True)
        assert resp.status_code == 400 and why in message(html), text[:20]
    assert "{ok: yes}" in http.post(resume, data={"csrf_token": token, "payload": "{ok: yes}"}).get_data(as_text=True)
    assert wf.world.get_run(run_id).event_count == count
    assert http.post(f"{PREFIX}/runs/{run_id}/hooks/hook:9/resume", data={"csrf_token": token}).status_code == 404

    resp = http.post(resume, data={"csrf_token": token, "payload": '{"ok": true, "by": "<i>me</i>"}'})
    assert resp.status_code == 303 and resp.headers["Location"].endswith("#hooks")
    worker.run_until(lambda: bool(wf.world.list_waits(run_id)), timeout=20)
    page = http.get(f"{PREFIX}/runs/{run_id}").get_data(as_text=True)
    assert "&lt;i&gt;me&lt;/i&gt;" in page  # the hook_received payload in the event log
    assert 'class="wait" data-id="wait:1"' in page and "in 59 min" in page  # the sleep and its due time


def test_a_form_body_over_the_limit_is_413_and_writes_nothing(wf: Workflows, worker: LocalWorker) -> None:
    run_id = waiting_on_hook(wf, worker)
    http = client(wf, allow_actions=True)
    token = csrf(http, f"{PREFIX}/runs/{run_id}")
    count = wf.world.get_run(run_id).event_count
    huge = "[" + "1," * 2_000_000 + "1]"
    resp = http.post(f"{PREFIX}/runs/{run_id}/hooks/hook:1/resume", data={"csrf_token": token, "payload": huge})
    assert resp.status_code == 413 and "Too large" in resp.get_data(as_text=True)
    assert wf.world.get_run(run_id).event_count == count


def test_cancelling_an_ended_run_is_409(wf: Workflows, worker: LocalWorker) -> None:
    run = wf.start("greet", "ann")
    worker.run_until_complete(run)
    http = client(wf, allow_actions=True)
    waiting = waiting_on_hook(wf, worker)
    token = csrf(http, f"{PREFIX}/runs/{waiting}")
    resp = http.post(f"{PREFIX}/runs/{run.id}/cancel", data={"csrf_token": token})
    assert resp.status_code == 409 and wf.world.get_run(run.id).status == "completed"
    assert http.post(f"{PREFIX}/runs/nope/cancel", data={"csrf_token": token}).status_code == 404


def test_dead_letters_are_listed_and_redriven_once(wf: Workflows) -> None:
    run = wf.start("greet", "ann")
    (claimed,) = wf.world.claim(["celery"], lease=30)
    store = dead_letter_store(wf.world)
    letter = store.dead_letter(claimed.receipt, reason="rejected", error="<b>unknown task</b>")
    assert letter is not None
    http = client(wf, allow_actions=True)
    page = http.get(f"{PREFIX}/dead-letters").get_data(as_text=True)
    assert f'data-id="{letter.id}"' in page and "workflow.greet" in page and run.id in page
    assert "&lt;b&gt;unknown task&lt;/b&gt;" in page
    assert f'data-id="{letter.id}"' not in http.get(f"{PREFIX}/dead-letters?queue=other").get_data(as_text=True)
    token = csrf(http, f"{PREFIX}/dead-letters")
    resp = http.post(f"{PREFIX}/dead-letters/{letter.id}/redrive", data={"csrf_token": token})
    assert resp.status_code == 303 and f"redriven={letter.id}" in resp.headers["Location"]
    assert "is back on its queue" in http.get(resp.headers["Location"]).get_data(as_text=True)
    assert store.list_dead_letters() == []
    again = http.post(f"{PREFIX}/dead-letters/{letter.id}/redrive", data={"csrf_token": token})
    assert again.status_code == 404  # moved once
    for bad in ("abc", "99999999999999999999"):
        assert http.post(f"{PREFIX}/dead-letters/{bad}/redrive", data={"csrf_token": token}).status_code == 404
    assert [d.run_id for d in wf.world.claim(["celery"], lease=30)] == [run.id]  # back on its queue


# -- the run page and streams ------------------------------------------------------------------------------------------


def test_the_run_page_shows_attempts_events_and_pages_the_log(wf: Workflows, worker: LocalWorker) -> None:
    run_id = waiting_on_hook(wf, worker)
    http = client(wf)
    page = http.get(f"{PREFIX}/runs/{run_id}").get_data(as_text=True)
    step = page.split('data-id="step:wobbly:1"')[1].split("</li>\n  \n")[0]
    assert step.count('class="attempt o-') == 2 and "o-retrying" in step and "o-completed" in step
    assert "2 attempts" in step and "RuntimeError: first attempt fails" in step
    count = wf.world.get_run(run_id).event_count
    slots = re.findall(r'<tr class="event" data-slot="(\d+)"', page)
    assert [int(s) for s in slots] == list(range(1, count + 1))
    later = http.get(f"{PREFIX}/runs/{run_id}?after_slot=3").get_data(as_text=True)
    assert re.findall(r'<tr class="event" data-slot="(\d+)"', later)[0] == "4" and "« earlier" in later


def test_a_run_that_continued_as_new_links_to_its_successor_and_back(wf: Workflows, worker: LocalWorker) -> None:
    run = wf.start("handing_over", 0, run_id="relay")
    worker.run_until_idle()
    http = client(wf)
    first = http.get(f"{PREFIX}/runs/relay").get_data(as_text=True)
    assert f'href="{PREFIX}/runs/relay~1">relay~1</a> (continue_as_new)' in first
    assert "<h2>Output</h2>" not in first  # it handed over: its result is its successor's
    second = http.get(f"{PREFIX}/runs/relay~1").get_data(as_text=True)
    assert "<dt>Continues</dt>" in second and f'href="{PREFIX}/runs/relay">relay</a>' in second
    assert run.result() == 1


def test_the_timeline_shows_a_change_the_run_took(wf: Workflows, worker: LocalWorker) -> None:
    run = wf.start("changed", "ada")
    worker.run_until_complete(run)
    page = client(wf).get(f"{PREFIX}/runs/{run.id}").get_data(as_text=True)
    line = page.split('data-id="patch:greet-by-name"')[1].split("</li>")[0]
    assert "patch" in line and "greet-by-name" in line and "applied" in line
    assert page.index('data-id="patch:greet-by-name"') < page.index('data-id="step:hello:1"')


def test_the_run_page_links_a_parent_and_its_children(wf: Workflows, worker: LocalWorker) -> None:
    run = wf.start("family", ["ada", "bob"], run_id="fam")
    worker.run_until_complete(run)
    page = client(wf).get(f"{PREFIX}/runs/fam").get_data(as_text=True)
    assert "2 child runs" in page
    for n in (1, 2):
        line = page.split(f'data-id="child:{n}"')[1].split("</li>")[0]
        assert f'href="{PREFIX}/runs/fam%21{n}"' in line or f'href="{PREFIX}/runs/fam!{n}"' in line, line
        assert "completed" in line and "changed" in line
    child = client(wf).get(f"{PREFIX}/runs/fam!1").get_data(as_text=True)
    assert f'href="{PREFIX}/runs/fam"' in child and "Parent" in child


def test_the_live_tail_streams_chunks_then_ends(wf: Workflows, worker: LocalWorker) -> None:
    run = wf.start("greet", "ann")
    worker.run_until_complete(run)
    http = client(wf, tail_lifetime=0.3)
    tail = http.get(f"{PREFIX}/runs/{run.id}/streams/progress/tail")
    assert tail.mimetype == "text/event-stream"
    assert sse(tail.get_data(as_text=True)) == [
        ("chunk", "0", {"index": 0, "text": '{\n  "hello": "ann"\n}'}),
        ("end", None, {"reason": "the run has ended"}),
    ]
    resumed = http.get(f"{PREFIX}/runs/{run.id}/streams/progress/tail", headers={"Last-Event-ID": "0"})
    assert [kind for kind, _, _ in sse(resumed.get_data(as_text=True))] == ["end"]  # resumes after the id it saw

    wf.world.write_stream(run.id, "open", [b'j1{"n": 1}', b"b1\xff"])  # a stream nobody closed, bytes too
    open_tail = sse(http.get(f"{PREFIX}/runs/{run.id}/streams/open/tail?start=0").get_data(as_text=True))
    assert [data["text"] for _, _, data in open_tail[:2]] == ['{\n  "n": 1\n}', "bytes (1): /w=="]
    assert open_tail[2] == ("end", None, {"reason": "the run has ended"})

    waiting = waiting_on_hook(wf, worker)
    wf.world.write_stream(waiting, "live", [b"j1" + b'"first"'])
    page = http.get(f"{PREFIX}/runs/{waiting}").get_data(as_text=True)
    assert f'data-tail="{PREFIX}/runs/{waiting}/streams/live/tail?start=1"' in page
    lifetime_ended = http.get(f"{PREFIX}/runs/{waiting}/streams/live/tail?start=1").get_data(as_text=True)
    assert "event: end" not in lifetime_ended  # the answer ended with its lifetime; the browser reconnects


def test_a_long_stream_pages_on_its_own_page_and_tails_from_its_end(wf: Workflows, worker: LocalWorker) -> None:
    run_id = waiting_on_hook(wf, worker)
    wf.world.write_stream(run_id, "long", [b"j1%d" % i for i in range(150)])
    http = client(wf)
    page = http.get(f"{PREFIX}/runs/{run_id}").get_data(as_text=True)
    long = page.split('data-name="long"')[1].split('id="events"')[0]
    shown = RUN_CHUNKS  # the run page shows a stream's first chunks; its own page pages them all
    assert long.count("<li data-index=") == shown and "data-tail=" not in long and f"from #{shown}" in long
    first = http.get(f"{PREFIX}/runs/{run_id}/streams/long").get_data(as_text=True)
    later = re.search(r'<a href="([^"]+)" rel="next">', first)
    assert later is not None and "start=100" in later.group(1)
    rest = http.get(later.group(1)).get_data(as_text=True)
    assert re.findall(r'<li data-index="(\d+)"', rest) == [str(i) for i in range(100, 150)]
    assert f"/runs/{run_id}/streams/long/tail?start=150" in rest and "« earlier" in rest


def test_serving_a_bare_world_resumes_hooks_the_workers_understand(wf: Workflows, worker: LocalWorker) -> None:
    run_id = waiting_on_hook(wf, worker)
    http = make_app(wf.world, allow_actions=True).test_client()
    assert rows(http.get("/").get_data(as_text=True)) == [run_id]
    token = csrf(http, f"/runs/{run_id}")
    resp = http.post(f"/runs/{run_id}/hooks/hook:1/resume", data={"csrf_token": token, "payload": "7"})
    assert resp.status_code == 303
    worker.run_until(lambda: bool(wf.world.list_waits(run_id)), timeout=20)  # the app's worker handled the wake-up


def test_serve_answers_only_loopback_names_when_bound_to_loopback(wf: Workflows) -> None:
    http = make_app(wf, trusted_hosts=["127.0.0.1", "localhost"]).test_client()
    assert http.get("/", headers={"Host": "localhost:8000"}).status_code == 200
    assert http.get("/", headers={"Host": "rebound.example:8000"}).status_code == 400


# -- the AWS World -----------------------------------------------------------------------------------------------------


def test_the_inspector_works_on_the_aws_world(aws: Aws) -> None:
    workflows = Workflows(Celery("inspector-aws"), world=aws.world(), broker="app")
    register(workflows)
    worker = LocalWorker(workflows)
    done = workflows.start("greet", "ann")
    worker.run_until_complete(done, timeout=30)
    run_id = waiting_on_hook(workflows, worker)
    http = client(workflows, allow_actions=True)
    assert rows(http.get(f"{PREFIX}/?status=completed").get_data(as_text=True)) == [done.id]
    page = http.get(f"{PREFIX}/runs/{run_id}").get_data(as_text=True)
    assert TOKEN not in page and "o-retrying" in page
    assert "hello ann" in http.get(f"{PREFIX}/runs/{done.id}").get_data(as_text=True)
    assert http.get(f"{PREFIX}/dead-letters").status_code == 200
    token = csrf(http, f"{PREFIX}/runs/{run_id}")
    assert http.post(f"{PREFIX}/runs/{run_id}/cancel", data={"csrf_token": token}).status_code == 303
    assert workflows.world.get_run(run_id).status == "cancelled"


def test_scheduled_lists_what_the_world_s_queue_holds_until_due(wf: Workflows) -> None:
    """A delivery backed off for 10 minutes waits in the World's queue, not in a worker: the Scheduled page lists it
    with its run (issue #33, item 3)."""
    run = wf.start("greet", "ann")
    (claimed,) = wf.world.claim(["celery"], lease=30)
    wf.world.store.retry_later(claimed.receipt, 600)
    wf.start("greet", "bob")  # due at once: waiting, not scheduled
    http = client(wf)
    page = http.get(f"{PREFIX}/scheduled").get_data(as_text=True)
    assert page.count('class="scheduled-task"') == 1
    assert "workflow.greet" in page and f'href="{PREFIX}/runs/{run.id}"' in page
    assert "nothing scheduled" in http.get(f"{PREFIX}/scheduled?queue=other").get_data(as_text=True)
    assert f'href="{PREFIX}/scheduled"' in http.get(f"{PREFIX}/").get_data(as_text=True)  # in the header


# -- schedules (issue #30, item 3) -------------------------------------------------------------------------------------


def test_the_schedules_page_lists_and_pauses_and_resumes(wf: Workflows) -> None:
    wf.schedule("greet", cron="0 3 * * *", id="nightly", args=["<b>ann</b>"], timezone="Europe/Paris")
    read_only = client(wf)
    page = read_only.get(f"{PREFIX}/schedules").get_data(as_text=True)
    assert 'data-schedule-id="nightly"' in page and "0 3 * * *" in page and "Europe/Paris" in page
    assert "Pause" not in page  # read-only: no forms
    assert read_only.post(f"{PREFIX}/schedules/nightly/pause").status_code == 403
    http = client(wf, allow_actions=True)
    token = csrf(http, f"{PREFIX}/schedules")
    assert http.post(f"{PREFIX}/schedules/nightly/pause").status_code == 403  # no CSRF token
    assert wf.schedules.get("nightly").paused is False
    resp = http.post(f"{PREFIX}/schedules/nightly/pause", data={"csrf_token": token})
    assert resp.status_code == 303 and resp.headers["Location"].endswith("/schedules")
    assert wf.schedules.get("nightly").paused is True
    assert "Resume" in http.get(f"{PREFIX}/schedules").get_data(as_text=True)
    assert http.post(f"{PREFIX}/schedules/nightly/resume", data={"csrf_token": token}).status_code == 303
    assert wf.schedules.get("nightly").paused is False
    assert http.post(f"{PREFIX}/schedules/nope/pause", data={"csrf_token": token}).status_code == 404


def test_the_runs_list_says_what_each_run_in_progress_waits_for(wf: Workflows, worker: LocalWorker) -> None:
    waiting = waiting_on_hook(wf, worker)
    done = wf.start("greet", "bo")
    worker.run_until_idle()
    page = client(wf).get(f"{PREFIX}/").get_data(as_text=True)
    assert "<th>Waiting on</th>" in page and TOKEN not in page
    cells = dict(re.findall(r'data-run-id="([^"]+)".*?<td class="waiting">([^<]*)</td>', page, re.S))
    assert cells[waiting] == "hook hook:1 (token hidden)"
    assert cells[done.id] == ""
