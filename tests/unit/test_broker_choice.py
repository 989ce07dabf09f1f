"""Workflows never replaces an app's broker silently (issue #29, item 1)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from celery import Celery

from celery_workflow import Workflows
from celery_workflow.broker_choice import broker_choice, configured_broker
from celery_workflow.errors import ConfigurationError
from celery_workflow.testing import MemoryWorld
from celery_workflow.world_sqlite import SQLiteWorld


@pytest.fixture
def world(tmp_path: Path) -> SQLiteWorld:
    return SQLiteWorld(tmp_path / "world.db")


def test_an_app_with_a_broker_and_no_choice_is_refused_naming_both_choices() -> None:
    app = Celery("shop", broker="amqp://guest:secret@127.0.0.1:5672//")
    with pytest.raises(ConfigurationError) as refused:
        Workflows(app, MemoryWorld())
    message = str(refused.value)
    assert "'shop' already has a broker (amqp://guest:**@127.0.0.1:5672//)" in message
    assert 'Workflows(app, world, broker="app")' in message
    assert 'Workflows(app, world, broker="world")' in message
    assert "celery -A app workflow relay" in message
    assert "secret" not in message
    assert app.conf.broker_url == "amqp://guest:secret@127.0.0.1:5672//"  # untouched
    assert app.conf.broker_transport is None


def test_a_broker_set_in_the_environment_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")
    with pytest.raises(ConfigurationError, match=r"redis://127\.0\.0\.1:6379/0"):
        Workflows(Celery("env"), MemoryWorld())


def test_without_a_broker_the_world_is_the_default(monkeypatch: pytest.MonkeyPatch, world: SQLiteWorld) -> None:
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)
    wf = Workflows(Celery("bare"), world)
    assert wf.broker == "world"
    assert wf.celery_app.conf.broker_transport == wf.world.broker().transport


def test_broker_app_keeps_the_broker_and_broker_world_replaces_it(world: SQLiteWorld) -> None:
    kept = Workflows(Celery("kept", broker="redis://127.0.0.1:6379/3"), MemoryWorld(), broker="app")
    assert kept.broker == "app"
    assert kept.celery_app.conf.broker_url == "redis://127.0.0.1:6379/3"
    moved = Workflows(Celery("moved", broker="redis://127.0.0.1:6379/3"), world, broker="world")
    assert moved.broker == "world"
    assert moved.celery_app.conf.broker_transport == moved.world.broker().transport


def test_a_second_workflows_on_an_app_a_first_one_configured_is_not_refused(world: SQLiteWorld) -> None:
    app = Celery("twice")
    Workflows(app, world)
    assert configured_broker(app) is None
    assert Workflows(app, world).broker == "world"


def test_configure_broker_is_deprecated_and_mapped(world: SQLiteWorld) -> None:
    with pytest.warns(DeprecationWarning, match=r"broker='app'"):
        assert Workflows(Celery("old", broker="amqp://h//"), MemoryWorld(), configure_broker=False).broker == "app"
    with pytest.warns(DeprecationWarning, match=r"broker='world'"):
        assert Workflows(Celery("old2", broker="amqp://h//"), world, configure_broker=True).broker == "world"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ConfigurationError, match="contradict"):
            broker_choice(Celery("both"), "world", configure_broker=False)


@pytest.mark.parametrize("bad", ["rabbitmq", "", "APP"])
def test_an_unknown_choice_is_refused(bad: str) -> None:
    with pytest.raises(ConfigurationError, match="broker is 'world' or 'app'"):
        Workflows(Celery("bad"), MemoryWorld(), broker=bad)


def test_relay_lease_must_be_positive() -> None:
    with pytest.raises(ConfigurationError, match="relay_lease"):
        Workflows(Celery("lease"), MemoryWorld(), broker="app", relay_lease=0)
