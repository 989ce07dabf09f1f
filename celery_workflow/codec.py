"""Payloads: JSON values with a format tag, typed by the functions' hints.

Arguments, results, hook payloads and stream values are stored as JSON. Dataclasses, pydantic models, datetimes,
UUIDs, enums, sets and tuples are turned into JSON on the way in; on the way out a value is rebuilt to the type its
function declares (a parameter's or a return annotation), through pydantic's validators. A value with no hint comes
back as plain JSON. Anything that cannot be represented raises :class:`~celery_workflow.errors.PayloadError`.

Blobs (event data, stream chunks) are ``b"j1"`` + UTF-8 JSON; stream chunks may also be ``b"b1"`` + raw bytes.

Sizes: an event's encoded data is at most :data:`MAX_PAYLOAD_BYTES` on every World (``rules.validate``); one value
in it (a step's result, a run's output, an input, a hook payload) is at most the World's own ``max_payload``
(:attr:`celery_workflow.world.World.max_payload`), which the runtime checks with :func:`check_size` where the value
is produced. A recorded error keeps its message to :data:`MAX_ERROR_MESSAGE` bytes and its traceback to
:data:`MAX_TRACEBACK` bytes (UTF-8), cut by :func:`cut` with a ``… [truncated N bytes]`` marker.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from typing import Any, get_type_hints

from pydantic import TypeAdapter, ValidationError
from pydantic_core import PydanticSerializationError, to_jsonable_python

from celery_workflow.errors import PayloadError, PayloadTooLarge

JSON_TAG = b"j1"
BYTES_TAG = b"b1"

#: The largest encoded event data any World accepts (a DynamoDB item holds 400 KB; leave room for the rest of the
#: item). A World's ``max_payload`` (the limit on one value) is at most this, less room for the event's other fields.
MAX_PAYLOAD_BYTES = 350_000
#: Room an event keeps beside its value (field names, a step or workflow name, flags) within MAX_PAYLOAD_BYTES.
EVENT_ROOM = 4 * 1024
#: The longest recorded error message, in UTF-8 bytes (the head is kept).
MAX_ERROR_MESSAGE = 8 * 1024
#: The longest recorded traceback, in UTF-8 bytes (the tail, with the raising frame, is kept).
MAX_TRACEBACK = 32 * 1024
#: The longest recorded error type name, in UTF-8 bytes.
MAX_ERROR_TYPE = 512
#: An upper bound on a recorded error's text (type, message, traceback), before JSON escapes.
MAX_ERROR_BYTES = MAX_ERROR_TYPE + MAX_ERROR_MESSAGE + MAX_TRACEBACK

_ANY: Any = object()


def _reject_floats(value: Any) -> None:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        raise PayloadError(f"cannot encode non-finite float {value!r} as JSON")


def to_json(value: Any) -> Any:
    """A JSON-compatible copy of ``value`` (dataclasses, models, datetimes … converted)."""
    try:
        out = to_jsonable_python(value, serialize_unknown=False)
    except (PydanticSerializationError, TypeError, ValueError) as exc:
        raise PayloadError(f"cannot encode a value of type {type(value).__name__} as JSON: {exc}") from exc
    _check_json(out)
    return out


def _check_json(value: Any) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise PayloadError(f"JSON object keys must be strings, got {type(k).__name__}")
            _check_json(v)
    elif isinstance(value, list):
        for v in value:
            _check_json(v)
    elif value is None or isinstance(value, (str, int, bool)):
        return
    elif isinstance(value, float):
        _reject_floats(value)
    else:
        raise PayloadError(f"cannot encode a value of type {type(value).__name__} as JSON")


@lru_cache(maxsize=1024)
def _adapter(hint: Any) -> TypeAdapter[Any]:
    return TypeAdapter(hint)


def from_json(value: Any, hint: Any = _ANY) -> Any:
    """Rebuild ``value`` (plain JSON) as ``hint``; without a hint, return it unchanged."""
    if hint is _ANY or hint is Any or hint is inspect.Parameter.empty or (hint is None and value is None):
        return value
    try:
        return _adapter(hint).validate_python(value)
    except ValidationError as exc:
        raise PayloadError(f"stored value does not match type {hint!r}: {exc}") from exc
    except (TypeError, ValueError) as exc:  # unhashable or unsupported hints
        raise PayloadError(f"cannot decode into type {hint!r}: {exc}") from exc


#: The compact, strict JSON of every stored value (an encoder keeps no state between calls; building one per call,
#: as ``json.dumps`` with options does, costs a third of a small value's encoding).
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)
_DECODER = json.JSONDecoder()


def dumps(value: Any, *, limit: int = MAX_PAYLOAD_BYTES) -> bytes:
    """Tagged JSON bytes of an already JSON-compatible value."""
    try:
        raw = _ENCODER.encode(value).encode()
    except (TypeError, ValueError) as exc:
        raise PayloadError(f"cannot encode value as JSON: {exc}") from exc
    if len(raw) > limit:
        raise PayloadTooLarge(f"payload of {len(raw)} bytes exceeds the limit of {limit} bytes")
    return JSON_TAG + raw


def encoded_size(value: Any) -> int:
    """The bytes of ``value``'s JSON encoding (an already JSON-compatible value), as :func:`dumps` stores it."""
    try:
        raw = _ENCODER.encode(value).encode()
    except (TypeError, ValueError) as exc:
        raise PayloadError(f"cannot encode value as JSON: {exc}") from exc
    return len(raw)


def check_size(value: Any, limit: int, what: str = "payload") -> None:
    """PayloadTooLarge unless ``value`` (JSON-compatible) encodes to at most ``limit`` bytes."""
    size = encoded_size(value)
    if size > limit:
        raise PayloadTooLarge(f"{what} is {size} bytes encoded; the World stores at most {limit} bytes (max_payload)")


def cut(text: str, limit: int, *, keep_end: bool = False) -> str:
    """``text`` in at most ``limit`` UTF-8 bytes: unchanged when it fits, else its head (or, with ``keep_end``, its
    tail) and a marker ``… [truncated N bytes]`` saying how many of its bytes were left out."""
    raw = text.encode("utf-8", "replace")
    if len(raw) <= limit:
        return text
    room = max(0, limit - len(f"… [truncated {len(raw)} bytes]".encode()))
    kept = (raw[len(raw) - room :] if keep_end else raw[:room]).decode("utf-8", "ignore")
    marker = f"… [truncated {len(raw) - len(kept.encode())} bytes]"
    return marker + kept if keep_end else kept + marker


def loads(blob: bytes | memoryview) -> Any:
    data = bytes(blob)
    if data[:2] == JSON_TAG:
        return _DECODER.decode(data[2:].decode())
    if data[:2] == BYTES_TAG:
        return data[2:]
    raise PayloadError(f"unknown payload format tag {data[:2]!r}")


def dumps_chunk(value: Any, *, limit: int = MAX_PAYLOAD_BYTES) -> bytes:
    """A stream chunk: raw bytes stay bytes, anything else is JSON."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        if len(raw) > limit:
            raise PayloadTooLarge(f"stream chunk of {len(raw)} bytes exceeds the limit of {limit} bytes")
        return BYTES_TAG + raw
    return dumps(to_json(value), limit=limit)


# -- function signatures ---------------------------------------------------------------------------------------------


class Signature:
    """What the codec needs of a workflow or step function: its parameters' and return type hints."""

    def __init__(self, func: Callable[..., Any]) -> None:
        self.func = func
        self.signature = inspect.signature(func)
        try:
            hints = get_type_hints(func)
        except Exception:  # unresolved forward references: fall back to plain JSON
            hints = {}
        self.params: dict[str, Any] = {name: hints.get(name, _ANY) for name in self.signature.parameters}
        self.returns: Any = hints.get("return", _ANY)

    def encode_args(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        try:
            self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise PayloadError(f"{self.func.__qualname__}: {exc}") from exc
        return {"args": to_json(list(args)), "kwargs": to_json(dict(kwargs))}

    def decode_args(self, data: Mapping[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        raw_args = list(data.get("args", []))
        raw_kwargs = dict(data.get("kwargs", {}))
        names = list(self.signature.parameters.values())
        args: list[Any] = []
        for i, value in enumerate(raw_args):
            if i < len(names) and names[i].kind in (
                inspect.Parameter.POSITIONAL_ONLY,
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
            ):
                args.append(from_json(value, self.params[names[i].name]))
            else:
                var = next((p for p in names if p.kind is inspect.Parameter.VAR_POSITIONAL), None)
                args.append(from_json(value, self.params[var.name]) if var else value)
        kwargs: dict[str, Any] = {}
        for key, value in raw_kwargs.items():
            if key in self.params and self.signature.parameters[key].kind is not inspect.Parameter.VAR_KEYWORD:
                kwargs[key] = from_json(value, self.params[key])
            else:
                var = next((p for p in names if p.kind is inspect.Parameter.VAR_KEYWORD), None)
                kwargs[key] = from_json(value, self.params[var.name]) if var else value
        return args, kwargs
