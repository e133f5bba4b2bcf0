"""The embedded rollout engine: batched sampling with a KV cache over a transformers model.

One call runs a batch of sequences together: a left-padded prefill, then one decode step per
token for all unfinished rows, reusing the cache. Each step reports, per sequence, the sampled
token, its logprob (see ``sampling`` for which distribution), optional top alternatives and,
for MoE models, the experts of the forward step that produced the token.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from .loading import LoadedModel, load_model
from .precision import Precision
from .routing import RouterCapture
from .teacher import TrainerEngine
from .sampling import Draw, SamplingParams, draw, sequence_generator


@dataclass
class StepEvent:
    """One new token of one sequence."""

    index: int
    """Position of the sequence in the batch passed to ``stream``."""
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    experts_LK: np.ndarray | None
    finish_reason: str | None
    """``stop`` (end-of-sequence token or stop string), ``length``, or None while running."""


@dataclass
class Generation:
    """A finished sequence, with everything the contracts need to keep."""

    prompt_token_ids_P: np.ndarray
    token_ids_T: np.ndarray
    logprobs_T: np.ndarray
    top_logprobs: list[list[tuple[int, float]]] | None
    routed_experts_TLK: np.ndarray | None
    """Row t: experts of the step that produced token t (it was fed token t-1, or the last
    prompt token for t = 0). int16, column 0 = top-1."""
    prompt_routed_experts_PLK: np.ndarray | None
    """Experts of prompt positions 0 .. P-2 (each fed that token); with ``routed_experts_TLK``
    this covers every position fed to the model, the [0, seqlen-1) span SGLang returns."""
    finish_reason: str
    stop_hit: str | None = None
    wall_s: float = 0.0


@dataclass
class _Row:
    prompt: np.ndarray
    params: SamplingParams
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    experts: list[np.ndarray] = field(default_factory=list)
    prompt_experts: np.ndarray | None = None
    finish: str | None = None
    stop_hit: str | None = None


class RolloutEngine:
    """Sampling over a loaded model. Not thread-safe: one caller (or the server's batcher)."""

    name = "rollmarket-hf"

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.info = loaded.info
        # transformers 5 renamed ``past_key_values`` to ``cache``; older releases know only the former.
        forward_args = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward_args else "past_key_values"
        self._fingerprint: str | None = None
        self.pad_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None
                          else self.info.eos_token_ids[0])

    @classmethod
    def from_path(cls, path, precision: str | Precision = "fp32", device="cpu") -> "RolloutEngine":
        return cls(load_model(path, precision, device))

    @property
    def precision(self) -> Precision:
        return self.loaded.precision

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=True,
                                                 add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[Generation]:
        started = time.perf_counter()
        rows: dict[int, list[StepEvent]] = {i: [] for i in range(len(prompts))}
        holder: list[list[_Row]] = []
        for events in self.stream(prompts, params, _rows_out=holder):
            for ev in events:
                rows[ev.index].append(ev)
        wall = time.perf_counter() - started
        return [self._finish(row, wall) for row in holder[0]]

    def _finish(self, row: _Row, wall: float) -> Generation:
        K = self.info.top_k
        L = self.info.num_moe_layers
        experts = np.stack(row.experts).astype(np.int16) if row.experts else (
            np.zeros((0, L, K), np.int16) if self.info.is_moe else None)
        return Generation(
            prompt_token_ids_P=row.prompt.astype(np.int32),
            token_ids_T=np.asarray(row.tokens, np.int32),
            logprobs_T=np.asarray(row.logprobs, np.float32),
            top_logprobs=row.top if row.params.top_logprobs else None,
            routed_experts_TLK=experts if self.info.is_moe else None,
            prompt_routed_experts_PLK=row.prompt_experts,
            finish_reason=row.finish or "length",
            stop_hit=row.stop_hit,
            wall_s=wall,
        )

    @torch.no_grad()
    def stream(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
               *, seeds_index: list[int] | None = None, _rows_out: list | None = None,
               should_abort: Callable[[], bool] | None = None) -> Iterator[list[StepEvent]]:
        """Yield, after each decode step, the new token of every sequence still running.

        ``seeds_index`` gives each sequence its index within its request (choice i of n), so
        seeded sequences draw the same numbers whatever batch they land in.
        """
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts) or not prompts:
            raise ValueError("need one SamplingParams per prompt and at least one prompt")
        seeds_index = seeds_index or list(range(len(prompts)))
        rows = []
        for prompt, p, si in zip(prompts, params, seeds_index):
            arr = np.asarray(prompt, dtype=np.int64)
            if arr.size == 0:
                raise ValueError("empty prompt")
            if arr.size + p.max_tokens > self.info.max_context_tokens:
                raise ValueError(f"prompt of {arr.size} tokens + max_tokens {p.max_tokens} exceeds "
                                 f"the context of {self.info.max_context_tokens}")
            rows.append(_Row(arr, p, sequence_generator(p.seed, si, torch.device("cpu"))))
        if _rows_out is not None:
            _rows_out.append(rows)
        device = self.loaded.device
        B = len(rows)
        longest = max(r.prompt.size for r in rows)
        ids_BS = torch.full((B, longest), self.pad_id, dtype=torch.long)
        mask_BS = torch.zeros((B, longest), dtype=torch.long)
        for b, r in enumerate(rows):
            ids_BS[b, longest - r.prompt.size:] = torch.from_numpy(r.prompt)
            mask_BS[b, longest - r.prompt.size:] = 1
        ids_BS, mask_BS = ids_BS.to(device), mask_BS.to(device)
        position_BS = (mask_BS.cumsum(-1) - 1).clamp(min=0)
        capture = RouterCapture(self.model, self.info.top_k or 1)
        from transformers import DynamicCache
        cache = DynamicCache()
        eos = set(self.info.eos_token_ids)
        max_steps = max(r.params.max_tokens for r in rows)
        with capture:
            out = self.model(input_ids=ids_BS, attention_mask=mask_BS, position_ids=position_BS,
                             use_cache=True, logits_to_keep=1, **{self._cache_arg: cache})
            experts_BSLK = capture.take(B, longest) if capture.active else None
            if experts_BSLK is not None:
                for b, r in enumerate(rows):
                    start = longest - r.prompt.size
                    r.prompt_experts = experts_BSLK[b, start:longest - 1].numpy()
            step_experts_BLK = experts_BSLK[:, -1] if experts_BSLK is not None else None
            next_pos_B = position_BS[:, -1] + 1
            for step in range(max_steps):
                logits_BV = out.logits[:, -1].float().cpu()
                events: list[StepEvent] = []
                fed = torch.full((B,), self.pad_id, dtype=torch.long)
                for b, r in enumerate(rows):
                    if r.finish is not None:
                        continue
                    d: Draw = draw(logits_BV[b], r.params, r.generator)
                    r.tokens.append(d.token_id)
                    r.logprobs.append(d.logprob)
                    if r.params.top_logprobs:
                        r.top.append(d.top)
                    experts_LK = None
                    if step_experts_BLK is not None:
                        experts_LK = step_experts_BLK[b].numpy()
                        r.experts.append(experts_LK)
                    r.finish = self._finish_reason(r, d.token_id, eos)
                    fed[b] = d.token_id
                    events.append(StepEvent(b, d.token_id, d.logprob, d.top, experts_LK, r.finish))
                yield events
                if all(r.finish is not None for r in rows) or (should_abort and should_abort()):
                    break
                mask_BS = torch.cat([mask_BS, torch.ones((B, 1), dtype=torch.long, device=device)], 1)
                out = self.model(input_ids=fed.to(device)[:, None], attention_mask=mask_BS,
                                 position_ids=next_pos_B[:, None], use_cache=True,
                                 **{self._cache_arg: cache})
                next_pos_B = next_pos_B + 1
                if capture.active:
                    step_experts_BLK = capture.take(B, 1)[:, 0]
        for r in rows:
            if r.finish is None:
                r.finish = "length"

    def _finish_reason(self, row: _Row, token: int, eos: set[int]) -> str | None:
        p = row.params
        if (token in eos and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if p.stop:
            # Matched on the text the server returns, where special tokens are not text (as vLLM).
            tail = self.tokenizer.decode(row.tokens[-24:], skip_special_tokens=True)
            for s in p.stop:
                if s in tail:
                    row.stop_hit = s
                    return "stop"
        if len(row.tokens) >= p.max_tokens:
            return "length"
        return None

    def fingerprint(self) -> str:
        """The numerical fingerprint of this model at this precision (see ``fingerprint``)."""
        if self._fingerprint is None:
            # Eager, as this engine decodes (a trainer engine on CUDA defaults to a compiled body).
            self._fingerprint = TrainerEngine(self.loaded, body="eager").fingerprint()
        return self._fingerprint
