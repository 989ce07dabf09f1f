"""Dead letters of the AWS World: each SQS queue's own dead-letter queue (its ``RedrivePolicy``).

SQS moves a message to the dead-letter queue by itself once it was received ``maxReceiveCount`` times; the SQS
transport and the Lambda handler move it themselves one receive earlier (so they can fail its run with the cause and
announce it), and at once when a consumer rejects it without requeue. A moved message keeps its body (for a World
delivery: the pointer to its ``QUEUE#`` record, which stays, so a redrive finds it; a run's start carries its payload
and its run's META keeps ``start``: :mod:`celery_workflow._aws.starts`) and carries message attributes
saying where it came from and why: ``dead_letter.queue``, ``.reason``, ``.error``, ``.receives``, ``.run``, ``.at``.

Listing receives the dead-letter queues' messages with a short visibility timeout and makes them visible again at
once (SQS has no peek): a listing is what SQS answered, and two listings running at once may each miss what the
other holds for that moment. Ids are SQS message ids. A redrive sends the body back to its queue and deletes the
dead letter; a purge deletes. Queues without a redrive policy keep no dead letters: a message that must move is
backed off instead, as before.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from celery_workflow import codec, ids
from celery_workflow._aws.queue import Record, body_of, parse_body
from celery_workflow._aws.starts import start_of
from celery_workflow._aws.table import META, queue_pk
from celery_workflow.dead_letters import DeadLetter, cut_error
from celery_workflow.errors import DeadLetterNotFound

if TYPE_CHECKING:
    from celery_workflow._aws.world import AWSWorld

__all__ = ["SQSDeadLetters"]

log = logging.getLogger(__name__)

#: How long a listing hides the messages it reads (they are made visible again right after).
PEEK_VISIBILITY = 30
#: SQS's limit on a string message attribute is the message's; errors are cut shorter to keep messages small.
ATTRIBUTE_ERROR = 1024


class SQSDeadLetters:
    """The dead-letter queues of an AWS World's queues (:class:`~celery_workflow.dead_letters.DeadLetterStore`)."""

    def __init__(self, world: AWSWorld) -> None:
        self.world = world
        self._targets: dict[str, tuple[str, int] | None] = {}

    @property
    def sqs(self) -> Any:
        return self.world.queue.sqs

    # -- where dead letters go ---------------------------------------------------------------------------------

    def target(self, queue: str) -> tuple[str, int] | None:
        """``(dead-letter queue URL, maxReceiveCount)`` of ``queue``'s redrive policy, or None without one."""
        if queue not in self._targets:
            answer = self.world.queue._sqs(
                "GetQueueAttributes", self.sqs.get_queue_attributes,
                QueueUrl=self.world.queue_config(queue).url, AttributeNames=["RedrivePolicy"],
            )  # fmt: skip
            attrs = (answer or {}).get("Attributes", {})
            policy = attrs.get("RedrivePolicy")
            found = None
            if policy:
                data = json.loads(policy)
                arn = str(data["deadLetterTargetArn"])
                name = arn.rsplit(":", 1)[-1]
                source = self.world.queue_config(queue).url
                # the dead-letter queue's URL is its source's with its own name (same endpoint and account): no
                # GetQueueUrl call, so the worker needs no permission for it
                found = (source.rsplit("/", 1)[0] + "/" + name, int(data.get("maxReceiveCount", 10)))
            self._targets[queue] = found
        return self._targets[queue]

    def max_receives(self, queue: str) -> int | None:
        target = self.target(queue)
        return None if target is None else target[1]

    def move(
        self,
        queue: str,
        handle: str,
        body: str,
        *,
        reason: str,
        attempts: int,
        run_id: str | None,
        payload: bytes,
        error: str | None = None,
    ) -> DeadLetter | None:
        """Send ``body`` to ``queue``'s dead-letter queue with where it came from and why, then delete the received
        message; None (nothing moved) when the queue has no dead-letter queue."""
        target = self.target(queue)
        if target is None:
            return None
        now = ids.utcnow()
        attributes: dict[str, Any] = {
            "dead_letter.queue": _string(queue),
            "dead_letter.reason": _string(reason),
            "dead_letter.receives": {"DataType": "Number", "StringValue": str(attempts)},
            "dead_letter.at": _string(ids.isoformat(now)),
        }
        if error:
            attributes["dead_letter.error"] = _string(codec.cut(error, ATTRIBUTE_ERROR))
        if run_id:
            attributes["dead_letter.run"] = _string(run_id)
        kwargs: dict[str, Any] = {"QueueUrl": target[0], "MessageBody": body, "MessageAttributes": attributes}
        if target[0].endswith(".fifo"):
            kwargs.update(MessageGroupId=run_id or "default", MessageDeduplicationId=ids.ulid())
        sent = self.world.queue._sqs("SendMessage", self.sqs.send_message, **kwargs)
        self.world.queue.delete_message(queue, handle)
        return DeadLetter(
            str(sent["MessageId"]), _source_id(body), queue, run_id, attempts, reason,
            cut_error(error), None, None, now, now, payload,
        )  # fmt: skip

    # -- the DeadLetterStore API -------------------------------------------------------------------------------

    def dead_letter(self, receipt: str, *, reason: str, error: str | None = None) -> DeadLetter | None:
        """Move a claimed World delivery to its queue's dead-letter queue (:meth:`SQSQueue.dead_letter`)."""
        return self.world.queue.dead_letter(receipt, reason=reason, error=error)

    def _queues(self, queue: str | None) -> list[str]:
        names = sorted(self.world.queue_names) if queue is None else [queue]
        return [q for q in names if self.target(q) is not None]

    def _received(self, queue: str) -> Iterator[tuple[dict[str, Any], DeadLetter]]:
        """Every message of ``queue``'s dead-letter queue, hidden for :data:`PEEK_VISIBILITY` seconds."""
        target = self.target(queue)
        assert target is not None
        seen: set[str] = set()
        while True:
            answer = self.sqs.receive_message(
                QueueUrl=target[0], MaxNumberOfMessages=10, VisibilityTimeout=PEEK_VISIBILITY, WaitTimeSeconds=0,
                AttributeNames=["All"], MessageAttributeNames=["All"],
            )  # fmt: skip
            messages = [m for m in answer.get("Messages", []) if m["MessageId"] not in seen]
            if not messages:
                return
            for message in messages:
                seen.add(message["MessageId"])
                yield message, self._letter(queue, message)

    def _show_again(self, queue: str, messages: Sequence[Mapping[str, Any]]) -> None:
        target = self.target(queue)
        assert target is not None
        for message in messages:
            self.sqs.change_message_visibility(
                QueueUrl=target[0], ReceiptHandle=message["ReceiptHandle"], VisibilityTimeout=0
            )

    def _letter(self, queue: str, message: Mapping[str, Any]) -> DeadLetter:
        attrs = {k: v.get("StringValue") for k, v in (message.get("MessageAttributes") or {}).items()}
        body = str(message.get("Body", ""))
        sent = datetime.fromtimestamp(int(message.get("Attributes", {}).get("SentTimestamp", "0")) / 1000, UTC)
        dead_at = ids.parse_iso(attrs["dead_letter.at"]) if attrs.get("dead_letter.at") else sent
        parsed = body_of(body)
        run_id = attrs.get("dead_letter.run") or (parsed[1] if parsed else None)
        return DeadLetter(
            str(message["MessageId"]), _source_id(body), attrs.get("dead_letter.queue") or queue, run_id,
            int(attrs.get("dead_letter.receives") or message.get("Attributes", {}).get("ApproximateReceiveCount", 0) or 0),
            attrs.get("dead_letter.reason") or "max-deliveries", attrs.get("dead_letter.error"), None, None, dead_at, dead_at,
            self._payload(body),
        )  # fmt: skip

    def _payload(self, body: str) -> bytes:
        """The delivery's Celery message (from its record, for a World delivery), else the body itself."""
        data = parse_body(body)
        if data is None:
            return body.encode()
        start = start_of(data)
        if start is not None:  # a run's start carries its payload (it has no record)
            return start[2]
        found = self.world.queue.table.get_many([{"pk": queue_pk(data["id"]), "sk": META}])
        return Record.from_item(found[0]).payload if found else body.encode()

    def list_dead_letters(
        self, *, queue: str | None = None, run_id: str | None = None, after: int | str = 0, limit: int = 100
    ) -> list[DeadLetter]:
        """The dead letters SQS hands out now (``after`` is ignored: SQS has no order to page in)."""
        out: list[DeadLetter] = []
        for name in self._queues(queue):
            held = []
            for message, letter in self._received(name):
                held.append(message)
                if run_id is None or letter.run_id == run_id:
                    out.append(letter)
            self._show_again(name, held)
        return out[: max(limit, 0)]

    def get_dead_letter(self, letter_id: int | str) -> DeadLetter:
        for letter in self.list_dead_letters(limit=10_000):
            if letter.id == str(letter_id):
                return letter
        raise DeadLetterNotFound(f"no dead letter {letter_id}")

    def _take(self, ids_: Sequence[int | str] | None, queue: str | None, act: str) -> int:
        wanted = None if ids_ is None else {str(i) for i in ids_}
        done = 0
        for name in self._queues(queue):
            target = self.target(name)
            assert target is not None
            keep = []
            for message, letter in self._received(name):
                if wanted is not None and letter.id not in wanted:
                    keep.append(message)
                    continue
                if act == "redrive":
                    self.world.queue.send_body(letter.queue, str(message.get("Body", "")))
                self.sqs.delete_message(QueueUrl=target[0], ReceiptHandle=message["ReceiptHandle"])
                done += 1
            self._show_again(name, keep)
        return done

    def redrive_dead_letters(self, ids: Sequence[int | str] | None = None, *, queue: str | None = None) -> int:
        """Send the chosen dead letters back to their queues and delete them (each at most once)."""
        if ids is not None and not ids:
            return 0
        return self._take(ids, queue, "redrive")

    def purge_dead_letters(self, ids: Sequence[int | str] | None = None, *, queue: str | None = None) -> int:
        if ids is not None and not ids:
            return 0
        return self._take(ids, queue, "purge")

    def unsettled_dead_letters(self, *, limit: int = 100) -> list[DeadLetter]:
        """None: a dead letter's run is failed right after the move (SQS keeps no settled flag)."""
        return []

    def settle_dead_letters(self, ids: Sequence[int | str]) -> None:
        return None


def _string(value: str) -> dict[str, str]:
    return {"DataType": "String", "StringValue": value}


def _source_id(body: str) -> str:
    parsed = body_of(body)
    return parsed[0] if parsed else ""
