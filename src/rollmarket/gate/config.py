"""The gate's thresholds (DESIGN.md, 'The gate'). Saved with every run that uses them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class GateConfig(BaseModel):
    """Off-policy budget thresholds. Defaults are the project's published defaults."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    clamp: float = Field(default=20.0, gt=0, description="c in w = exp(clip(Δ, −c, c)).")
    min_ess: float = Field(default=0.30, ge=0, le=1, description="Below: quarantine.")
    replay_ess: float = Field(default=0.60, ge=0, le=1, description="Below: replay.")
    max_clipped_fraction: float = Field(
        default=0.10, ge=0, le=1, description="Above: train with IS correction."
    )
    max_policy_lag: int = Field(default=8, ge=0, description="Above: quarantine.")
    replay_lag: int = Field(default=4, ge=0, description="Above: replay.")
    veto_abs_delta: float = Field(default=30.0, gt=0, description="Any token above: quarantine.")
    max_router_flip: float = Field(default=0.15, ge=0, le=1, description="Above: quarantine.")
    ess_kind: Literal["token", "sequence"] = Field(
        default="token", description="Which ESS the thresholds apply to."
    )
    logprob_tolerance: float = Field(
        default=1e-3, ge=0, description="A sampled logprob above this is out of range."
    )
