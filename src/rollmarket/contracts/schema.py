"""JSON Schema export of every contract (`rollmarket schema --out DIR`)."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel

from . import (
    AgentDivergenceReport, AgentTrajectory, Capture, DenseMismatchReport, ObservatoryMatrix,
    RouterMismatchReport, VerifyResult,
    AuditPage, BudgetReport, EnqueueReceipt, ErrorBody, FailureReport, FetchResult,
    GroupDecision, HeartbeatReply, LeaseGrant, PolicyManifest, PoolStatus, ReloadAck,
    ReloadStatus, RolloutJob, RolloutLease, SampleGroup, SubmissionReceipt, TrainerFeedback,
    Trajectory, WorkerHeartbeat, WorkerManifest, WorkerRegistration,
)

EXPORTED: tuple[type[BaseModel], ...] = (
    Capture, AgentTrajectory, VerifyResult,
    PolicyManifest, WorkerManifest, WorkerRegistration, WorkerHeartbeat, HeartbeatReply,
    RolloutJob, RolloutLease, LeaseGrant, FailureReport, EnqueueReceipt, Trajectory, SampleGroup,
    SubmissionReceipt, FetchResult, BudgetReport, GroupDecision, TrainerFeedback, ReloadAck,
    ReloadStatus, PoolStatus, AuditPage, ErrorBody,
    DenseMismatchReport, RouterMismatchReport, AgentDivergenceReport, ObservatoryMatrix,
)


def write_schemas(out_dir: Path) -> list[Path]:
    """Write one `<Name>.schema.json` per contract plus an index; return the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    index = {}
    for model in EXPORTED:
        schema = model.model_json_schema(mode="validation")
        schema["$id"] = f"https://rollmarket.dev/schema/{model.__name__}.schema.json"
        path = out_dir / f"{model.__name__}.schema.json"
        path.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
        written.append(path)
        index[model.__name__] = path.name
    index_path = out_dir / "index.json"
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    written.append(index_path)
    return written
