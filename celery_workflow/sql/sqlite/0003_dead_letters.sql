-- Dead letters: messages no consumer could process, kept with their history instead of retried forever or lost.
-- A message moves here when a claim would exceed its queue's maximum number of deliveries (the transport option
-- ``max_deliveries``, 10 by default, or the queue's ``x-delivery-limit`` argument), when a consumer rejects it
-- without requeue (Kombu's ``reject(requeue=False)``), or when its row cannot be decoded.
-- Times are integer microseconds since the Unix epoch, written by Python.

-- The failure history of a message still queued: set when a delivery fails (its lease ran out unacked, or it was
-- put back with a delay and an error), copied into its dead letter.
ALTER TABLE celery_workflow_queue ADD COLUMN first_failed_at INTEGER;
ALTER TABLE celery_workflow_queue ADD COLUMN last_failed_at INTEGER;
ALTER TABLE celery_workflow_queue ADD COLUMN last_error TEXT;

-- One row per dead-lettered message: its body and queue as they were, how often it was delivered, why it moved and
-- its failures. ``message_id`` is the id it had in celery_workflow_queue; a redrive inserts it there again (a new
-- id, attempts from zero) and deletes this row, so a dead letter is redriven at most once. ``run_settled_at`` is set
-- once the run of the message (if any) has been failed because of it: consumers sweep the unsettled ones, so a
-- process that died between the move and the run's failure leaves no run waiting forever.
CREATE TABLE celery_workflow_dead_letters (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    message_id      INTEGER NOT NULL,
    queue           TEXT    NOT NULL,
    payload         BLOB    NOT NULL,
    run_id          TEXT,
    attempts        INTEGER NOT NULL,
    reason          TEXT    NOT NULL,
    last_error      TEXT,
    first_failed_at INTEGER,
    last_failed_at  INTEGER,
    enqueued_at     INTEGER NOT NULL,
    dead_at         INTEGER NOT NULL,
    run_settled_at  INTEGER
);

CREATE INDEX celery_workflow_dead_letters_queue ON celery_workflow_dead_letters (queue, id);

CREATE INDEX celery_workflow_dead_letters_run ON celery_workflow_dead_letters (run_id) WHERE run_id IS NOT NULL;

CREATE INDEX celery_workflow_dead_letters_unsettled ON celery_workflow_dead_letters (id) WHERE run_settled_at IS NULL;
