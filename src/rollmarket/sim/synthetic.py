"""What the simulated workers draw instead of generating: response tokens, rewards, fingerprints.

The gate judges a group by its logprobs against the trainer's (policy.py gives the real ones), not
by its text, so a simulated worker draws its response tokens from a fixed set of ordinary ids.
Token ids divisible by FORBIDDEN_MODULUS stand for tokens an honest sampler never emits: only the
broken low-precision profile samples them (and believes them likely).
"""

from __future__ import annotations

import hashlib

import numpy as np

from ..contracts import TaskSpec

VOCAB_SIZE = 512
"""Response tokens are drawn below this id (every shipped model's vocabulary is larger)."""
FORBIDDEN_MODULUS = 17
_ALLOWED_IDS = np.array([i for i in range(1, VOCAB_SIZE) if i % FORBIDDEN_MODULUS], dtype=np.int32)
_FORBIDDEN_IDS = np.array([i for i in range(1, VOCAB_SIZE) if i % FORBIDDEN_MODULUS == 0], dtype=np.int32)


def checkpoint_digest(version: int) -> str:
    """A digest no published checkpoint has (what a worker acks when it lies about its weights)."""
    return hashlib.sha256(f"rollmarket-sim-checkpoint-{version}".encode()).hexdigest()


def fingerprint(engine: str, version: int) -> str:
    return hashlib.sha256(f"{engine}:{version}".encode()).hexdigest()[:32]


def sample_tokens(rng: np.random.Generator, n: int, *, forbidden_share: float = 0.0) -> np.ndarray:
    """int32 [n] token ids; a `forbidden_share` of them drawn from the forbidden set."""
    ids = rng.choice(_ALLOWED_IDS, size=n)
    if forbidden_share > 0:
        pick = rng.random(n) < forbidden_share
        ids[pick] = rng.choice(_FORBIDDEN_IDS, size=int(pick.sum()))
    return ids.astype(np.int32)


def reward(task: TaskSpec, sample_index: int, response_ids_T: np.ndarray) -> float:
    """A verifier stand-in: deterministic, about one in three samples correct."""
    return float((int(response_ids_T[:4].sum()) + sample_index + len(task.task_id)) % 3 == 0)
