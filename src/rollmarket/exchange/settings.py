"""Every exchange setting: name, default, one line of help. Saved in the database at start."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field

from ..gate import GateConfig


class ExchangeSettings(BaseModel):
    """Settings of one exchange process. `rollmarket exchange serve --help` lists the flags."""

    model_config = ConfigDict(extra="forbid")

    db: str | Path = Field(
        default="exchange.db",
        description="SQLite database file, or a postgresql:// URL (needs rollmarket[postgres]).",
    )
    host: str = Field(default="127.0.0.1", description="Interface to listen on.")
    port: int = Field(default=8470, ge=0, le=65535, description="TCP port; 0 picks a free one.")
    trainer_token: str = Field(
        default="", repr=False, description="Bearer token trainers must present (required to serve)."
    )
    registration_token: str | None = Field(
        default=None, repr=False,
        description="When set, workers must present it to register.",
    )
    lease_ttl_s: float = Field(default=120.0, gt=0, description="Seconds a lease stands before it expires.")
    heartbeat_ttl_s: float = Field(
        default=30.0, gt=0, description="Silence after which a worker is marked dead."
    )
    reaper_interval_s: float = Field(
        default=1.0, gt=0, description="How often expired leases and silent workers are swept."
    )
    leader_retry_s: float = Field(
        default=1.0, gt=0,
        description="PostgreSQL: how often a replica tries to become leader (and the leader checks its lock).",
    )
    work_recheck_s: float = Field(
        default=0.5, gt=0,
        description="How often a waiting lease request re-reads the store for work other replicas added.",
    )
    max_attempts: int = Field(
        default=3, ge=1, description="Leases a job may use up before it is marked failed."
    )
    max_body_bytes: int = Field(
        default=64 * 1024 * 1024, ge=1024, description="Largest request body accepted."
    )
    max_lease_wait_s: float = Field(
        default=30.0, ge=0, description="Longest a lease request may wait for work (long poll)."
    )
    redeliver_after_s: float = Field(
        default=300.0, gt=0,
        description="A group served to a trainer that has not decided on it is served again after this.",
    )
    reload_quorum_fraction: float = Field(
        default=0.5, gt=0, le=1,
        description="Share of live workers that must ack a version before it becomes active.",
    )
    reload_quorum_min: int = Field(
        default=1, ge=1, description="At least this many acks activate a version."
    )
    preference_hold_s: float = Field(
        default=2.0, ge=0,
        description="How long a queued job waits for a better-ranked worker before anyone may take it.",
    )
    price_weight: float = Field(
        default=0.3, ge=0, description="How much price counts against feedback quality in ranking."
    )
    feedback_alpha: float = Field(
        default=0.2, gt=0, le=1, description="EWMA weight of each new trainer feedback score."
    )
    sqlite_synchronous: str = Field(
        default="FULL", pattern="^(FULL|NORMAL|EXTRA)$",
        description="SQLite synchronous mode; FULL fsyncs every commit (commits are batched).",
    )
    write_batch_max: int = Field(
        default=128, ge=1, description="Most operations committed in one SQLite transaction."
    )
    gate: GateConfig = Field(default_factory=GateConfig, description="Thresholds for arrival triage.")

    def public_dict(self) -> dict:
        """Settings without secrets, for logs and the database."""
        data = self.model_dump(mode="json", exclude={"trainer_token", "registration_token"})
        data["db"] = redact_url(str(self.db))
        data["registration_required"] = self.registration_token is not None
        return data


def redact_url(url: str) -> str:
    """`url` without its password, fit for logs, the audit log and error messages."""
    parts = urlsplit(url)
    if not parts.scheme or parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
