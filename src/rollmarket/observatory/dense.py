"""Token-probability mismatch between a rollout engine and a trainer engine (DESIGN.md, 'Formulas').

Δ_t = logπ_trainer(y_t) − logπ_rollout(y_t) over valid tokens, c the clamp (20), w_t = exp(clip(Δ_t, ±c)):

    token ESS        (Σw)² / (n·Σw²)                     ours; verl's `rollout_is_eff_sample_size` clips
                                                         w to [1/C, C] first (offpolicy.py)
    sequence ESS     (ΣW_i)² / (m·ΣW_i²), W_i = exp(clip(Σ_t Δ_{i,t}, ±c))
    mean Δ, mean |Δ|, max |Δ| (unclipped)
    clipped / veto   share of tokens with |Δ| > c / |Δ| > veto (30)
    second moment    mean(w²)
    top-1% mass      share of Σw held by the largest ⌈n/100⌉ weights
    k1, k3, χ²       mean(−Δ), mean(r − log r − 1), mean(r²) − 1 with r = w (the clamped ratio)
    log-perplexity   −mean(logπ) of each side; diff = trainer − rollout (= k1)
    mean_prob_diff   mean |p_rollout − p_trainer|

This is the one implementation: the gate's BudgetReport (`gate/budget.py`) is computed here too.

Speed: the tokens are processed in cache-sized chunks with reused buffers, sums accumulate in
float64, float32 input stays float32 element-wise, and the top 1% comes from one `partition`
(`benchmarks/dense_summary.py`: about 100M tokens/s on one core; the issue asks for 20M).
Numerics: the weights are taken relative to the running maximum of clip(Δ) (the max-shift trick),
so no exp overflows whatever the clamp or n; k3, χ² and |p_r − p_t| use expm1(Δ) so they keep
their precision when the engines nearly agree (where exp(Δ) − 1 would be float rounding).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from ..contracts import DenseMismatchReport, WorstToken

CLAMP = 20.0
"""c: the log-ratio clamp (DESIGN.md)."""
VETO = 30.0
"""|Δ| above which a token vetoes its group (DESIGN.md)."""
CHUNK = 1 << 15
"""Tokens per chunk: the chunk's buffers stay in L2 between the passes over it."""
_FLOAT32_SAFE_CLAMP = 30.0
# expm1(clip Δ)² summed over a chunk stays below float32's 3.4e38 while CHUNK·e^(2c) does
# (c < 39); above this clamp the arithmetic is float64.


@dataclass(frozen=True, slots=True)
class DenseSummary:
    """Mismatch statistics over the valid tokens of one or more sequences.

    Every statistic is None when there are no valid tokens (n_tokens = 0).
    """

    n_tokens: int
    """Valid tokens compared."""
    n_sequences: int
    """Sequences the tokens came from (sequence ESS is over these)."""
    clamp: float
    veto: float
    token_ess: float | None
    """(Σw)² / (n·Σw²) in (0, 1]; 1 = the engines agree."""
    sequence_ess: float | None
    """(ΣW_i)² / (m·ΣW_i²) over the sequences; 1.0 for a single sequence."""
    sequence_log_ratio: float
    """ΣΔ over all valid tokens (unclamped); 0.0 when there are none."""
    mean_delta: float | None
    mean_abs_delta: float | None
    max_abs_delta: float | None
    """Unclamped."""
    clipped_fraction: float | None
    """Share of tokens with |Δ| > clamp."""
    veto_fraction: float | None
    """Share of tokens with |Δ| > veto."""
    second_moment: float | None
    """mean(w²)."""
    top1pct_gradient_mass: float | None
    """Share of Σw held by the largest ⌈n/100⌉ weights."""
    kl_k1: float | None
    """mean(logπ_rollout − logπ_trainer)."""
    kl_k3: float | None
    """mean(r − log r − 1), r = exp(clip(Δ))."""
    chi2: float | None
    """mean(r²) − 1."""
    log_ppl_rollout: float | None
    """−mean(logπ_rollout)."""
    log_ppl_trainer: float | None
    """−mean(logπ_trainer)."""
    log_ppl_diff: float | None
    """log_ppl_trainer − log_ppl_rollout."""
    mean_prob_diff: float | None
    """mean |p_rollout − p_trainer| (verl: < 0.005 healthy, > 0.01 a precision bug)."""


def _as_logprobs(values, name: str) -> np.ndarray:
    array = np.asarray(values)
    if array.dtype == np.float64 or array.dtype == np.float32:
        return array
    if array.dtype.kind not in "fiub":
        raise ValueError(f"{name}: logprobs must be numbers, got dtype {array.dtype}")
    return array.astype(np.float32 if array.dtype == np.float16 else np.float64)


def _check_settings(clamp: float, veto: float) -> None:
    if not (math.isfinite(clamp) and clamp > 0):
        raise ValueError(f"clamp must be a positive finite number, got {clamp}")
    if not veto > 0:
        raise ValueError(f"veto must be positive, got {veto}")


def _valid_lengths(lengths, total: int, mask_N: np.ndarray | None) -> np.ndarray:
    """int64 [m]: valid tokens per sequence, from the per-sequence entry counts `lengths`."""
    lengths_S = np.asarray(lengths)
    if lengths_S.size == 0:
        lengths_S = lengths_S.astype(np.int64)
    if lengths_S.ndim != 1 or lengths_S.dtype.kind not in "iu" or (lengths_S < 0).any():
        raise ValueError("lengths must be a 1-D array of non-negative integers")
    lengths_S = lengths_S.astype(np.int64)
    if int(lengths_S.sum()) != total:
        raise ValueError(f"lengths sum to {int(lengths_S.sum())} but there are {total} tokens")
    if mask_N is None:
        return lengths_S
    ends_S = np.cumsum(lengths_S)
    valid_before_N1 = np.concatenate(([0], np.cumsum(mask_N, dtype=np.int64)))
    return np.diff(valid_before_N1[ends_S], prepend=0)


def _segment_sums(values_N: np.ndarray, lengths_S: np.ndarray) -> np.ndarray:
    """float64 [m]: the sum of each consecutive segment (0.0 for an empty one)."""
    sums_S = np.zeros(lengths_S.shape[0], dtype=np.float64)
    nonempty_S = lengths_S > 0
    if nonempty_S.any():
        starts_S = np.cumsum(lengths_S) - lengths_S
        # In the input's dtype: numpy sums each segment pairwise (error ~ eps·log2 of its length),
        # and a float64 accumulator would cost a cast per element (7× slower).
        sums_S[nonempty_S] = np.add.reduceat(values_N, starts_S[nonempty_S])
    return sums_S


def sequence_ess(sequence_log_ratios_S, clamp: float = CLAMP) -> float | None:
    """(ΣW)² / (m·ΣW²) with W_i = exp(clip(ΣΔ_i, ±c)), or None for no sequences.

    The weights are shifted by their maximum (the ratio does not change), so nothing overflows.
    """
    log_w_S = np.clip(np.asarray(sequence_log_ratios_S, dtype=np.float64), -clamp, clamp)
    if log_w_S.size == 0:
        return None
    w_S = np.exp(log_w_S - log_w_S.max())
    return min(1.0, float(w_S.sum() ** 2 / (w_S.size * np.dot(w_S, w_S))))


def dense_summary(
    rollout_logprobs,
    trainer_logprobs,
    mask=None,
    clamp: float = CLAMP,
    veto: float = VETO,
    *,
    lengths=None,
) -> DenseSummary:
    """The mismatch statistics of `trainer − rollout` over the tokens where `mask` is True.

    `rollout_logprobs` and `trainer_logprobs` are 1-D float arrays of one length T (float32 stays
    float32 element-wise; sums accumulate in float64). `lengths` splits the T entries into
    consecutive sequences (its sum is T) for the sequence ESS; without it they are one sequence.
    Masked-out entries are ignored whatever they hold. Raises ValueError on arrays of other shapes, a mask of
    the wrong length, bad lengths, or a NaN or infinite logprob among the valid tokens.
    """
    _check_settings(clamp, veto)
    rollout_N = _as_logprobs(rollout_logprobs, "rollout_logprobs")
    trainer_N = _as_logprobs(trainer_logprobs, "trainer_logprobs")
    if rollout_N.ndim != 1 or rollout_N.shape != trainer_N.shape:
        raise ValueError(f"logprobs must be 1-D of one length: {rollout_N.shape} vs {trainer_N.shape}")
    mask_N = None
    if mask is not None:
        mask_N = np.asarray(mask, dtype=bool)
        if mask_N.shape != rollout_N.shape:
            raise ValueError(f"mask shape {mask_N.shape} does not match logprobs {rollout_N.shape}")
    lengths_S = None if lengths is None else _valid_lengths(lengths, rollout_N.shape[0], mask_N)
    if mask_N is not None:
        rollout_N, trainer_N = rollout_N[mask_N], trainer_N[mask_N]
    n_sequences = 1 if lengths_S is None else int(lengths_S.shape[0])

    dtype = np.float64 if clamp > _FLOAT32_SAFE_CLAMP else np.result_type(rollout_N, trainer_N)
    rollout_N = rollout_N.astype(dtype, copy=False)
    trainer_N = trainer_N.astype(dtype, copy=False)
    n = rollout_N.shape[0]
    if n == 0:
        nothing: dict[str, Any] = {f.name: None for f in fields(DenseSummary)}
        return DenseSummary(**{**nothing, "n_tokens": 0, "n_sequences": n_sequences, "clamp": clamp,
                               "veto": veto, "sequence_log_ratio": 0.0})

    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        s, delta_N = _chunked_sums(rollout_N, trainer_N, clamp, veto)

    seq_ess = 1.0 if lengths_S is None or n_sequences == 1 else sequence_ess(_segment_sums(delta_N, lengths_S), clamp)
    # The top ⌈n/100⌉ weights are the weights of the top ⌈n/100⌉ Δ (clip and exp are monotone).
    k = -(-n // 100)
    delta_N.partition(n - k)
    top_log_w = np.clip(delta_N[n - k:].astype(np.float64), -clamp, clamp) - s.shift
    top_mass = float(np.exp(top_log_w).sum() / s.w)

    second_moment = math.exp(2.0 * s.shift) * s.w2 / n
    mean_delta = s.d / n
    return DenseSummary(
        n_tokens=n,
        n_sequences=n_sequences,
        clamp=clamp,
        veto=veto,
        # ≤ 1 by Cauchy–Schwarz; float sums can land a hair above it when the engines agree.
        token_ess=min(1.0, s.w * s.w / (n * s.w2)),
        sequence_ess=seq_ess,
        sequence_log_ratio=s.d,
        mean_delta=mean_delta,
        mean_abs_delta=s.abs_d / n,
        max_abs_delta=s.max_abs_d,
        clipped_fraction=s.clipped / n,
        veto_fraction=s.vetoed / n,
        second_moment=second_moment,
        top1pct_gradient_mass=top_mass,
        kl_k1=-mean_delta,
        # r − log r − 1 = expm1(clip Δ) − clip Δ, the two summed apart in float64.
        kl_k3=(s.u - (s.d + s.clip_excess)) / n,
        # mean(r²) − 1 = mean(2u + u²), u = expm1(clip Δ): no cancellation near r = 1.
        chi2=(2.0 * s.u + s.u2) / n,
        log_ppl_rollout=-s.r / n,
        log_ppl_trainer=-s.t / n,
        # −mean(lp_t) + mean(lp_r) = −mean(Δ): taken from ΣΔ so that no two large sums cancel.
        log_ppl_diff=-mean_delta,
        mean_prob_diff=s.prob_diff / n,
    )


@dataclass(slots=True)
class _Sums:
    """Running float64 sums over the chunks."""

    r: float = 0.0
    t: float = 0.0
    d: float = 0.0
    abs_d: float = 0.0
    clip_excess: float = 0.0
    """Σ(clip Δ − Δ): nonzero only over clipped chunks."""
    u: float = 0.0
    """Σ expm1(clip Δ)."""
    u2: float = 0.0
    """Σ expm1(clip Δ)²."""
    w: float = 0.0
    """Σ exp(clip Δ − shift)."""
    w2: float = 0.0
    """Σ exp(clip Δ − shift)²."""
    shift: float = -math.inf
    """The running maximum of clip Δ."""
    prob_diff: float = 0.0
    max_abs_d: float = 0.0
    clipped: int = 0
    vetoed: int = 0


def _chunked_sums(rollout_N: np.ndarray, trainer_N: np.ndarray, clamp: float, veto: float):
    """One pass over the tokens in chunks: the sums every statistic is built from, and Δ [N].

    The weights are summed as exp(clip Δ − shift) with shift the running maximum of clip Δ; when
    it grows, the sums so far are rescaled (the max-shift trick), so no exp can overflow.
    """
    n = rollout_N.shape[0]
    dtype = rollout_N.dtype
    f64 = np.float64
    s = _Sums()
    delta_N = np.empty(n, dtype=dtype)
    size = min(n, CHUNK)
    abs_B, clip_B, u_B, w_B, p_B = (np.empty(size, dtype=dtype) for _ in range(5))
    for start in range(0, n, CHUNK):
        stop = min(start + CHUNK, n)
        b = stop - start
        r, t, d = rollout_N[start:stop], trainer_N[start:stop], delta_N[start:stop]
        a, u, w, p = abs_B[:b], u_B[:b], w_B[:b], p_B[:b]

        chunk_r, chunk_t = float(r.sum(dtype=f64)), float(t.sum(dtype=f64))
        if not math.isfinite(chunk_r + chunk_t):
            side = "rollout" if not math.isfinite(chunk_r) else "trainer"
            raise ValueError(f"{side} logprobs hold NaN or infinite values among the valid tokens")
        s.r += chunk_r
        s.t += chunk_t

        np.subtract(t, r, out=d)
        hi, lo = float(d.max()), float(d.min())
        chunk_max_abs = max(hi, -lo)
        s.max_abs_d = max(s.max_abs_d, chunk_max_abs)
        chunk_d = float(d.sum(dtype=f64))
        s.d += chunk_d
        np.abs(d, out=a)
        s.abs_d += float(a.sum(dtype=f64))
        if chunk_max_abs > veto:
            s.vetoed += int(np.count_nonzero(a > veto))
        unclipped = chunk_max_abs <= clamp
        if unclipped:
            cd = d
        else:
            s.clipped += int(np.count_nonzero(a > clamp))
            cd = np.clip(d, -clamp, clamp, out=clip_B[:b])
            s.clip_excess += float(cd.sum(dtype=f64)) - chunk_d

        np.expm1(cd, out=u)
        s.u += float(u.sum(dtype=f64))
        s.u2 += float(np.dot(u, u))

        np.exp(r, out=p)
        if unclipped:
            # |p_r − p_t| = p_r·|exp(Δ) − 1|: no cancellation when the engines nearly agree.
            np.abs(u, out=a)
            s.prob_diff += float(np.dot(p, a))
        else:
            np.exp(t, out=w)
            np.subtract(p, w, out=p)
            np.abs(p, out=p)
            s.prob_diff += float(p.sum(dtype=f64))

        chunk_shift = float(cd.max()) if not unclipped else hi
        if chunk_shift > s.shift:
            if s.w:
                scale = math.exp(s.shift - chunk_shift)
                s.w *= scale
                s.w2 *= scale * scale
            s.shift = chunk_shift
        if s.shift:
            np.subtract(cd, s.shift, out=w)
            np.exp(w, out=w)
        else:
            np.exp(cd, out=w)
        s.w += float(w.sum(dtype=f64))
        s.w2 += float(np.dot(w, w))
    return s, delta_N


def dense_summary_many(
    rollout_logprobs: Sequence,
    trainer_logprobs: Sequence,
    masks: Sequence | None = None,
    clamp: float = CLAMP,
    veto: float = VETO,
) -> DenseSummary:
    """`dense_summary` over several sequences (one array per sequence), with the sequence ESS."""
    if len(rollout_logprobs) != len(trainer_logprobs) or (masks is not None and len(masks) != len(rollout_logprobs)):
        raise ValueError("one rollout array, one trainer array (and one mask) per sequence")
    if not rollout_logprobs:
        return dense_summary(np.zeros(0), np.zeros(0), clamp=clamp, veto=veto, lengths=np.zeros(0, np.int64))
    rollouts = [np.asarray(x) for x in rollout_logprobs]
    trainers = [np.asarray(x) for x in trainer_logprobs]
    valid = None if masks is None else [np.asarray(m, dtype=bool) for m in masks]
    for index, (rollout_T, trainer_T) in enumerate(zip(rollouts, trainers)):
        if rollout_T.ndim != 1 or rollout_T.shape != trainer_T.shape or (
                valid is not None and valid[index].shape != rollout_T.shape):
            raise ValueError(f"sequence {index}: logprob (and mask) shapes differ: {rollout_T.shape} vs "
                             f"{trainer_T.shape}")
    lengths_S = np.array([x.shape[0] for x in rollouts], dtype=np.int64)
    mask = None if valid is None else np.concatenate(valid)
    return dense_summary(np.concatenate(rollouts), np.concatenate(trainers), mask, clamp, veto,
                         lengths=lengths_S)


def worst_token_index(rollout_logprobs, trainer_logprobs, mask=None) -> int | None:
    """The position (in the unmasked array) of the valid token with the largest |Δ|, or None."""
    rollout_T = _as_logprobs(rollout_logprobs, "rollout_logprobs")
    trainer_T = _as_logprobs(trainer_logprobs, "trainer_logprobs")
    if rollout_T.ndim != 1 or rollout_T.shape != trainer_T.shape:
        raise ValueError(f"logprobs must be 1-D of one length: {rollout_T.shape} vs {trainer_T.shape}")
    abs_T = np.abs(trainer_T.astype(np.float64) - rollout_T)
    if mask is not None:
        mask_T = np.asarray(mask, dtype=bool)
        if mask_T.shape != abs_T.shape:
            raise ValueError(f"mask shape {mask_T.shape} does not match logprobs {abs_T.shape}")
        abs_T = np.where(mask_T, abs_T, -1.0)
    if abs_T.size == 0 or abs_T.max() < 0:
        return None
    return int(np.argmax(abs_T))


def to_report(
    summary: DenseSummary,
    *,
    trajectory_id: str,
    rollout_engine: str,
    trainer_engine: str,
    response_length: int,
    worst_token: WorstToken | None = None,
) -> DenseMismatchReport:
    """The DenseMismatchReport of one trajectory from its summary."""
    s = summary
    return DenseMismatchReport(
        trajectory_id=trajectory_id, rollout_engine=rollout_engine, trainer_engine=trainer_engine,
        n_tokens=s.n_tokens, token_ess=s.token_ess, sequence_log_ratio=s.sequence_log_ratio,
        mean_delta=s.mean_delta, mean_abs_delta=s.mean_abs_delta, max_abs_delta=s.max_abs_delta,
        clipped_fraction=s.clipped_fraction, veto_fraction=s.veto_fraction,
        second_moment=s.second_moment, top1pct_gradient_mass=s.top1pct_gradient_mass,
        kl_k1=s.kl_k1, kl_k3=s.kl_k3, chi2=s.chi2, log_ppl_rollout=s.log_ppl_rollout,
        log_ppl_trainer=s.log_ppl_trainer, log_ppl_diff=s.log_ppl_diff,
        mean_prob_diff=s.mean_prob_diff, response_length=response_length, worst_token=worst_token,
    )
