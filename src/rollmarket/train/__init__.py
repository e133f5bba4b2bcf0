"""The reference trainer's algorithm core: advantages, token transforms, off-policy corrections, losses.

Pure tensor functions over shape-suffixed arrays (`rewards_G`, `logprobs_BT`, `mask_BT`); no model,
no I/O. Formulas and their sources are in docs/training.md, "Algorithms".
"""

from .advantages import ADVANTAGE_MODES, compute_advantages
from .corrections import Correction, masked_is, sequence_tis, token_tis
from .losses import LossConfig, policy_loss, token_logprobs
from .transforms import (
    TRANSFORM_MODES,
    SepaSchedule,
    TransformConfig,
    token_advantages,
    token_entropy,
)

__all__ = [
    "ADVANTAGE_MODES",
    "TRANSFORM_MODES",
    "Correction",
    "LossConfig",
    "SepaSchedule",
    "TransformConfig",
    "compute_advantages",
    "masked_is",
    "policy_loss",
    "sequence_tis",
    "token_advantages",
    "token_entropy",
    "token_logprobs",
    "token_tis",
]
