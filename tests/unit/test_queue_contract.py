"""The queue contract is one set of layered protocols (issue #28, item 3), and every store implements its layers."""

from __future__ import annotations

import inspect
from typing import Any, cast

import pytest

from celery_workflow import dead_letters, world
from celery_workflow._aws.broker_store import SQSBrokerStore
from celery_workflow._aws.world import AWSWorld
from celery_workflow._backend import base, queue_contract
from celery_workflow._backend.queue_contract import (
    BrokerStore,
    ControlStore,
    DeadLetterStore,
    ExpiringStore,
    QueueBrokerStore,
    QueueStore,
    Receipts,
    WorldQueue,
)
from celery_workflow._postgres.queue import PostgresQueue
from celery_workflow._redis.store import RedisStore
from celery_workflow._sqlite.queue import SQLiteQueue
from celery_workflow.errors import WorldError
from celery_workflow.testing.memory import MemoryWorld
from celery_workflow.transport import store


def members(protocol: type) -> set[str]:
    return {
        name
        for klass in protocol.__mro__
        if klass not in (object,) and klass.__module__ != "typing"
        for name in [*vars(klass), *vars(klass).get("__annotations__", {})]
        if not name.startswith("_")
    }


def test_each_layer_adds_to_the_one_below() -> None:
    assert members(Receipts) == {"ack", "release", "retry_later", "extend"}
    assert members(Receipts) < members(WorldQueue) < members(QueueStore) < members(QueueBrokerStore)
    assert members(DeadLetterStore) < members(QueueStore)
    assert members(Receipts) < members(BrokerStore) < members(QueueBrokerStore)
    assert members(BrokerStore) < members(ExpiringStore)
    assert members(BrokerStore) < members(ControlStore)
    assert members(ControlStore) - members(BrokerStore) == {"on_change", "due_times", "queue_info", "close"}


def test_the_world_protocol_is_a_world_queue() -> None:
    assert WorldQueue in world.World.__mro__
    queue_methods = {"enqueue", "claim", "ack", "release", "retry_later", "extend"}
    assert queue_methods == members(WorldQueue)
    assert not queue_methods & set(vars(world.World)), "the World protocol declares its queue methods again"


def test_the_old_names_are_the_contract() -> None:
    assert dead_letters.DeadLetterStore is DeadLetterStore
    assert base.QueueStore is QueueStore
    assert (store.BrokerStore, store.ExpiringStore, store.BindingRow) == (
        BrokerStore,
        ExpiringStore,
        queue_contract.BindingRow,
    )


def _conforms(klass: type, protocol: type) -> list[str]:
    """What ``klass`` lacks of ``protocol``: a member, or a parameter (name and kind); parameters it adds must have
    defaults."""
    wrong = []
    for name in sorted(members(protocol)):
        if name == "expires_messages":
            if getattr(klass, name, None) is not True:
                wrong.append(f"{name} is not True")
            continue
        if not hasattr(protocol, name):  # an attribute the protocol only annotates: the class declares it too
            if not any(name in vars(k).get("__annotations__", {}) for k in klass.__mro__):
                wrong.append(f"no {name} attribute")
            continue
        mine = getattr(klass, name, None)
        if mine is None:
            wrong.append(f"no {name}")
            continue
        theirs = getattr(protocol, name)
        if isinstance(theirs, property):
            continue
        have = dict(inspect.signature(mine).parameters)
        for param in inspect.signature(theirs).parameters.values():
            got = have.pop(param.name, None)
            if got is None or got.kind != param.kind:
                wrong.append(f"{name}({param.name})")
        wrong += [f"{name}({p.name}) without a default" for p in have.values() if p.default is inspect.Parameter.empty]
    return wrong


STORES: list[tuple[type, tuple[type, ...]]] = [
    (SQLiteQueue, (QueueBrokerStore, ExpiringStore)),
    (PostgresQueue, (QueueBrokerStore, ExpiringStore)),
    (RedisStore, (QueueBrokerStore, ControlStore)),
    (SQSBrokerStore, (BrokerStore,)),
    (MemoryWorld, (WorldQueue,)),
]


@pytest.mark.parametrize(("klass", "layers"), STORES, ids=[k.__name__ for k, _ in STORES])
def test_every_store_implements_its_layers(klass: type, layers: tuple[Any, ...]) -> None:
    assert [f"{layer.__name__}: {w}" for layer in layers for w in _conforms(klass, layer)] == []


def test_the_sqs_store_refuses_a_control_receipt_without_a_control_channel() -> None:
    """The SQS store's control channel is typed by the contract (``ControlStore | None``): a control message's receipt
    on a store without one is a WorldError, not an AttributeError on None."""
    sqs = SQSBrokerStore(cast(AWSWorld, object()), wait=1)  # no AWS call: only the control channel is asked
    for settle in (sqs.ack, sqs.release, lambda r: sqs.retry_later(r, 1.0), lambda r: sqs.extend([r], 10.0)):
        with pytest.raises(WorldError, match="no control channel"):
            settle("ctl|1.1")


def test_the_sql_queues_are_composed_not_chained() -> None:
    """SQLiteQueue and PostgresQueue hold their parts (deliveries, dead letters, broker state; standing claims and
    notifications on Postgres) and hand the contract's calls to them: no part inherits from another."""
    from celery_workflow._backend.composed import ComposedQueue
    from celery_workflow._postgres import broker_state as pg_state
    from celery_workflow._postgres import changes, deliveries, letters, standing
    from celery_workflow._sqlite import broker_state as sqlite_state
    from celery_workflow._sqlite import deliveries as sqlite_deliveries
    from celery_workflow._sqlite import letters as sqlite_letters

    for queue in (SQLiteQueue, PostgresQueue):
        assert queue.__mro__[1:] == (ComposedQueue, object)
    parts = [
        pg_state.BrokerState,
        changes.Changes,
        deliveries.Deliveries,
        letters.DeadLetters,
        standing.StandingClaims,
        sqlite_state.BrokerState,
        sqlite_deliveries.Deliveries,
        sqlite_letters.DeadLetters,
    ]
    assert [part.__name__ for part in parts if part.__mro__[1:] != (object,)] == []
