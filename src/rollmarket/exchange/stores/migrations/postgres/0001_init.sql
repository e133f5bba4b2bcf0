-- The exchange's tables on PostgreSQL: the same rows as the SQLite schema (stores/sqlite.py),
-- with times as double precision POSIX seconds and payloads as bytea. Unique constraints, not
-- process memory, keep replicas from storing a job or a group twice.
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE pool (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    active_version INTEGER,
    published_version INTEGER
);
INSERT INTO pool (id) VALUES (1);
CREATE TABLE policies (
    version INTEGER PRIMARY KEY,
    digest TEXT NOT NULL,
    manifest TEXT NOT NULL,
    quorum INTEGER,
    published_at DOUBLE PRECISION NOT NULL,
    activated_at DOUBLE PRECISION
);
CREATE TABLE workers (
    worker_id TEXT PRIMARY KEY,
    manifest TEXT NOT NULL,
    token_hash TEXT NOT NULL,
    status TEXT NOT NULL,
    registered_at DOUBLE PRECISION NOT NULL,
    last_heartbeat_at DOUBLE PRECISION NOT NULL,
    loaded_version INTEGER,
    loaded_digest TEXT,
    loaded_fingerprint TEXT,
    active_leases INTEGER NOT NULL DEFAULT 0,
    quality DOUBLE PRECISION NOT NULL,
    feedback_count INTEGER NOT NULL DEFAULT 0,
    rejected_count INTEGER NOT NULL DEFAULT 0,
    price DOUBLE PRECISION NOT NULL
);
CREATE TABLE reload_acks (
    worker_id TEXT NOT NULL,
    policy_version INTEGER NOT NULL,
    digest TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    acked_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (worker_id, policy_version)
);
CREATE TABLE jobs (
    seq BIGSERIAL UNIQUE,
    job_id TEXT PRIMARY KEY,
    idempotency_key TEXT NOT NULL UNIQUE,
    digest TEXT NOT NULL,
    body TEXT NOT NULL,
    policy_version INTEGER NOT NULL,
    priority INTEGER NOT NULL,
    req_precision TEXT,
    req_quantization TEXT,
    max_context INTEGER NOT NULL,
    needs_experts INTEGER NOT NULL,
    engines TEXT,
    deadline DOUBLE PRECISION,
    state TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    enqueued_at DOUBLE PRECISION NOT NULL,
    queued_at DOUBLE PRECISION NOT NULL,
    group_id TEXT
);
CREATE INDEX jobs_queue ON jobs (state, priority DESC, queued_at);
CREATE TABLE leases (
    lease_id TEXT PRIMARY KEY,
    job_id TEXT NOT NULL,
    worker_id TEXT NOT NULL,
    policy_version INTEGER NOT NULL,
    body TEXT NOT NULL,
    issued_at DOUBLE PRECISION NOT NULL,
    expires_at DOUBLE PRECISION NOT NULL,
    state TEXT NOT NULL,
    ended_at DOUBLE PRECISION
);
CREATE INDEX leases_live ON leases (state, expires_at);
CREATE INDEX leases_worker ON leases (worker_id, state);
-- At most one issued lease per job, whatever the replicas do.
CREATE UNIQUE INDEX leases_one_issued ON leases (job_id) WHERE state = 'issued';
CREATE TABLE groups (
    seq BIGSERIAL PRIMARY KEY,
    group_id TEXT NOT NULL UNIQUE,
    lease_id TEXT NOT NULL UNIQUE,
    job_id TEXT NOT NULL,
    worker_id TEXT NOT NULL,
    task_id TEXT NOT NULL,
    policy_version INTEGER NOT NULL,
    precision_class TEXT NOT NULL,
    engine_fingerprint TEXT NOT NULL,
    content_hash TEXT NOT NULL,
    n_tokens INTEGER NOT NULL,
    tier TEXT NOT NULL,
    status TEXT NOT NULL,
    lag_at_arrival INTEGER NOT NULL,
    receipt TEXT NOT NULL,
    received_at DOUBLE PRECISION NOT NULL,
    payload BYTEA NOT NULL
);
CREATE INDEX groups_serve ON groups (tier, status, seq);
CREATE TABLE served (
    group_id TEXT NOT NULL,
    trainer_id TEXT NOT NULL,
    tier TEXT NOT NULL,
    count INTEGER NOT NULL,
    first_at DOUBLE PRECISION NOT NULL,
    last_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (group_id, trainer_id, tier)
);
CREATE TABLE decisions (
    seq BIGSERIAL PRIMARY KEY,
    group_id TEXT NOT NULL,
    trainer_id TEXT NOT NULL,
    status TEXT NOT NULL,
    body TEXT NOT NULL,
    decided_at DOUBLE PRECISION NOT NULL
);
CREATE TABLE feedback (
    seq BIGSERIAL PRIMARY KEY,
    group_id TEXT NOT NULL,
    worker_id TEXT NOT NULL,
    trainer_id TEXT NOT NULL,
    score DOUBLE PRECISION NOT NULL,
    body TEXT NOT NULL,
    received_at DOUBLE PRECISION NOT NULL
);
CREATE TABLE audit (
    seq BIGSERIAL PRIMARY KEY,
    at DOUBLE PRECISION NOT NULL,
    kind TEXT NOT NULL,
    actor TEXT NOT NULL,
    subject TEXT NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX audit_kind ON audit (kind, seq);
CREATE INDEX audit_subject ON audit (subject, seq);
