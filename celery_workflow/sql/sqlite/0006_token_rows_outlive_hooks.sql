-- Token retention (DESIGN §3: "Run end deletes its hooks (tokens kept until token retention ends)", the rule is in
-- celery_workflow.rules). A token row stays after its run ended, its hook deleted, until the retention the claiming
-- hook_created asked for (``token_retention_until``, kept in ``retain_until``) ends: so it references its run (and
-- goes with it) instead of its hook, and the World deletes token rows itself when a hook is disposed or its run ends
-- (as the Postgres World since its 0004). SQLite cannot change a foreign key: the table is rebuilt, rows kept.
CREATE TABLE celery_workflow_hook_tokens_rebuilt (
    token        TEXT    NOT NULL PRIMARY KEY,
    run_id       TEXT    NOT NULL REFERENCES celery_workflow_runs (run_id) ON DELETE CASCADE,
    hook_id      TEXT    NOT NULL,
    created_at   INTEGER NOT NULL,
    retain_until INTEGER
) WITHOUT ROWID;
INSERT INTO celery_workflow_hook_tokens_rebuilt (token, run_id, hook_id, created_at, retain_until)
    SELECT token, run_id, hook_id, created_at, retain_until FROM celery_workflow_hook_tokens;
DROP TABLE celery_workflow_hook_tokens;
ALTER TABLE celery_workflow_hook_tokens_rebuilt RENAME TO celery_workflow_hook_tokens;
CREATE INDEX celery_workflow_hook_tokens_hook ON celery_workflow_hook_tokens (run_id, hook_id);
