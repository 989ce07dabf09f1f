"""AWS's sizing rules (DynamoDB units, SQS requests) and the update expressions the cost counter applies."""

from __future__ import annotations

from typing import Any

import pytest

from celery_workflow._aws.billing import (
    index_entry,
    index_write_units,
    message_payload,
    query_read_units,
    read_units,
    sqs_requests,
    write_units,
)
from celery_workflow._aws.expressions import ExpressionError, apply_update
from celery_workflow._aws.items import item_size, number_size
from celery_workflow.errors import CeleryWorkflowError


def s(text: str) -> dict[str, str]:
    return {"S": text}


# -- item sizes ------------------------------------------------------------------------------------------------------


def test_an_item_is_its_attribute_names_plus_values() -> None:
    assert item_size({"pk": s("RUN#1"), "sk": s("META")}) == 2 + 5 + 2 + 4
    assert item_size({"name": s("é")}) == 4 + 2  # UTF-8 bytes
    assert item_size({"b": {"B": b"\x00" * 10}}) == 1 + 10
    assert item_size({"ok": {"BOOL": True}, "no": {"NULL": True}}) == 2 + 1 + 2 + 1
    # a map: 3 bytes, plus per element its key, its value and 1 byte
    assert item_size({"m": {"M": {"a": s("xy")}}}) == 1 + 3 + (1 + 2 + 1)
    assert item_size({"l": {"L": [s("a"), s("bc")]}}) == 1 + 3 + (1 + 1) + (2 + 1)
    assert item_size({"ss": {"SS": ["a", "bc"]}}) == 2 + 3


@pytest.mark.parametrize(
    ("number", "size"),
    [("0", 1), ("7", 2), ("12", 2), ("123", 3), ("1000", 2), ("0.001", 2), ("-12.5", 3), ("1" * 38, 20), ("1e5", 2)],
)
def test_numbers_take_a_byte_per_two_significant_digits_plus_one(number: str, size: int) -> None:
    assert number_size(number) == size


def test_an_unknown_attribute_type_is_refused() -> None:
    with pytest.raises(ValueError):
        item_size({"x": {"Q": "?"}})


# -- DynamoDB units --------------------------------------------------------------------------------------------------


def test_writes_cost_a_unit_per_started_kb_of_the_larger_version() -> None:
    assert write_units(0) == 1  # a delete of nothing, a tiny item: the minimum
    assert write_units(1024) == 1
    assert write_units(1025) == 2
    assert write_units(3000) == 3
    assert write_units(500, 2100) == 3  # an update that grew the item: the size after
    assert write_units(2100, 500) == 3  # one that shrank it: the size before
    assert write_units(1025, transactional=True) == 4


def test_reads_cost_a_unit_per_started_4kb_halved_when_eventual_doubled_in_a_transaction() -> None:
    assert read_units(0, consistent=True) == 1  # no item: still the minimum
    assert read_units(4096, consistent=True) == 1
    assert read_units(4097, consistent=True) == 2
    assert read_units(4097, consistent=False) == 1
    assert read_units(100, consistent=False) == 0.5
    assert read_units(4097, consistent=True, transactional=True) == 4


def test_a_query_page_rounds_the_sum_of_its_items_once() -> None:
    assert query_read_units([1000] * 10, consistent=True) == 3  # 10,000 bytes: 3 blocks (not 10)
    assert query_read_units([], consistent=True) == 1
    assert query_read_units([1000] * 10, consistent=False) == 1.5


def test_index_entries_hold_the_keys_and_the_projection() -> None:
    item = {"pk": s("RUN#1"), "sk": s("META"), "list_pk": s("RUNS"), "list_sk": s("1#1"), "status": s("running")}
    item["output"] = {"B": b"x" * 5000}
    entry = index_entry(item, ("pk", "sk"), ("list_pk", "list_sk"), ("status",))
    assert entry is not None and set(entry) == {"pk", "sk", "list_pk", "list_sk", "status"}
    assert index_entry(item, ("pk", "sk"), ("list_pk", "list_sk"), None) == item  # ALL
    assert index_entry({"pk": s("E"), "sk": s("EVENT#1")}, ("pk", "sk"), ("list_pk", "list_sk"), ()) is None


def test_index_writes_follow_what_changed_in_the_entry() -> None:
    keys = ("list_pk", "list_sk")
    old = {"pk": s("RUN#1"), "list_pk": s("RUNS"), "list_sk": s("1"), "status": s("running")}
    assert index_write_units(None, None, keys) == 0  # not in the index
    assert index_write_units(None, old, keys) == 1  # a new entry
    assert index_write_units(old, None, keys) == 1  # a removed one
    assert index_write_units(old, dict(old), keys) == 0  # nothing projected changed
    assert index_write_units(old, {**old, "status": s("completed")}, keys) == 1  # a projected attribute changed
    assert index_write_units(old, {**old, "list_sk": s("2")}, keys) == 2  # the key moved: delete and put
    assert index_write_units(None, {**old, "status": s("x" * 2000)}, keys) == 2  # per started KB, never doubled


def test_sqs_bills_a_request_per_started_64kb() -> None:
    assert sqs_requests(0) == 1
    assert sqs_requests(64 * 1024) == 1
    assert sqs_requests(64 * 1024 + 1) == 2
    assert sqs_requests(256 * 1024) == 4
    attributes = {
        "kind": {"DataType": "String", "StringValue": "abc"},
        "b": {"DataType": "Binary", "BinaryValue": b"12"},
    }
    assert message_payload("hello", attributes) == 5 + (4 + 6 + 3) + (1 + 6 + 2)


# -- update expressions ----------------------------------------------------------------------------------------------


def test_set_remove_add_and_delete_change_the_item_as_dynamodb_would() -> None:
    item: dict[str, Any] = {
        "pk": s("RUN#1"),
        "claim": {"N": "1"},
        "hooks": {"M": {"hook:1": s("t1")}},
        "tags": {"SS": ["a", "b"]},
        "gone": s("x"),
    }
    after = apply_update(
        item,
        "SET #c = #c + :one, #h.#k = :tok, log = list_append(if_not_exists(log, :empty), :more) REMOVE gone, #h.#old"
        " ADD visits :two, tags :c DELETE tags :a",
        {"#c": "claim", "#h": "hooks", "#k": "hook:2", "#old": "hook:1"},
        {
            ":one": {"N": "1"},
            ":tok": s("t2"),
            ":empty": {"L": []},
            ":more": {"L": [s("e")]},
            ":two": {"N": "2"},
            ":c": {"SS": ["c"]},
            ":a": {"SS": ["a"]},
        },
    )
    assert after == {
        "pk": s("RUN#1"),
        "claim": {"N": "2"},
        "hooks": {"M": {"hook:2": s("t2")}},
        "tags": {"SS": ["b", "c"]},
        "log": {"L": [s("e")]},
        "visits": {"N": "2"},
    }
    assert item["claim"] == {"N": "1"}  # the input is not changed


def test_arithmetic_keeps_decimals_and_a_new_item_starts_from_its_key() -> None:
    assert apply_update({"n": {"N": "1.5"}}, "SET n = n - :d", None, {":d": {"N": "0.25"}}) == {"n": {"N": "1.25"}}
    assert apply_update(None, "SET a = :v", None, {":v": s("x")}) == {"a": s("x")}
    assert apply_update({"l": {"L": [s("a"), s("b")]}}, "REMOVE l[0]") == {"l": {"L": [s("b")]}}
    assert apply_update({"l": {"L": [s("a")]}}, "SET l[5] = :v", None, {":v": s("z")}) == {"l": {"L": [s("a"), s("z")]}}


@pytest.mark.parametrize(
    ("expression", "names", "values"),
    [
        ("UPSERT a = :v", None, {":v": s("x")}),  # no such action
        ("SET a = :missing", None, {}),
        ("SET #a = :v", None, {":v": s("x")}),  # #a not named
        ("SET a = b + :v", None, {":v": {"N": "1"}}),  # b does not exist
        ("SET a = size(b)", None, {}),  # a function we do not model
        ("SET a.b = :v", None, {":v": s("x")}),  # a is not a map
    ],
)
def test_what_is_not_modelled_says_so(expression: str, names: Any, values: Any) -> None:
    with pytest.raises(ExpressionError) as caught:
        apply_update({}, expression, names, values)
    assert isinstance(caught.value, CeleryWorkflowError)
