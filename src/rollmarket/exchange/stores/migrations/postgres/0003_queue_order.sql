-- The queue in lease order (the ORDER BY of the job match), queued jobs only: a lease walks it and
-- stops at the first job the worker can run instead of filtering and sorting the whole queue.
CREATE INDEX jobs_queued_order ON jobs (priority DESC, queued_at, seq) WHERE state = 'queued';
-- The queue turns over fast: let autovacuum refresh its statistics after 2% of it changed (the
-- default 10% leaves the planner sorting the whole queue for longer). The store also runs ANALYZE
-- after a large enqueue (PostgresStore.enqueue).
ALTER TABLE jobs SET (autovacuum_analyze_scale_factor = 0.02);
