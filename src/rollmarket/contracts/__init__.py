"""Everything that crosses a process boundary. Pydantic v2, frozen, no torch."""

from .agent import (
    AgentStep,
    AgentTrajectory,
    TerminalReason,
    ToolCallRecord,
    ToolOutcome,
    ToolResult,
    VerifyResult,
)
from .base import CONTRACT_VERSION, Record, canonical_json, new_id, utc_now
from .budget import BudgetReport, RolloutCorrFigures
from .capture import (
    Capture,
    CapturedChoice,
    CapturedToolCall,
    CaptureOutcome,
    CaptureTimings,
    ConversationSource,
)
from .decision import (
    RECOMMENDED_ACTION,
    DecisionReason,
    DecisionStatus,
    GroupDecision,
    RejectionReason,
)
from .errors import ErrorBody, ErrorCode, ErrorDetail
from .feedback import FEEDBACK_SCORE, ReportReceipt, TrainerFeedback
from .job import (
    EnqueueReceipt,
    FailureKind,
    FailureReport,
    JobView,
    LeaseGrant,
    LeaseRequirements,
    LeaseState,
    NoLeaseReason,
    RolloutJob,
    RolloutLease,
    SamplingConfig,
    TaskSpec,
)
from .observatory import (
    AgentDivergenceReport,
    DeltaToken,
    DenseMismatchReport,
    DivergenceKind,
    Interval,
    LengthPoint,
    MatrixCell,
    ObservatoryMatrix,
    PositionBucket,
    PositionProfile,
    RouterMismatchReport,
    WorstToken,
)
from .market import LagBin, MarketBucket, MarketFingerprint, MarketReport, MarketWorker, ReloadLatency, TrainerIdle
from .policy import PolicyManifest, ReloadAck, ReloadStatus
from .pool import AuditEvent, AuditPage, PoolStatus, WorkerDetail, WorkerSummary
from .sample import (
    FetchedGroup,
    FetchResult,
    FinishReason,
    GroupStatus,
    SampleGroup,
    SubmissionReceipt,
    Tier,
    Trajectory,
    content_hash,
)
from .worker import HeartbeatReply, WorkerHeartbeat, WorkerManifest, WorkerRegistration

__all__ = [name for name in dir() if not name.startswith("_")]
