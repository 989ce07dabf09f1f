-- Standing claims: an idle consumer of the Postgres transport leaves one row here saying "the next message due now
-- on one of these queues is mine", and an insert that finds such a row hands its message over in the same statement:
-- the row is inserted already leased to that consumer (attempts 1, the consumer's lease) and the notification, keyed
-- by the consumer's token, carries the message itself, so the consumer delivers it without claiming it. That saves
-- the claim's round trip and a wake-up of every other consumer of the queue (see celery_workflow._postgres.standing).
--
-- One row per consuming connection (its token), updated in place on every registration: ``active`` while the
-- consumer waits idle, ``assigned_id`` the queue row handed to it (a registration takes one message at most),
-- ``serial`` which registration the hand-off answered. ``lock_key`` names the session-level advisory lock the
-- consumer's process holds on its LISTEN connection: a producer skips a row whose lock nobody holds (a killed
-- consumer), and the transport's garbage collection deletes it.
--
-- Rows are updated in place (never an indexed column), so the updates are HOT and page pruning reclaims them without
-- VACUUM; the low fill factor leaves room on each page for that.
CREATE TABLE celery_workflow_standing_claims (
    token       text        PRIMARY KEY,
    queues      text[]      NOT NULL,
    lease       interval    NOT NULL,
    serial      bigint      NOT NULL,
    lock_key    integer     NOT NULL,
    active      boolean     NOT NULL,
    assigned_id bigint,
    since       timestamptz NOT NULL
) WITH (fillfactor = 50);
