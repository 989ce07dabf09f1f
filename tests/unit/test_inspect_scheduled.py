"""``inspect scheduled`` on our transports (issue #33, item 3): the command replaces Celery's by name, delegates to it
on other transports, and adds the store's delayed messages in Celery's reply shape (the real thing on real workers:
``tests/acceptance/test_plain_celery.py``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery.worker import control

from celery_workflow._backend.broker import QueuedMessage
from celery_workflow.transport import scheduled


@pytest.fixture
def panel() -> Iterator[None]:
    saved, meta = dict(control.Panel.data), dict(control.Panel.meta)
    # start from Celery's own command: an embedded worker earlier in this process may have installed ours for good
    control.Panel.data["scheduled"] = control.Panel.data["dump_schedule"] = control.scheduled
    try:
        yield
    finally:
        control.Panel.data.clear()
        control.Panel.data.update(saved)
        control.Panel.meta.clear()
        control.Panel.meta.update(meta)


def _message(task_id: str, due: float, queue: str = "celery") -> QueuedMessage:
    payload = {
        "body": "",
        "headers": {"id": task_id, "task": "app.add", "argsrepr": "(1, 2)", "kwargsrepr": "{}"},
        "properties": {"priority": 3, "delivery_info": {"exchange": "", "routing_key": queue}},
    }
    return QueuedMessage(1, queue, None, 0, due, None, None, None, json.dumps(payload).encode())


class Store:
    def __init__(self, messages: list[QueuedMessage]) -> None:
        self.messages = messages
        self.asked: list[tuple[list[str], int]] = []

    def delayed(self, queues: list[str], *, limit: int) -> list[QueuedMessage]:
        self.asked.append((queues, limit))
        return [m for m in self.messages if m.queue in queues][:limit]


def test_install_replaces_the_command_and_its_alias_by_name_once(panel: None) -> None:
    original = control.Panel.data["scheduled"]
    scheduled.install()
    ours = control.Panel.data["scheduled"]
    assert ours is not original and control.Panel.data["dump_schedule"] is ours
    assert control.Panel.meta["scheduled"].type == "inspect"
    scheduled.install()
    assert control.Panel.data["scheduled"] is ours  # not wrapped twice


def test_on_another_transport_the_answer_is_celerys(panel: None) -> None:
    scheduled.install()
    timer = SimpleNamespace(schedule=SimpleNamespace(queue=[]))
    state = SimpleNamespace(consumer=SimpleNamespace(timer=timer, connection=None), hostname="w@h")
    assert control.Panel.data["scheduled"](state) == []


def test_the_store_s_delayed_messages_in_celery_s_reply_shape() -> None:
    store = Store([_message("t1", 1_800_000_060.0), _message("t2", 1_800_000_090.0, queue="other")])
    (entry,) = scheduled.delayed_requests(store, ["celery"], "w1@h")
    assert store.asked == [(["celery"], scheduled.LIMIT)]
    assert entry["eta"] == "2027-01-15T08:01:00+00:00"
    assert entry["priority"] == 3 and entry["held_by"] == "store"
    request: dict[str, Any] = entry["request"]
    assert (request["id"], request["name"], request["args"], request["kwargs"]) == ("t1", "app.add", "(1, 2)", "{}")
    assert request["hostname"] == "w1@h" and request["acknowledged"] is False
    assert request["delivery_info"]["routing_key"] == "celery"
    assert scheduled.delayed_requests(object(), ["celery"], "w1@h") == []  # a store that cannot list them
