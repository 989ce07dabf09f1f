"""Celery task messages as bytes a World can store: built with Celery's own protocol-2 builder.

The World inserts deliveries into its queue itself (in the same transaction as the events), so the message must be
exactly what a Kombu virtual transport would have stored had Celery published it: ``{"body" (base64 of the JSON
``[args, kwargs, embed]``), "content-type", "content-encoding", "headers" (protocol 2), "properties"}``.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from kombu import serialization

from celery_workflow.ids import isoformat


def build(
    celery_app: Any,
    task_name: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    queue: str,
    task_id: str,
    not_before: datetime | None = None,
) -> bytes:
    """The UTF-8 JSON of a virtual-transport message that runs ``task_name(*args, **kwargs)`` on ``queue``."""
    msg = celery_app.amqp.as_task_v2(
        task_id,
        task_name,
        list(args),
        dict(kwargs),
        ignore_result=True,
        origin="celery_workflow",
        root_id=task_id,
    )
    content_type, content_encoding, body = serialization.dumps(msg.body, serializer="json")  # type: ignore[no-untyped-call]
    if isinstance(body, str):
        body = body.encode(content_encoding or "utf-8")
    properties: dict[str, Any] = {
        **msg.properties,
        "delivery_mode": 2,
        "priority": 0,
        "body_encoding": "base64",
        "delivery_tag": str(uuid.uuid4()),
        "delivery_info": {"exchange": "", "routing_key": queue},
    }
    if not_before is not None:
        properties["not_before"] = isoformat(not_before)
    message = {
        "body": base64.b64encode(body).decode(),
        "content-encoding": content_encoding,
        "content-type": content_type,
        "headers": msg.headers,
        "properties": properties,
    }
    return json.dumps(message, default=str).encode()
