"""The numerical fingerprint: which numerics an engine really runs.

sha256 over the logprobs an engine assigns to a fixed canonical token set at the current
checkpoint, rounded to ``DECIMALS`` places. Rounding keeps the hash stable across repeated runs
of one build while two builds whose kernels or precisions differ (differences of 1e-4 and up)
land on different hashes. Inputs are fixed texts tokenized by the model's own tokenizer, scored
as one batch so the shapes, and so the kernels chosen, are the same on every run.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np

DECIMALS = 4
CANONICAL_TEXTS = (
    ("What is 17 * 23?", "The answer is 391."),
    ("Read the file notes/readme.txt and tell me the port.", "The port is 8080."),
    ("Who founded the town of Velmora?", "I will search for it."),
    ("Say hello.", "Hello! How can I help you today?"),
)

Scorer = Callable[[list[tuple[list[int], list[int]]]], list[np.ndarray]]


def canonical_pairs(tokenizer) -> list[tuple[list[int], list[int]]]:
    pairs = []
    for prompt, response in CANONICAL_TEXTS:
        p = tokenizer.encode(prompt, add_special_tokens=False)
        r = tokenizer.encode(" " + response, add_special_tokens=False)
        pairs.append((list(p), list(r)))
    return pairs


def fingerprint_from_logprobs(logprobs: list[np.ndarray]) -> str:
    digest = hashlib.sha256(f"rollmarket-fingerprint-v1:{DECIMALS}".encode())
    for lp in logprobs:
        rounded = np.round(np.asarray(lp, dtype=np.float64), DECIMALS)
        digest.update(np.ascontiguousarray(rounded + 0.0).tobytes())
    return "fp1:" + digest.hexdigest()


def engine_fingerprint(tokenizer, scorer: Scorer) -> str:
    """``scorer`` maps (prompt ids, response ids) pairs to per-token logprobs, one batch."""
    return fingerprint_from_logprobs(scorer(canonical_pairs(tokenizer)))
