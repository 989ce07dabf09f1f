"""The AWS World's raw SQS calls (not part of the public API): what :class:`~celery_workflow._aws.queue.SQSQueue`
sends to SQS, with SQS's errors turned into the World's (a receipt handle gone is nothing to do, a missing queue a
:class:`~celery_workflow.errors.WorldError`, throttling :class:`~celery_workflow.errors.WorldUnavailable`)."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

from botocore.exceptions import BotoCoreError, ClientError

from celery_workflow import ids
from celery_workflow._aws.config import MAX_SQS_DELAY
from celery_workflow.errors import WorldError, WorldUnavailable

if TYPE_CHECKING:
    from celery_workflow._aws.world import AWSWorld

__all__ = ["MAX_VISIBILITY", "SQSCalls", "visibility"]

log = logging.getLogger("celery_workflow.aws")

MAX_VISIBILITY = 12 * 3600


class SQSCalls:
    """The SQS calls of a queue facet (``world``: its World, for the queues' configs; ``sqs``: a boto3 client)."""

    world: AWSWorld
    sqs: Any

    def _sqs(self, what: str, fn: Any, **kwargs: Any) -> Any:
        try:
            return fn(**kwargs)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code in ("ReceiptHandleIsInvalid", "AWS.SimpleQueueService.NonExistentQueue", "QueueDoesNotExist"):
                if "Receipt" in code:
                    return None  # the message is gone (deleted, or its receipt expired): nothing to do
                raise WorldError(f"SQS {what}: queue not found ({exc})") from exc
            if code in ("ThrottlingException", "RequestThrottled", "ServiceUnavailable", "InternalError",
                        "KmsThrottled", "OverLimit"):  # fmt: skip
                raise WorldUnavailable(f"SQS {what}: {code}") from exc
            raise WorldError(f"SQS {what}: {code}: {exc}") from exc
        except BotoCoreError as exc:
            raise WorldUnavailable(f"SQS {what}: {exc}") from exc

    def change_visibility(self, queue: str, handle: str, seconds: float) -> None:
        self._sqs(
            "ChangeMessageVisibility",
            self.sqs.change_message_visibility,
            QueueUrl=self.world.queue_config(queue).url,
            ReceiptHandle=handle,
            VisibilityTimeout=visibility(seconds),
        )

    def receive(self, queue: str, *, limit: int, wait: float, lease: float) -> list[dict[str, Any]]:
        """Raw SQS messages of ``queue`` (long-polling up to ``wait`` seconds, at most 20), hidden for ``lease``."""
        answer = self._sqs(
            "ReceiveMessage",
            self.sqs.receive_message,
            QueueUrl=self.world.queue_config(queue).url,
            MaxNumberOfMessages=max(1, min(10, limit)),
            VisibilityTimeout=visibility(lease),
            AttributeNames=["ApproximateReceiveCount"],
            MessageAttributeNames=["All"],
            WaitTimeSeconds=max(0, min(20, math.ceil(wait))),
        )
        return list((answer or {}).get("Messages", []))

    def send_body(
        self, queue: str, body: str, *, delay: float = 0.0, group: str | None = None, dedup: str | None = None
    ) -> None:
        """Send a message body as it is (a plain Celery task's message, due within 15 minutes)."""
        config = self.world.queue_config(queue)
        kwargs: dict[str, Any] = {"QueueUrl": config.url, "MessageBody": body}
        if config.fifo:
            kwargs.update(MessageGroupId=group or "default", MessageDeduplicationId=dedup or ids.ulid())
        elif delay > 0:
            kwargs["DelaySeconds"] = min(int(MAX_SQS_DELAY.total_seconds()), math.ceil(delay))
        self._sqs("SendMessage", self.sqs.send_message, **kwargs)

    def approximate_size(self, queue: str) -> int:
        """Messages waiting on ``queue`` (visible and delayed), as SQS estimates them."""
        answer = self._sqs(
            "GetQueueAttributes",
            self.sqs.get_queue_attributes,
            QueueUrl=self.world.queue_config(queue).url,
            AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesDelayed"],
        )
        found = (answer or {}).get("Attributes", {})
        return int(found.get("ApproximateNumberOfMessages", 0)) + int(
            found.get("ApproximateNumberOfMessagesDelayed", 0)
        )

    def purge(self, queue: str) -> int:
        """Delete every message of ``queue``; how many were waiting (visible and delayed, as :meth:`approximate_size`
        counts them), which this purge removes.

        SQS allows one purge per queue every 60 seconds and answers another within that minute with
        ``PurgeQueueInProgress``. That purge is a purge (it is deleting the queue's messages): the answer is 0, as
        this call removed nothing itself, and a warning says one is pending and that messages sent since it began
        may remain. So a caller that purges until the count reads 0 (Celery's test manager) stops, and
        ``celery purge`` run twice in a minute reports the first purge's count, then none."""
        config = self.world.queue_config(queue)
        size = self.approximate_size(queue)
        if self._sqs("PurgeQueue", self._purge_now, QueueUrl=config.url):
            return size
        log.warning(
            "SQS queue %r (%s): a purge is already in progress (SQS allows one purge per queue every 60 seconds); it"
            " deletes the messages sent before it began, within a minute. Messages sent since may remain: purge again"
            " after that minute",
            queue, config.url.rsplit("/", 1)[-1],
        )  # fmt: skip
        return 0

    def _purge_now(self, **kwargs: Any) -> bool:
        """``PurgeQueue``: True, or False when a purge of the queue is already in progress (other errors raise)."""
        try:
            self.sqs.purge_queue(**kwargs)
        except ClientError as exc:
            if _purge_in_progress(exc):
                return False
            raise
        return True

    def delete_message(self, queue: str, handle: str) -> None:
        self._sqs(
            "DeleteMessage",
            self.sqs.delete_message,
            QueueUrl=self.world.queue_config(queue).url,
            ReceiptHandle=handle,
        )


def _purge_in_progress(exc: ClientError) -> bool:
    """SQS's answer to a second purge of a queue within 60 seconds (``AWS.SimpleQueueService.PurgeQueueInProgress``
    as botocore reads it from the JSON protocol's query-compatible header, ``PurgeQueueInProgress`` in the model)."""
    error = exc.response.get("Error", {})
    codes = (str(error.get("Code", "")), str(error.get("QueryErrorCode", "")))
    return any(code.rsplit(".", 1)[-1] == "PurgeQueueInProgress" for code in codes)


def visibility(seconds: float) -> int:
    """An SQS visibility timeout: whole seconds, 0 to 12 hours."""
    return max(0, min(MAX_VISIBILITY, math.ceil(seconds)))
