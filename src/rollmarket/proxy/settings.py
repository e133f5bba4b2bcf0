"""Every capture-proxy setting: name, default, one line of help. `rollmarket proxy --help` lists the flags."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator


class ProxySettings(BaseModel):
    """Settings of one capture proxy process."""

    model_config = ConfigDict(extra="forbid")

    upstream: str = Field(
        default="http://127.0.0.1:8000",
        description="Base URL of the OpenAI-compatible server to forward to (with or without a trailing /v1)."
    )
    store: Path = Field(default=Path("captures.db"), description="SQLite file the captures are written to.")
    host: str = Field(default="127.0.0.1", description="Interface to listen on.")
    port: int = Field(default=8001, ge=0, le=65535, description="TCP port; 0 picks a free one.")
    keep_extras: bool = Field(
        default=False,
        description="Pass the logprobs, token ids and routed experts the proxy asked for on to the client "
        "instead of stripping what the client did not ask for.",
    )
    augment: bool = Field(
        default=True,
        description="Ask the upstream for logprobs, token ids, routed experts and stream usage when the client "
        "did not (turn off for upstreams that refuse unknown fields).",
    )
    conversation_header: str = Field(
        default="X-Rollmarket-Conversation",
        description="Request header that names a call's conversation; without it, turns link by message prefix.",
    )
    timeout_s: float = Field(
        default=600.0, gt=0, description="Longest wait for the upstream's next bytes before the call fails with 504."
    )
    connect_timeout_s: float = Field(default=10.0, gt=0, description="Longest wait to connect to the upstream.")
    max_connections: int = Field(default=1024, ge=1, description="Most open connections to the upstream.")
    ack_after_write: bool = Field(
        default=True,
        description="Hold each response's last bytes until its capture is committed, so a response the client "
        "received is never lost, kill -9 included; off: write behind, captures of the last moments lost on a crash.",
    )
    sqlite_synchronous: str = Field(
        default="NORMAL", pattern="^(OFF|NORMAL|FULL|EXTRA)$",
        description="SQLite synchronous mode. NORMAL (WAL) survives a killed process but not a power cut; "
        "FULL also survives a power cut, at an fsync per commit.",
    )
    write_batch_max: int = Field(default=256, ge=1, description="Most captures committed in one SQLite transaction.")
    moe_shape: str | None = Field(
        default=None, pattern=r"^\d+x\d+$",
        description="Hidden layers x top-k of the upstream MoE model (e.g. 48x8: every layer, dense ones "
        "included); needed only to unpack SGLang's shapeless base64 routed experts.",
    )

    @field_validator("upstream")
    @classmethod
    def _base_url(cls, value: str) -> str:
        value = value.rstrip("/")
        if not value.startswith(("http://", "https://")):
            raise ValueError("the upstream must be an http:// or https:// URL")
        return value.removesuffix("/v1")

    @property
    def experts_shape(self) -> tuple[int, int] | None:
        if self.moe_shape is None:
            return None
        layers, top_k = self.moe_shape.split("x")
        return int(layers), int(top_k)
