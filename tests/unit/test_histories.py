"""Checked-in histories of real runs (tests/histories/*.json) replay with the current code, and changes that would
break runs in flight are caught: changed workflow code and edited histories raise ReplayDivergence.

Every JSON file in tests/histories is a test case: record new ones with ``python -m tests.histories.record``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from celery_workflow import ReplayDivergence, RunStatus, WorkflowNotFound
from celery_workflow.testing import History, ReplayResult, replay_history
from tests.histories import workflows
from tests.histories.changed import changed

HERE = Path(__file__).resolve().parent.parent / "histories"
HISTORIES = sorted(HERE.glob("*.json"))
#: what a replay of a run in each recorded status produces
REPLAYS_TO = {
    RunStatus.COMPLETED: "completed",
    RunStatus.FAILED: "failed",
    RunStatus.CANCELLED: "suspended",
    RunStatus.RUNNING: "suspended",
}


def load(name: str) -> History:
    return History.load(HERE / f"{name}.json")


def doc(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((HERE / f"{name}.json").read_text(encoding="utf-8"))
    return loaded


def event_of(document: dict[str, Any], event_type: str, nth: int = 0) -> dict[str, Any]:
    found: dict[str, Any] = [e for e in document["events"] if e["event_type"] == event_type][nth]
    return found


# -- the checked-in histories replay -----------------------------------------------------------------------------------


def test_the_histories_cover_every_kind_of_ending() -> None:
    statuses = {History.load(p).status for p in HISTORIES}
    assert statuses == {RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.RUNNING}


@pytest.mark.parametrize("path", HISTORIES, ids=lambda p: p.stem)
def test_a_history_replays_to_its_recorded_result(path: Path) -> None:
    history = History.load(path)
    result = replay_history(workflows.wf, history)
    assert result.status == REPLAYS_TO[history.status]
    end = history.terminal_event
    if history.status is RunStatus.COMPLETED:
        assert end is not None and result.output == end.data["output"]
    if history.status is RunStatus.FAILED:
        assert end is not None and result.error is not None
        assert (result.error["type"], result.error["message"]) == (
            end.data["error"]["type"],
            end.data["error"]["message"],
        )


def test_replaying_writes_nothing_and_runs_no_step(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    for sdef in workflows.wf.registry.steps.values():
        monkeypatch.setattr(sdef, "func", lambda *args, name=sdef.name: calls.append(name))
    for path in HISTORIES:
        replay_history(workflows.wf, History.load(path))
    assert calls == []  # step results come from the log
    assert workflows.wf.world.list_runs().items == []
    assert workflows.world.pending() == []


# -- changed code diverges ---------------------------------------------------------------------------------------------

CHANGES = [
    pytest.param(
        "sequential",
        r"the event log has step_created 'step:reserve:1' at slot 3, but the workflow code now calls "
        r"'step:charge:1' there",
        id="steps-swapped",
    ),
    pytest.param(
        "retrying",
        r"'step:call_flaky_api:1' is called with other arguments than the event log records \(slot 3\): the log has "
        r'\{"args": \["GET /v1/quote\?sku=book"\], "kwargs": \{\}\}, the code now passes \{"args": \["get /v1',
        id="other-step-arguments",
    ),
    pytest.param(
        "sleep_woke",
        r"the event log has wait_created 'wait:1' at slot 6, but the workflow code now calls 'step:stamp:2' there",
        id="sleep-removed-after-waking",
    ),
    pytest.param(
        "sleep_asleep",
        r"the event log has wait_created 'wait:1' at slot 6, but the workflow code now calls 'step:stamp:2' there",
        id="sleep-removed-while-asleep",
    ),
    pytest.param(
        "fan_out",
        r"the workflow code now writes step_created 'step:square:5' with input \{\"args\": \[14\].*which the history "
        r"does not have \(it ends at slot 15 with run_completed\)",
        id="step-added-at-the-end",
    ),
    pytest.param(
        "hook_resumed",
        r"the history records run_completed at slot 6 with output \[\{\"by\": \"ada\".*\"grace\".*\], but the workflow "
        r"code now completes with output \[\{\"by\": \"ada\", \"ok\": true\}\]$",
        id="other-output",
    ),
    pytest.param(
        "step_failed_caught",
        r"the event log has step_created 'step:fallback:1' at slot 8, which the workflow code no longer reaches",
        id="step-failure-no-longer-caught",
    ),
    pytest.param(
        "cancelled",
        r"the workflow code now suspends and writes wait_created 'wait:1', which the history does not have \(it ends "
        r"at slot 7 with run_cancelled\)",
        id="sleep-added-before-a-wait",
    ),
]


@pytest.mark.parametrize(("name", "message"), CHANGES)
def test_changed_workflow_code_diverges(name: str, message: str) -> None:
    history = load(name)
    with pytest.raises(ReplayDivergence, match=message) as info:
        replay_history(changed, history)
    assert info.value.message.startswith(f"history of run {history.run_id} ({history.workflow_name}): ")


def test_a_change_past_where_a_run_at_rest_got_to_is_safe() -> None:
    # fan_out_waiting is waiting on its parallel steps: the step the changed code adds after them is still ahead
    assert replay_history(changed, load("fan_out_waiting")) == ReplayResult("suspended")


# -- edited histories diverge ------------------------------------------------------------------------------------------


def test_an_edited_output_diverges() -> None:
    edited = doc("sequential")
    event_of(edited, "run_completed")["data"]["output"]["total"] = 1
    with pytest.raises(
        ReplayDivergence, match=r"the history records run_completed at slot 9 with output \{.*\"total\": 1\}"
    ) as info:
        replay_history(workflows.wf, History.from_json(edited))
    assert '"total": 6900' in info.value.message  # what the code returns


def test_an_edited_step_result_diverges() -> None:
    edited = doc("sequential")
    event_of(edited, "step_completed")["data"]["result"] = 99  # reserve's count: the code returns it
    with pytest.raises(
        ReplayDivergence,
        match=r"output \{.*\"count\": 3.*but the workflow code now completes with output \{.*\"count\": 99",
    ):
        replay_history(workflows.wf, History.from_json(edited))


def test_an_edited_error_diverges() -> None:
    edited = doc("failed")
    event_of(edited, "run_failed")["data"]["error"]["message"] = "step ship failed: something else"
    with pytest.raises(
        ReplayDivergence,
        match=r"records run_failed at slot 9 with celery_workflow.errors.StepFailed: step ship failed: something else,"
        r" but the workflow code now fails with celery_workflow.errors.StepFailed: step ship failed: .*no carrier",
    ):
        replay_history(workflows.wf, History.from_json(edited))


def test_an_edited_step_input_diverges() -> None:
    edited = doc("sequential")
    event_of(edited, "step_created")["data"]["input"]["args"][1][0]["qty"] = 3
    with pytest.raises(ReplayDivergence, match=r"'step:reserve:1' is called with other arguments.*\(slot 3\)"):
        replay_history(workflows.wf, History.from_json(edited))


def test_a_completed_history_cut_before_its_end_diverges() -> None:
    cut = doc("sequential")
    cut["events"] = cut["events"][:-1]  # as if the run were still at rest: the code now completes it
    with pytest.raises(
        ReplayDivergence, match=r"records a run at rest after slot 8 \(step_completed 'step:charge:1'\), but the "
    ):
        replay_history(workflows.wf, History.from_json(cut))


def test_a_history_of_another_workflow_is_refused() -> None:
    renamed = doc("sequential")
    renamed["run"]["workflow_name"] = renamed["events"][0]["data"]["workflow_name"] = "gone"
    with pytest.raises(WorkflowNotFound, match="gone"):
        replay_history(workflows.wf, History.from_json(renamed))


def test_a_run_that_never_started_is_refused() -> None:
    created = doc("sequential")
    created["events"] = created["events"][:1]
    with pytest.raises(ValueError, match="never started"):
        replay_history(workflows.wf, History.from_json(created))


# -- the file format ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", HISTORIES, ids=lambda p: p.stem)
def test_the_json_format_round_trips(path: Path, tmp_path: Path) -> None:
    history = History.load(path)
    assert History.from_json(history.to_json()) == history
    history.dump(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_text(encoding="utf-8") == path.read_text(encoding="utf-8")
    assert History.load(tmp_path / "again.json") == history


def test_from_world_reads_a_run_and_shares_nothing() -> None:
    from celery import Celery

    from celery_workflow import Workflows
    from celery_workflow.testing import LocalWorker, MemoryWorld

    wf = Workflows(Celery("from-world"), world=MemoryWorld(), broker="app")

    @wf.step
    def double(x: int) -> int:
        return 2 * x

    @wf.workflow
    def twice(x: int) -> int:
        return double(double(x))

    run = twice.start(3, run_id="from-world")
    LocalWorker(wf).run_until_complete(run)
    history = History.from_world(wf.world, run.id)
    assert (history.run_id, history.workflow_name, history.input) == (
        "from-world",
        "twice",
        {"args": [3], "kwargs": {}},
    )
    assert history.events == run.events() and history.status is RunStatus.COMPLETED
    assert replay_history(wf, history) == ReplayResult("completed", 12)
    exported = history.to_json()
    exported["events"][0]["data"]["input"]["args"][0] = 4
    assert history.input == {"args": [3], "kwargs": {}} and history.events[0].data["input"]["args"] == [3]


def test_an_unknown_format_version_is_refused(tmp_path: Path) -> None:
    newer = doc("sequential")
    newer["format"] = 2
    with pytest.raises(ValueError, match="unsupported history format 2: this celery_workflow reads format 1"):
        History.from_json(newer)
    path = tmp_path / "newer.json"
    path.write_text(json.dumps(newer), encoding="utf-8")
    with pytest.raises(ValueError, match=r"newer.json: unsupported history format 2"):
        History.load(path)


def _without(key: str) -> Any:
    def edit(d: dict[str, Any]) -> None:
        del d["run"][key]

    return edit


def _set_event(index: int, key: str, value: Any) -> Any:
    def edit(d: dict[str, Any]) -> None:
        d["events"][index][key] = value

    return edit


MALFORMED = [
    pytest.param(lambda d: d.pop("format"), r"unsupported history format None", id="no-format"),
    pytest.param(lambda d: d.pop("run"), r"history.run must be a JSON object", id="no-run"),
    pytest.param(_without("run_id"), r"history.run.run_id must be a non-empty string", id="no-run-id"),
    pytest.param(_without("input"), r"history.run needs 'input'", id="no-input"),
    pytest.param(lambda d: d.update(events={}), r"history.events must be a list", id="events-not-a-list"),
    pytest.param(lambda d: d.update(events=[]), r"no events", id="no-events"),
    pytest.param(_set_event(2, "slot", 7), r"event 3 has slot 7", id="slot-gap"),
    pytest.param(_set_event(2, "slot", "3"), r"history.events\[2\].slot must be an integer", id="slot-not-int"),
    pytest.param(_set_event(1, "event_type", "run_paused"), r"unknown event type 'run_paused'", id="unknown-type"),
    pytest.param(_set_event(1, "created_at", "yesterday"), r"events\[1\].created_at: Invalid", id="bad-time"),
    pytest.param(
        _set_event(1, "created_at", "2025-01-06T09:00:00"), r"events\[1\].created_at: naive datetime", id="naive-time"
    ),
    pytest.param(_set_event(1, "data", []), r"events\[1\].data must be a JSON object", id="data-not-object"),
    pytest.param(_set_event(1, "correlation_id", 5), r"correlation_id must be a string or null", id="bad-cid"),
    pytest.param(
        lambda d: d["run"].update(workflow_name="other"), r"disagree with run_created", id="run-disagrees-with-log"
    ),
    pytest.param(lambda d: d["events"].pop(0), r"event 1 has slot 2", id="first-slot-missing"),
    pytest.param(
        _set_event(0, "event_type", "run_started"), r"slot 1 is run_started, not run_created", id="no-created"
    ),
]


@pytest.mark.parametrize(("edit", "message"), MALFORMED)
def test_a_malformed_history_is_refused(edit: Any, message: str) -> None:
    document = doc("sequential")
    edit(document)
    with pytest.raises(ValueError, match=message):
        History.from_json(document)


def test_a_file_that_is_not_json_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{"format": 1, "run": ', encoding="utf-8")
    with pytest.raises(ValueError, match=r"broken.json: Expecting value"):
        History.load(path)
    with pytest.raises(ValueError, match="the history must be a JSON object"):
        History.from_json([1, 2])
