-- The tables every append writes (events, steps, hooks, hook tokens, waits) no longer reference their run through a
-- foreign key. A key's check is a trigger per inserted row running its own lookup of the run, with a row lock:
-- 60-80 µs of the server's time for a one-row insert that costs 15 µs without it (EXPLAIN ANALYZE on the machine of
-- bench/RESULTS.md), paid by every event of every batch.
--
-- What the keys guaranteed is kept by the writes themselves: every append writes the run's row first (an UPDATE that
-- locks it, or a read FOR NO KEY UPDATE under which the run is known to exist), and a batch planned on a kept
-- snapshot fails as a whole when that UPDATE finds no run (its statement divides by the count of updated rows), so no
-- row is ever written for a run that is not there. ``ON DELETE CASCADE`` is replaced by the retention sweep, the only
-- place runs are deleted, which deletes a run's rows with it in the same statement. Streams (written apart from the
-- appends) keep their keys.
ALTER TABLE celery_workflow_events DROP CONSTRAINT IF EXISTS celery_workflow_events_run_id_fkey;
ALTER TABLE celery_workflow_steps DROP CONSTRAINT IF EXISTS celery_workflow_steps_run_id_fkey;
ALTER TABLE celery_workflow_hooks DROP CONSTRAINT IF EXISTS celery_workflow_hooks_run_id_fkey;
ALTER TABLE celery_workflow_hook_tokens DROP CONSTRAINT IF EXISTS celery_workflow_hook_tokens_run_id_fkey;
ALTER TABLE celery_workflow_waits DROP CONSTRAINT IF EXISTS celery_workflow_waits_run_id_fkey;
