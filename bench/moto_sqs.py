"""A faster moto SQS for the fan-out bench: receipt handles found by index, visible messages listed in one pass.

moto 5.x finds a message by its receipt handle by scanning every message of the queue (twice for ``DeleteMessage``,
building a list of each message's handles as it goes; once for ``ChangeMessageVisibility``), and lists a queue's
visible messages for each ``ReceiveMessage`` reading the clock twice per message. A fan-out of N steps queues N
messages at once and deletes each: N scans of up to N messages, a cost real SQS does not have (issue #26, item 4).
:func:`install` keeps moto's behaviour and replaces those scans with an index from every handle a message had to the
message, and the visible list with one clock reading per call. For benches on
:class:`celery_workflow.testing.moto_server.MotoServer` only.
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["install"]


def install() -> None:
    """Patch moto's SQS ``Message`` and ``Queue`` in this process (idempotent)."""
    from moto.core.utils import unix_time_millis
    from moto.sqs import models
    from moto.sqs.exceptions import ReceiptHandleIsInvalid

    message_cls: Any = models.Message
    queue_cls: Any = models.Queue
    if getattr(queue_cls, "_handle_index", False):
        return
    owner: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()  # every handle a message had

    mark_received = message_cls.mark_received

    def mark(self: Any, *args: Any, **kwargs: Any) -> None:
        mark_received(self, *args, **kwargs)
        owner[self.receipt_handle] = self

    message_cls.mark_received = mark

    def messages(self: Any) -> list[Any]:
        now = unix_time_millis()
        return [m for m in self._messages if now > m.visible_at and not now < m.delayed_until]

    def delete_message(self: Any, receipt_handle: str) -> None:
        if receipt_handle in self.deleted_messages:
            return
        message = owner.get(receipt_handle)
        if message is None or not any(m is message for m in self._messages):
            raise ReceiptHandleIsInvalid()
        self.pending_messages.discard(message)
        self.deleted_messages.update(message.all_receipt_handles)
        self._messages = [m for m in self._messages if m is not message]

    queue_cls.messages = property(messages)
    queue_cls.delete_message = delete_message
    queue_cls._handle_index = True

    backend_cls: Any = models.SQSBackend
    change = backend_cls.change_message_visibility

    def change_message_visibility(self: Any, queue_name: str, receipt_handle: str, visibility_timeout: int) -> None:
        queue = self.get_queue(queue_name)
        message = owner.get(receipt_handle)
        if message is None or not any(m is message for m in queue._messages):
            raise ReceiptHandleIsInvalid
        saved = queue._messages
        queue._messages = [message]  # moto's own checks and bookkeeping, on the one message
        try:
            change(self, queue_name, receipt_handle, visibility_timeout)
        finally:
            queue._messages = saved

    backend_cls.change_message_visibility = change_message_visibility
