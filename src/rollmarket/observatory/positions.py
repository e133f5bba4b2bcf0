"""Per-token mismatch by position in the response: the length view's answer to "does drift grow
along the response?".

Token ESS per trajectory, (Σw)²/(n·Σw²), is a ratio of sample means: its expectation falls with n
even when every token's Δ is drawn alike (n = 1 gives exactly 1), so ESS against length cannot tell
drift that accumulates from a short trajectory's small-sample bias. Per-token figures pooled over
all trajectories by position can: |Δ| and k3 at positions 0–15 against positions 1024–2047.

Buckets: [0, 16), then doubling: [16, 32), [32, 64), [64, 128), … — position t (0-based index in
the response, masked-out tokens keep their index but are not counted) falls in bucket 0 when
t < 16, else in bucket ⌊log2(t / 16)⌋ + 1. Per bucket: the valid tokens in it, the trajectories
that have one there, mean |Δ| and mean k3 = mean(r − log r − 1), r = exp(clip(Δ, ±c)) (the dense
summary's `kl_k3`, per token).

Length probes are sampled with `ignore_eos` to reach their length; what the model would not have
written (every token after the first EOS) is excluded (`after_eos_mask`), and counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from .dense import CLAMP

FIRST_BUCKET = 16
"""Width of the first bucket [0, 16); each later bucket is twice the one before."""


def bucket_index_T(positions_T: np.ndarray) -> np.ndarray:
    """int64 [T]: the bucket of each 0-based position (0 for t < 16, then ⌊log2(t/16)⌋ + 1)."""
    positions_T = np.asarray(positions_T, dtype=np.int64)
    if (positions_T < 0).any():
        raise ValueError("positions must be non-negative")
    out_T = np.zeros(positions_T.shape, dtype=np.int64)
    late_T = positions_T >= FIRST_BUCKET
    # Integer arithmetic (bit length) instead of float log2: no rounding at the powers of two.
    quotient_T = positions_T[late_T] // FIRST_BUCKET
    out_T[late_T] = np.array([int(q).bit_length() for q in quotient_T], dtype=np.int64)
    return out_T


def bucket_bounds(index: int) -> tuple[int, int]:
    """[start, stop) of bucket `index`."""
    if index < 0:
        raise ValueError("bucket index must be non-negative")
    if index == 0:
        return 0, FIRST_BUCKET
    return FIRST_BUCKET << (index - 1), FIRST_BUCKET << index


def after_eos_mask(token_ids_T, eos_token_ids: Iterable[int]) -> np.ndarray:
    """bool [T]: True for every token after the first EOS (the EOS itself was sampled and stays)."""
    ids_T = np.asarray(token_ids_T)
    eos = np.asarray(sorted(set(int(e) for e in eos_token_ids)), dtype=np.int64)
    if ids_T.ndim != 1:
        raise ValueError("token ids must be 1-D")
    is_eos_T = np.isin(ids_T, eos) if eos.size else np.zeros(ids_T.shape, dtype=bool)
    if not is_eos_T.any():
        return np.zeros(ids_T.shape, dtype=bool)
    first = int(np.argmax(is_eos_T))
    out_T = np.zeros(ids_T.shape, dtype=bool)
    out_T[first + 1:] = True
    return out_T


@dataclass(frozen=True, slots=True)
class PositionStats:
    """The valid tokens of one position bucket, pooled over trajectories."""

    start: int
    stop: int
    n_tokens: int
    n_trajectories: int
    mean_abs_delta: float
    kl_k3: float


def position_profile(
    trajectories: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray | None]],
    clamp: float = CLAMP,
) -> list[PositionStats]:
    """Per-bucket |Δ| and k3 over (rollout_logprobs_T, trainer_logprobs_T, valid_T or None) triples.

    Only buckets holding at least one valid token are returned, in position order. Raises
    ValueError on shapes that differ or non-finite logprobs among the valid tokens.
    """
    abs_sum: dict[int, float] = {}
    k3_sum: dict[int, float] = {}
    tokens: dict[int, int] = {}
    trajectories_in: dict[int, int] = {}
    for index, (rollout_T, trainer_T, valid_T) in enumerate(trajectories):
        rollout_T = np.asarray(rollout_T, dtype=np.float64)
        trainer_T = np.asarray(trainer_T, dtype=np.float64)
        if rollout_T.ndim != 1 or rollout_T.shape != trainer_T.shape:
            raise ValueError(f"trajectory {index}: logprob shapes differ: {rollout_T.shape} vs {trainer_T.shape}")
        valid_T = np.ones(rollout_T.shape, bool) if valid_T is None else np.asarray(valid_T, dtype=bool)
        if valid_T.shape != rollout_T.shape:
            raise ValueError(f"trajectory {index}: mask shape {valid_T.shape} vs logprobs {rollout_T.shape}")
        positions_N = np.flatnonzero(valid_T)
        delta_N = trainer_T[valid_T] - rollout_T[valid_T]
        if not np.isfinite(delta_N).all():
            raise ValueError(f"trajectory {index}: NaN or infinite logprobs among the valid tokens")
        clipped_N = np.clip(delta_N, -clamp, clamp)
        k3_N = np.expm1(clipped_N) - clipped_N
        bucket_N = bucket_index_T(positions_N)
        for b in np.unique(bucket_N):
            in_b = bucket_N == b
            key = int(b)
            abs_sum[key] = abs_sum.get(key, 0.0) + float(np.abs(delta_N[in_b]).sum())
            k3_sum[key] = k3_sum.get(key, 0.0) + float(k3_N[in_b].sum())
            tokens[key] = tokens.get(key, 0) + int(in_b.sum())
            trajectories_in[key] = trajectories_in.get(key, 0) + 1
    out = []
    for key in sorted(tokens):
        start, stop = bucket_bounds(key)
        n = tokens[key]
        out.append(PositionStats(start=start, stop=stop, n_tokens=n, n_trajectories=trajectories_in[key],
                                 mean_abs_delta=abs_sum[key] / n, kl_k3=k3_sum[key] / n))
    return out
