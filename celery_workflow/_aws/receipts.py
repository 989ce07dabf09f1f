"""What an AWS World message's body is marked with, and what a claim's receipt string carries (shared by
:mod:`celery_workflow._aws.queue` and :mod:`celery_workflow._aws.starts`)."""

from __future__ import annotations

from dataclasses import dataclass

from celery_workflow.errors import WorldError

__all__ = ["BODY_KEY", "RECEIPT_TAGS", "START_TAG", "Receipt"]

#: Marks a message body as ours (its value is the body format's version).
BODY_KEY = "celery_workflow"

#: The receipt tags: a message received here (``sqs``: the World deletes it once done) or handed to a Lambda function
#: by an event source mapping (``esm``: the mapping deletes it once the handler reports it done).
RECEIPT_TAGS = ("sqs", "esm")


#: The tag's suffix of a run's start (no record: ``id`` is the run's id, ``claim`` the message's receive count).
START_TAG = "+start"


@dataclass(frozen=True, slots=True)
class Receipt:
    """What a claim's receipt string carries. ``esm``: the message came from a Lambda event source mapping, which
    deletes it when the handler does not report it in ``batchItemFailures``: the World never deletes it itself.
    ``start``: a run's start, which has no record (:mod:`celery_workflow._aws.starts`): ``id`` is the run's id."""

    queue: str
    id: str
    claim: int
    handle: str
    esm: bool = False
    start: bool = False

    def __str__(self) -> str:
        tag = RECEIPT_TAGS[self.esm] + (START_TAG if self.start else "")
        return f"{tag}|{self.queue}|{self.id}|{self.claim}|{self.handle}"

    @classmethod
    def parse(cls, text: str) -> Receipt:
        try:
            tag, queue, record, claim, handle = text.split("|", 4)
            start = tag.endswith(START_TAG)
            tag = tag.removesuffix(START_TAG)
            if tag not in RECEIPT_TAGS or not handle:
                raise ValueError(text)
            return cls(queue, record, int(claim), handle, tag == "esm", start)
        except (AttributeError, ValueError) as exc:
            raise WorldError(f"malformed AWS World receipt {text!r}") from exc
