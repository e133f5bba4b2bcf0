"""Sampling parameters and the batched sampler.

Which distribution a logprob comes from matters when two engines are compared. By default
(``logprobs_mode="processed"``) the logprob of a sampled token is taken from the distribution it
was actually drawn from: logits divided by the temperature, then top-k and top-p applied, then
renormalised. That is what vLLM reports with ``--logprobs-mode processed_logprobs`` and what
importance weights need. ``"raw"`` reports log_softmax of the unmodified logits (vLLM's default
``raw_logprobs``). At temperature 1 with top-p 1 and top-k off, the two are the same. Greedy
decoding (temperature 0) always reports raw logprobs.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 = off."""
    max_tokens: int = 256
    seed: int | None = None
    """Same seed, same prompt, same precision profile, same batch → the same tokens."""
    top_logprobs: int = 0
    """How many alternatives to report per position (0 = none)."""
    stop: tuple[str, ...] = ()
    """Strings that end a sequence; the tokens that complete one are kept, text is cut by the caller."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs_mode: Literal["processed", "raw"] = "processed"

    def __post_init__(self) -> None:
        if not (self.temperature >= 0):
            raise ValueError("temperature must be >= 0")
        if not (0 < self.top_p <= 1):
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0 or self.max_tokens < 1 or self.top_logprobs < 0:
            raise ValueError("top_k and top_logprobs must be >= 0 and max_tokens >= 1")


def sequence_key(seed: int | None, index: int) -> int:
    """The key of one sequence's random numbers: (seed, its index within its request) alone, so
    a sequence draws the same numbers whatever batch it runs in and whenever it joins one."""
    if seed is None:
        return int.from_bytes(os.urandom(8), "little") >> 2
    return int.from_bytes(hashlib.sha256(f"{seed}:{index}".encode()).digest()[:8], "little") >> 2


def processed_logits(logits_V: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (vLLM's order); masked entries become -inf.

    One row, written for reading: the specification the batched ``RowBatch.processed`` is
    tested against.
    """
    logits_V = logits_V / params.temperature
    if params.top_k and params.top_k < logits_V.shape[-1]:
        kth = torch.topk(logits_V, params.top_k).values[-1]
        logits_V = logits_V.masked_fill(logits_V < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_V, order_V = torch.sort(logits_V, descending=True)
        cumulative_V = sorted_V.softmax(-1).cumsum(-1)
        # Drop a token once the mass before it already reaches top_p; the first always stays.
        drop_sorted_V = (cumulative_V - sorted_V.softmax(-1)) >= params.top_p
        drop_V = torch.zeros_like(drop_sorted_V).scatter(0, order_V, drop_sorted_V)
        logits_V = logits_V.masked_fill(drop_V, float("-inf"))
    return logits_V


_M32 = 0xFFFFFFFF


def _mix32(x: np.ndarray) -> np.ndarray:
    """A 32-bit integer hash (xor-shift-multiply rounds) on uint64 arrays holding values below 2^32."""
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(0x7FEB352D)) & np.uint64(_M32)
    x = x ^ (x >> np.uint64(15))
    x = (x * np.uint64(0x846CA68B)) & np.uint64(_M32)
    return x ^ (x >> np.uint64(16))


def row_uniforms(keys: Sequence[int], steps: Sequence[int]) -> np.ndarray:
    """One uniform in [0, 1) per row, float64, a pure function of (key, step).

    Counter-based, so no generator state is carried per sequence: a sequence's number at its
    step t is the same in any batch, on any device. 53 bits from two hash chains: (m + 0.5) / 2^53
    is exact in float64 and strictly inside (0, 1). Computed on the host (a few dozen numpy
    operations on B values) so a decode step launches no kernels for its randomness.
    """
    m32 = np.uint64(_M32)
    keys_B = np.asarray(keys, dtype=np.uint64)
    steps_B = np.asarray(steps, dtype=np.uint64)
    high_B = _mix32((keys_B & m32) ^ _mix32((keys_B >> np.uint64(32)) ^ _mix32(steps_B & m32)))
    low_B = _mix32(high_B ^ np.uint64(0x5BD1E995))
    bits_B = (high_B << np.uint64(21)) | (low_B >> np.uint64(11))
    return (bits_B.astype(np.float64) + 0.5) * (1.0 / (1 << 53))


_BLOCK = 512
"""Vocabulary entries per block of the two-level search (``inverse_cdf``)."""
_TOP_P_CANDIDATES = 1024
"""Largest logits ordered for top-p on the CPU before falling back to a full sort (``RowBatch._top_p``)."""


def inverse_cdf(z_BV: torch.Tensor, uniforms_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw from softmax(z) per row with its uniform; returns (token_B, logsumexp_B of z).

    The token is the first id (vocabulary order) whose cumulative probability exceeds ``u``.
    Two levels keep it to about three passes over [B, V] (max, exp, block sums) with float64
    where sums get long: the block whose cumulative mass (float64 over float32 block sums)
    passes ``u`` is found first, then ``u``'s place inside that block, rescaled to the block's
    own float64 cumulative sums so the two levels cannot disagree. -inf entries are never drawn.
    """
    rows, vocab = z_BV.shape
    p_BV, block_cdf_BN, max_B1 = _block_masses(z_BV)
    total_B1 = block_cdf_BN[:, -1:]
    target_B1 = uniforms_B[:, None] * total_B1
    block_B1 = torch.searchsorted(block_cdf_BN, target_B1, right=True).clamp_(max=block_cdf_BN.shape[1] - 1)
    before_B1 = torch.where(block_B1 > 0, block_cdf_BN.gather(1, (block_B1 - 1).clamp(min=0)), 0.0)
    within_B1 = ((target_B1 - before_B1) / (block_cdf_BN.gather(1, block_B1) - before_B1)).clamp_(0.0, 1.0)
    ids_BK = block_B1 * _BLOCK + torch.arange(_BLOCK, device=z_BV.device)
    inside_BK = ids_BK < vocab
    ids_BK = ids_BK.clamp(max=vocab - 1)
    # -inf entries weigh e^-87 in p_BV (see _block_masses): exactly nothing here, where the draw lands.
    masked_BK = ~inside_BK | torch.isneginf(z_BV.gather(1, ids_BK))
    cdf_BK = p_BV.gather(1, ids_BK).masked_fill_(masked_BK, 0.0).double().cumsum(-1)
    offset_B1 = torch.searchsorted(cdf_BK, within_B1 * cdf_BK[:, -1:], right=True)
    # Never past the block's last entry of positive mass (float64 rounding at u ~ 1).
    offset_B1 = torch.minimum(offset_B1, (cdf_BK < cdf_BK[:, -1:]).sum(-1, keepdim=True))
    token_B = (block_B1 * _BLOCK + offset_B1)[:, 0]
    return token_B, (max_B1 + total_B1.float().log())[:, 0]


def _block_masses(z_BV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """exp(z - max) [B, V], the float64 cumulative sums of its blocks of ``_BLOCK`` [B, blocks],
    and the max [B, 1].

    Exponents are clamped at -87 first: exp of -inf and of what underflows to subnormals takes a
    slow path on the CPU (3x a whole pass). Such entries then weigh e^-87 ≈ 1.6e-38 against the
    max's 1, at most 2.5e-33 of a row in all: below float64's resolution of any cumulative sum a
    uniform can reach (≥ 2^-54), so they never decide the block, and ``inverse_cdf`` zeroes -inf
    entries inside the block it draws from.
    """
    rows, vocab = z_BV.shape
    max_B1 = z_BV.amax(-1, keepdim=True)
    p_BV = (z_BV - max_B1).clamp_(min=-87.0).exp_()  # unnormalised
    full = vocab // _BLOCK
    sums = [p_BV[:, :full * _BLOCK].view(rows, full, _BLOCK).sum(-1)] if full else []
    if vocab % _BLOCK:
        sums.append(p_BV[:, full * _BLOCK:].sum(-1, keepdim=True))
    return p_BV, torch.cat(sums, 1).double().cumsum(-1), max_B1


def logsumexp(z_BV: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dim, summed as ``inverse_cdf`` sums (so a row's raw and processed
    logprobs agree to the bit where the two distributions are the same)."""
    _, block_cdf_BN, max_B1 = _block_masses(z_BV)
    return (max_B1 + block_cdf_BN[:, -1:].float().log())[:, 0]


SETTINGS = ("temperature", "top_k", "top_p", "greedy", "processed", "top_logprobs")
"""The columns of a row's sampling settings as numbers (``RowBatch.settings``): what a decode step
that draws inside a CUDA graph takes as one input beside the token ids and uniforms."""


@dataclass(frozen=True)
class RowFlags:
    """What the rows of a batch use, decided on the host: which passes a draw runs. Hashable, so
    a graph that draws inside it keys its capture on them (``slots.SlotKV``)."""

    k_max: int
    """The largest k of the rows that use top-k (0: none does); decided on the host so the
    step needs no device sync."""
    any_top_p: bool
    any_temperature: bool
    """Some sampled row's temperature is not 1."""
    all_greedy: bool
    any_greedy: bool
    all_processed: bool
    none_processed: bool
    max_top: int

    @classmethod
    def of(cls, settings_BC: np.ndarray, vocab: int) -> "RowFlags":
        """The flags of rows given as ``RowBatch.settings``."""
        temperature, top_k, top_p, greedy, processed, top = (settings_BC[:, i] for i in range(len(SETTINGS)))
        greedy, processed = greedy > 0, processed > 0
        return cls(k_max=int(max((k for k in top_k if k < vocab), default=0)), any_top_p=bool((top_p < 1).any()),
                   any_temperature=bool((temperature != 1).any()), all_greedy=bool(greedy.all()),
                   any_greedy=bool(greedy.any()), all_processed=bool(processed.all()),
                   none_processed=not bool(processed.any()), max_top=int(top.max(initial=0)))


@dataclass(frozen=True)
class RowBatch:
    """The sampling settings of the rows of one batch, as tensors on the logits' device.

    Built once per batch composition (``from_params``); ``draw`` then samples every row of a
    decode step with a fixed number of kernels, whatever the mix of settings. ``packed`` is the
    same draw without the host: what a decode step replayed as a CUDA graph runs inside it.
    """

    params: tuple[SamplingParams, ...]
    keys: tuple[int, ...]
    """Each row's sequence key (``sequence_key``), on the host: the uniforms are drawn there."""
    flags: RowFlags
    temperature_B: torch.Tensor
    """1 where the row is greedy, so the division is harmless; ``greedy_B`` picks argmax there."""
    top_k_B: torch.Tensor
    """The k of each row, vocab where top-k is off."""
    top_p_B: torch.Tensor
    greedy_B: torch.Tensor
    processed_B: torch.Tensor
    """Report the processed distribution's logprobs (else the raw ones)."""
    settings_BC: np.ndarray | None = None
    """The same settings on the host (``settings``); None in a batch built inside a graph."""

    @staticmethod
    def settings(params: Sequence[SamplingParams], vocab: int) -> np.ndarray:
        """Each row's settings as the ``SETTINGS`` columns, float64 [B, 6] (exact for every value
        they hold: float32-rounded on the device as a tensor of the Python floats would be)."""
        rows = []
        for p in params:
            greedy = p.temperature == 0
            rows.append((1.0 if greedy else p.temperature, p.top_k if 0 < p.top_k < vocab else vocab,
                         p.top_p, greedy, p.logprobs_mode == "processed" and not greedy, p.top_logprobs))
        return np.asarray(rows, dtype=np.float64).reshape(len(rows), len(SETTINGS))

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], keys: Sequence[int], vocab: int,
                    device: torch.device | str) -> "RowBatch":
        settings_BC = cls.settings(params, vocab)
        on_device = torch.from_numpy(settings_BC).to(device, non_blocking=True)
        return cls.from_settings(on_device, RowFlags.of(settings_BC, vocab), params, keys, settings_BC)

    @classmethod
    def from_settings(cls, settings_BC: torch.Tensor, flags: RowFlags, params: Sequence[SamplingParams] = (),
                      keys: Sequence[int] = (), host_BC: np.ndarray | None = None) -> "RowBatch":
        """Rows whose settings are already on the device (``settings`` columns): no host work
        beyond slicing, so a CUDA graph can build its batch from a captured input."""
        return cls(params=tuple(params), keys=tuple(keys), flags=flags,
                   temperature_B=settings_BC[:, 0].float(), top_k_B=settings_BC[:, 1].long(),
                   top_p_B=settings_BC[:, 2].float(), greedy_B=settings_BC[:, 3] > 0,
                   processed_B=settings_BC[:, 4] > 0, settings_BC=host_BC)

    def processed(self, logits_BV: torch.Tensor) -> torch.Tensor:
        """``processed_logits`` for every row at once (masked entries -inf)."""
        # Every row at temperature 1 (or greedy) is the common case: no pass over [B, V] then.
        z_BV = logits_BV / self.temperature_B[:, None] if self.flags.any_temperature else logits_BV
        if self.flags.k_max:
            top_BK = torch.topk(z_BV, self.flags.k_max, dim=-1).values
            kth_B = top_BK.gather(1, (self.top_k_B.clamp(max=self.flags.k_max) - 1)[:, None])
            # Rows without top-k (k = vocab > k_max) get a threshold that masks nothing.
            kth_B = kth_B.masked_fill((self.top_k_B > self.flags.k_max)[:, None], float("-inf"))
            z_BV = z_BV.masked_fill(z_BV < kth_B, float("-inf"))
        if self.flags.any_top_p:
            z_BV = self._top_p(z_BV)
        return z_BV

    def _top_p(self, z_BV: torch.Tensor) -> torch.Tensor:
        """Mask what top-p drops: a token once the mass before it (descending order) reaches top_p.

        On the CPU a full sort of a 152k row is most of a step; when the ``_TOP_P_CANDIDATES``
        largest logits of every top-p row already hold top_p of its mass, every token beyond
        them is dropped anyway, so only they are ordered (same kept set). Elsewhere, and when
        they do not, the whole row is sorted (on CUDA always: the check would be a device sync).
        """
        applies_B = self.top_p_B < 1
        vocab = z_BV.shape[-1]
        if z_BV.device.type == "cpu" and vocab > 2 * _TOP_P_CANDIDATES:
            top_BK, ids_BK = torch.topk(z_BV, _TOP_P_CANDIDATES, dim=-1)  # sorted, descending
            p_BK = (top_BK - torch.logsumexp(z_BV, dim=-1, keepdim=True)).exp_()
            if bool(((p_BK.sum(-1) >= self.top_p_B) | ~applies_B).all()):
                drop_BK = ((p_BK.cumsum(-1) - p_BK) >= self.top_p_B[:, None]) & applies_B[:, None]
                keep_BV = torch.zeros_like(z_BV, dtype=torch.bool).scatter_(1, ids_BK, ~drop_BK)
                return z_BV.masked_fill(~(keep_BV | ~applies_B[:, None]), float("-inf"))
        sorted_BV, order_BV = torch.sort(z_BV, dim=-1, descending=True)
        p_BV = sorted_BV.softmax(-1)
        drop_sorted_BV = ((p_BV.cumsum(-1) - p_BV) >= self.top_p_B[:, None]) & applies_B[:, None]
        drop_BV = torch.zeros_like(drop_sorted_BV).scatter(1, order_BV, drop_sorted_BV)
        return z_BV.masked_fill(drop_BV, float("-inf"))

    def draw(self, logits_BV: torch.Tensor, steps: Sequence[int]) -> "Drawn":
        """Sample one token per row from float32 logits [B, V]; ``steps[b]`` is how many tokens
        row b has drawn before (its position in its own random stream)."""
        uniforms_B = None if self.flags.all_greedy else torch.from_numpy(
            row_uniforms(self.keys, steps)).to(logits_BV.device, non_blocking=True)
        # One transfer for the whole step.
        return Drawn(self.packed(logits_BV, uniforms_B).cpu().tolist(), self)

    def packed(self, logits_BV: torch.Tensor, uniforms_B: torch.Tensor | None) -> torch.Tensor:
        """``draw`` on the device, each row with its uniform: per row the token id, its logprob,
        then ``flags.max_top`` ids and their logprobs, float64 [B, 2 + 2·max_top] (token ids are
        exact in float64). No host sync, no host data: a CUDA graph can capture it."""
        flags = self.flags
        if flags.all_greedy:
            token_B = torch.argmax(logits_BV, dim=-1)
        else:
            assert uniforms_B is not None, "rows that sample need their uniforms"
            z_BV = self.processed(logits_BV)
            token_B, z_lse_B = inverse_cdf(z_BV, uniforms_B)
            if flags.any_greedy:
                token_B = torch.where(self.greedy_B, torch.argmax(logits_BV, dim=-1), token_B)
        # The reported distribution as (logits, logsumexp): each [B, V] pass costs at a 152k
        # vocabulary, so the raw one only where a row reports it, and no log_softmax pass at all.
        if flags.all_processed:
            report_BV, lse_B = z_BV, z_lse_B
        elif flags.none_processed:
            report_BV, lse_B = logits_BV, logsumexp(logits_BV)
        else:
            report_BV = torch.where(self.processed_B[:, None], z_BV, logits_BV)
            lse_B = torch.where(self.processed_B, z_lse_B, logsumexp(logits_BV))
        columns = [token_B[:, None].double(), (report_BV.gather(1, token_B[:, None]) - lse_B[:, None]).double()]
        if flags.max_top:
            top_values_BK, top_ids_BK = torch.topk(report_BV, min(flags.max_top, report_BV.shape[-1]), dim=-1)
            columns += [top_ids_BK.double(), (top_values_BK - lse_B[:, None]).double()]
        return torch.cat(columns, 1)


@dataclass(frozen=True)
class Drawn:
    """One decode step's draws, still packed as the rows the device sent back."""

    packed: list[list[float]]
    rows: RowBatch

    def __len__(self) -> int:
        return len(self.packed)

    def token_id(self, b: int) -> int:
        return int(self.packed[b][0])

    def logprob(self, b: int) -> float:
        return self.packed[b][1]

    def top(self, b: int) -> list[tuple[int, float]]:
        """The row's own ``top_logprobs`` best (token id, logprob) pairs; [] when it asked none."""
        n = self.rows.params[b].top_logprobs
        if not n:
            return []
        row = self.packed[b]
        k = (len(row) - 2) // 2
        n = min(n, k)
        return [(int(i), v) for i, v in zip(row[2:2 + n], row[2 + k:2 + k + n])]
