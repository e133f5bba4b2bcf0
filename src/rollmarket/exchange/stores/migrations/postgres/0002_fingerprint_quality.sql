-- Trainer feedback kept per engine fingerprint as well as per worker (issue 16, §4).
CREATE TABLE fingerprints (
    fingerprint TEXT PRIMARY KEY,
    quality DOUBLE PRECISION NOT NULL,
    feedback_count INTEGER NOT NULL DEFAULT 0,
    rejected_count INTEGER NOT NULL DEFAULT 0
);
