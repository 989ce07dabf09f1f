-- Token retention (DESIGN §3: "Run end deletes its hooks (tokens kept until token retention ends)"; seed: "A run
-- with a hook whose token retention has not ended is kept until it ends").
--
-- A hook_created event may carry ``token_retention_until`` (an ISO 8601 time with its offset): when the run ends
-- before then, its hooks are deleted as always but that hook's token row stays, so no other hook can claim the token
-- until the retention ends (a claimant gets hook_conflict naming the ended run), and the retention sweep keeps the
-- run until then. ``retain_until`` is that time, copied from the claiming event when the token row is written.
--
-- A token row therefore outlives its hook: it now references its run (and goes with it, as every row of a run does)
-- instead of its hook, and the World deletes token rows itself when a hook is disposed or its run ends. Independent
-- of 0003 (dead letters): it touches only the token table.
ALTER TABLE celery_workflow_hook_tokens DROP CONSTRAINT celery_workflow_hook_tokens_run_id_hook_id_fkey;
ALTER TABLE celery_workflow_hook_tokens
    ADD CONSTRAINT celery_workflow_hook_tokens_run_id_fkey
    FOREIGN KEY (run_id) REFERENCES celery_workflow_runs (run_id) ON DELETE CASCADE;

ALTER TABLE celery_workflow_hook_tokens ADD COLUMN retain_until timestamptz;
