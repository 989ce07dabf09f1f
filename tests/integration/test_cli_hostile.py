"""The command line against what a careful operator mistypes and what hostile data holds (issue #26, items 16 and 13).

* Opening an existing World never creates one: ``--world sqlite:///typo/x.db runs list`` created the directories and
  the file and answered "no runs"; every command but ``migrate`` (and ``demo``) now fails with the path named and
  creates nothing. ``--world ""`` is an error, not the default World.
* Nothing stored reaches the terminal raw: run ids, workflow and step names, inputs, outputs, errors, stream names and
  values, dead letters carry escape sequences (``ESC ] 0 ; title BEL``, ``ESC [ 2 J``, C1 ``CSI``), which ``runs
  show``, ``runs watch``, ``runs list`` and ``dead-letters`` printed as they were; ``--json`` let DEL and C1 through.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from celery_workflow import codec
from celery_workflow.cli import main, workflow
from celery_workflow.cli.text import safe_json, shown
from celery_workflow.events import EventType, NewEvent
from celery_workflow.world import Delivery, NewRun
from celery_workflow.world_sqlite import SQLiteWorld


def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    result = CliRunner().invoke(workflow, list(args), env=env, catch_exceptions=False)
    assert "Traceback" not in result.output
    return result


# -- item 16: opening a World that is not there -------------------------------------------------------------------------

READ_COMMANDS = [
    ("runs", "list"),
    ("runs", "list", "--json"),
    ("runs", "show", "r-1"),
    ("runs", "watch", "r-1"),
    ("runs", "cancel", "r-1"),
    ("dead-letters", "list"),
    ("dead-letters", "show", "1"),
    ("dead-letters", "redrive", "--all"),
    ("dead-letters", "purge", "--all"),
    ("sweep-expired",),
    ("outlive-runs",),
    ("inspector", "--port", "0"),
]


@pytest.mark.parametrize("command", READ_COMMANDS, ids=" ".join)
def test_a_mistyped_sqlite_path_is_an_error_and_creates_nothing(tmp_path: Path, command: tuple[str, ...]) -> None:
    world = tmp_path / "typo" / "x.db"
    result = invoke("--world", f"sqlite:///{world}", *command)
    assert result.exit_code not in (0, None)
    assert str(world) in result.stderr and "does not exist" in result.stderr
    assert "no runs" not in result.stdout
    assert list(tmp_path.iterdir()) == []  # no directory, no file


@pytest.mark.parametrize("command", READ_COMMANDS[:3], ids=" ".join)
def test_a_missing_file_in_an_existing_directory_is_an_error_too(tmp_path: Path, command: tuple[str, ...]) -> None:
    result = invoke("--world", f"sqlite:///{tmp_path / 'x.db'}", *command)
    assert result.exit_code == 2
    assert str(tmp_path / "x.db") in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_sqlite_file_without_a_world_is_not_turned_into_one(tmp_path: Path) -> None:
    """A file that exists but holds no World (another application's database, an empty file) is refused, not
    migrated: reading must never write a schema into someone else's database."""
    import sqlite3

    other = tmp_path / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE accounts (id INTEGER PRIMARY KEY)")
    conn.close()
    result = invoke("--world", f"sqlite:///{other}", "runs", "list")
    assert result.exit_code == 2 and str(other) in result.stderr and "no celery_workflow tables" in result.stderr
    with sqlite3.connect(other) as conn:
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    conn.close()
    assert tables == {"accounts"}


def test_a_prefix_without_tables_in_an_existing_world_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "w.db"
    SQLiteWorld(path).close()
    result = invoke("--world", f"sqlite:///{path}?prefix=typo_", "runs", "list")
    assert result.exit_code == 2 and "'typo_'" in result.stderr


def test_the_default_world_is_not_created_by_reading_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CELERY_WORKFLOW_URL", raising=False)
    result = invoke("runs", "list")
    assert result.exit_code == 2 and "celery_workflow.sqlite3" in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("url", ["", "  "])
def test_an_empty_world_url_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    """Not the default World (it used to fall back to $CELERY_WORKFLOW_URL, else the embedded file)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CELERY_WORKFLOW_URL", f"sqlite:///{tmp_path / 'other.db'}")
    result = invoke("--world", url, "runs", "list")
    assert result.exit_code == 2 and "--world needs a World URL" in result.stderr
    assert list(tmp_path.iterdir()) == []
    out = io.StringIO()
    assert main(["--world", url, "migrate"], out=out) == 2
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("url", ["", "   "])
def test_open_world_refuses_an_empty_url(url: str) -> None:
    from celery_workflow.errors import ConfigurationError
    from celery_workflow.world import open_world

    with pytest.raises(ConfigurationError, match="a World URL is needed"):
        open_world(url)


def test_migrate_creates_a_world_in_an_existing_directory_only(tmp_path: Path) -> None:
    world = tmp_path / "new.db"
    result = invoke("--world", f"sqlite:///{world}", "migrate")
    assert result.exit_code == 0, result.output
    assert f"creating a new SQLite World at {world}" in result.stderr
    assert world.exists()
    assert invoke("--world", f"sqlite:///{world}", "runs", "list").stdout == "no runs\n"  # now it exists
    assert "creating" not in invoke("--world", f"sqlite:///{world}", "migrate").stderr

    missing = tmp_path / "typo" / "x.db"
    result = invoke("--world", f"sqlite:///{missing}", "migrate")
    assert result.exit_code == 2 and str(missing.parent) in result.stderr
    assert not missing.parent.exists()


def test_a_world_the_library_opens_is_still_created(tmp_path: Path) -> None:
    """Creating stays where it is expected: ``Workflows(app)`` / ``SQLiteWorld(path)`` on a new path (the embedded
    default, an app's first start)."""
    path = tmp_path / "data" / "w.db"
    SQLiteWorld(path).close()
    assert path.exists()


# -- item 13: stored data is escaped on the terminal ----------------------------------------------------------------

#: Escape sequences a terminal acts on: set the title (OSC … BEL), clear the screen, C1 CSI, a bell, DEL, a bidi
#: override, a newline that would forge a line of output.
EVIL = "\x1b]0;pwned\x07\x1b[2J\x9b31m\x7f\u202e\nforged line"
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202e]")  # what must never reach the terminal (newline aside)


def no_raw_controls(text: str) -> None:
    found = RAW.findall(text)
    assert not found, f"raw control characters printed: {found!r}"
    assert "forged line" not in text.splitlines() and "\nforged line" not in text


@pytest.fixture
def hostile(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A World whose run, steps, stream and dead letter are full of escape sequences; (its URL, the run id)."""
    url = f"sqlite:///{tmp_path / 'hostile.db'}"
    world = SQLiteWorld.from_url(url)
    run_id = "run-evil"  # run ids are printable (the World checks): everything else is free text
    world.create_run(NewRun(run_id, "flow" + EVIL, {"args": [EVIL], "kwargs": {"k" + EVIL: EVIL}}))
    step = "step" + EVIL
    world.append(
        run_id,
        [
            NewEvent(EventType.RUN_STARTED, None, {}),
            NewEvent(EventType.STEP_CREATED, step, {"step_name": step, "input": {"args": [EVIL], "kwargs": {}}}),
            NewEvent(EventType.STEP_STARTED, step, {}),
        ],
    )
    world.write_stream(run_id, "stream" + EVIL, [codec.dumps(EVIL), codec.dumps({"v" + EVIL: EVIL})])
    error = {"type": "Error" + EVIL, "message": EVIL}
    world.append(run_id, [NewEvent(EventType.RUN_FAILED, None, {"error": error})])
    envelope = {
        "body": "",
        "headers": {"task": "task" + EVIL, "id": "id" + EVIL},
        "properties": {"delivery_info": {}},
    }
    world.store.put("queue" + EVIL, json.dumps(envelope).encode())
    (claim,) = world.store.receive(["queue" + EVIL])
    world.store.dead_letter(claim.receipt, reason="rejected", error=EVIL)
    world.enqueue([Delivery("q", b"{}")])
    world.close()
    yield url, run_id


def test_runs_show_list_and_watch_escape_what_they_print(hostile: tuple[str, str]) -> None:
    url, run_id = hostile
    for args in (("runs", "list"), ("runs", "show", run_id), ("runs", "watch", run_id, "--interval", "0.01")):
        result = invoke("--world", url, *args)
        assert result.exit_code in (0, 1), result.output
        no_raw_controls(result.stdout)
        no_raw_controls(result.stderr)
        assert "\\x1b]0;pwned\\x07" in result.stdout  # shown, escaped
    shown_run = invoke("--world", url, "runs", "show", run_id).stdout
    assert f"workflow  flow{shown(EVIL)}" in shown_run and f"error     Error{shown(EVIL)}: {shown(EVIL)}" in shown_run
    watched = invoke("--world", url, "runs", "watch", run_id).stdout
    assert f"[stream{shown(EVIL)}]" in watched


def test_errors_naming_stored_or_typed_data_are_escaped(hostile: tuple[str, str]) -> None:
    url, run_id = hostile
    result = invoke("--world", url, "runs", "cancel", run_id)  # it has ended: the error names it
    assert result.exit_code == 1
    no_raw_controls(result.stderr)
    result = invoke("--world", url, "runs", "show", "nope" + EVIL)
    assert result.exit_code == 1 and "\\x1b" in result.stderr
    no_raw_controls(result.stderr)


def test_dead_letters_escape_what_they_print(hostile: tuple[str, str]) -> None:
    url, _ = hostile
    listed = invoke("--world", url, "dead-letters", "list")
    assert listed.exit_code == 0 and "\\x1b" in listed.stdout
    no_raw_controls(listed.stdout)
    letter_id = listed.stdout.splitlines()[1].split()[0]
    one = invoke("--world", url, "dead-letters", "show", letter_id)
    assert one.exit_code == 0 and "\\x1b]0;pwned\\x07" in one.stdout
    no_raw_controls(one.stdout)


@pytest.mark.parametrize(
    "args",
    [("runs", "list", "--json"), ("runs", "show", "{run}", "--json"), ("dead-letters", "list", "--json")],
    ids=" ".join,
)
def test_json_output_has_no_raw_control_and_is_the_same_data(hostile: tuple[str, str], args: tuple[str, ...]) -> None:
    url, run_id = hostile
    result = invoke("--world", url, *(a.replace("{run}", run_id) for a in args))
    assert result.exit_code == 0
    no_raw_controls(result.stdout)
    data: Any = json.loads(result.stdout)
    assert any(EVIL in text for text in strings(data))  # the values are exactly what was stored


def strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings(item)


def test_the_escapes() -> None:
    assert shown("a\x1b[2Jb\x9b\x7f\x00\t\n") == "a\\x1b[2Jb\\x9b\\x7f\\x00\\x09\\x0a"
    assert shown("\ud800 é ü 漢 🎉 \\x1b") == "\\ud800 é ü 漢 🎉 \\x1b"  # printable text (a backslash too) as it is
    assert shown("\u202eevil\u2066\u2028") == "\\u202eevil\\u2066\\u2028"
    text = safe_json({"k\x9b": ["\x1b", "\x7f", "\ud800", "é"]})
    assert not RAW.search(text) and "\ud800" not in text
    assert json.loads(text) == {"k\x9b": ["\x1b", "\x7f", "\ud800", "é"]}
