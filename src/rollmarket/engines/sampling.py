"""Sampling parameters and the per-row sampler.

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
from dataclasses import dataclass, field
from typing import Literal

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


def sequence_generator(seed: int | None, index: int, device: torch.device) -> torch.Generator:
    """One generator per sequence, so a sequence's draws do not depend on its batch neighbours."""
    if seed is None:
        value = int.from_bytes(os.urandom(8), "little") >> 1
    else:
        value = int.from_bytes(hashlib.sha256(f"{seed}:{index}".encode()).digest()[:8], "little") >> 1
    gen = torch.Generator(device=device)
    gen.manual_seed(value)
    return gen


@dataclass
class Draw:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def processed_logits(logits_V: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (vLLM's order); masked entries become -inf."""
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


def draw(logits_V: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> Draw:
    """Sample one token from float32 logits and report its logprob (and the top alternatives)."""
    raw_V = torch.log_softmax(logits_V, dim=-1)
    if params.temperature == 0:
        token = int(torch.argmax(logits_V))
        report_V = raw_V
    else:
        processed_V = torch.log_softmax(processed_logits(logits_V, params), dim=-1)
        token = int(torch.multinomial(processed_V.exp(), 1, generator=generator))
        report_V = processed_V if params.logprobs_mode == "processed" else raw_V
    top: list[tuple[int, float]] = []
    if params.top_logprobs:
        values, ids = torch.topk(report_V, min(params.top_logprobs, report_V.shape[-1]))
        top = [(int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist())]
    return Draw(token, float(report_V[token]), top)
