-- Token retention: the time until which a token stays reserved after its run ended (``token_retention_until`` of
-- the hook_created event that claimed it). The column keeps the two SQL Worlds' tables alike; the SQLite World does
-- not retain tokens yet (it writes NULL: a run's end releases its tokens, as before).
ALTER TABLE celery_workflow_hook_tokens ADD COLUMN retain_until INTEGER;
