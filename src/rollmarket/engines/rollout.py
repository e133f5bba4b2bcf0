"""The embedded rollout engine: batched sampling with a KV cache over a transformers model.

A ``DecodeSession`` is a running batch over one KV cache, left-padded so every row's newest
token sits in the last column. Sequences join between decode steps (their prompts are
prefilled together in a cache of their own, then both caches are left-padded to one width and
concatenated along the batch) and leave as soon as they finish (their rows are dropped, and
columns no remaining row uses are trimmed from the left). All rows of a step are sampled
together on the model's device (``sampling.RowBatch``). Each step reports, per sequence, the sampled
token, its logprob (see ``sampling`` for which distribution), optional top alternatives and,
for MoE models, the experts of the forward step that produced the token.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .loading import LoadedModel, load_model
from .precision import Precision
from .routing import RouterCapture
from .teacher import TrainerEngine
from .sampling import Drawn, RowBatch, SamplingParams, sequence_key
from .slots import SlotKV


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
    index: int
    prompt: np.ndarray
    params: SamplingParams
    key: int
    cached: int = 0
    """Cache columns that hold this row's tokens (its prompt, then each token fed back)."""
    slot: int = -1
    """Its slot in a ``SlotKV`` cache (-1 in a padded cache)."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    experts: list[np.ndarray] = field(default_factory=list)
    prompt_experts: np.ndarray | None = None
    finish: str | None = None
    stop_hit: str | None = None


def encode_chat(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The prompt ids of chat messages (and tools) under the tokenizer's chat template."""
    ids = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=True, add_generation_prompt=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


class RolloutEngine:
    """Sampling over a loaded model. Not thread-safe: one caller (or the server's batcher)."""

    name = "rollmarket-hf"

    def __init__(self, loaded: LoadedModel, *, kv: str = "auto", graphs: bool | None = None,
                 step_buckets: bool | None = None):
        """``kv``: the decode's KV cache, ``slots`` (fixed slots: fixed step shapes), ``padded``
        (transformers' DynamicCache, left-padded) or ``auto`` (slots where the model allows them).
        ``graphs``: replay slot decode steps as CUDA graphs (MoE router capture included); None =
        on CUDA for models that are not FSDP-sharded (see ``slots``). ``step_buckets``: round eager slot
        steps' batch and length up to powers of two, so that their shapes repeat; None = on CUDA
        (``SlotKV``)."""
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
        if kv not in ("auto", "slots", "padded"):
            raise ValueError(f"kv must be auto, slots or padded, not {kv!r}")
        why_not = SlotKV.supports(self.model)
        if kv == "slots" and why_not:
            raise ValueError(f"this model cannot decode over KV slots: {why_not}")
        self.kv = "padded" if kv == "padded" or why_not else "slots"
        """The decode's KV cache: ``slots`` or ``padded``."""
        no_graphs = SlotKV.ungraphable(self.model)
        if graphs and no_graphs:
            raise ValueError(f"no CUDA graphs: {no_graphs}")
        if graphs is None:
            graphs = loaded.device.type == "cuda" and no_graphs is None
        if graphs and loaded.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.graphs = graphs and self.kv == "slots"
        """Whether slot decode steps are replayed as CUDA graphs."""
        if step_buckets is None:
            # On CUDA a step whose shapes the process has not run yet costs far more than a repeat
            # (cuDNN's attention plans each shape: tiny-moe on an H100, 66 ms a step against 16;
            # docs/benchmarks.md, "New shapes"), and a server's batch compositions depend on when
            # requests arrive, so exact shapes keep being new. On the CPU a new shape costs nothing
            # and buckets were no clear win (faster runs for tiny-moe, slower for tiny-dense).
            step_buckets = self.graphs or loaded.device.type == "cuda"
        self.step_buckets = bool(step_buckets) and self.kv == "slots"
        """Whether slot decode steps run at bucketed (batch, length) shapes (always when graphed)."""
        self.fused_draw = True
        """Slot steps draw each row's next token inside the step (the graph), from the logits it
        makes; off, the next step draws it (as the padded cache always does): a benchmark's knob."""
        self._idle_slots: list[SlotKV] = []
        """Slot stores of finished sessions, kept with their graphs for the next session (graphed
        engines only: capturing costs a few forwards per shape, every ``generate`` would pay it)."""

    @property
    def graph_captures(self) -> int:
        """CUDA graphs captured by the slot stores kept between sessions (graphed engines keep
        theirs; a benchmark reads it once its sessions are done)."""
        return sum(store.captures for store in self._idle_slots)

    def slot_store(self) -> SlotKV:
        """An empty slot store for a session: one a finished session gave back, or a new one."""
        if self._idle_slots:
            return self._idle_slots.pop().reuse()
        return SlotKV(self.model, self.pad_id, graphs=self.graphs, cache_arg=self._cache_arg,
                      buckets=self.step_buckets)

    def give_back(self, store: SlotKV) -> None:
        """A session's store, empty again: kept for the next session when it holds graphs."""
        if self.graphs and not store.owner and len(self._idle_slots) < 2:
            self._idle_slots.append(store)

    @classmethod
    def from_path(cls, path, precision: str | Precision = "fp32", device="cpu", **kw) -> "RolloutEngine":
        return cls(load_model(path, precision, device), **kw)

    @property
    def precision(self) -> Precision:
        return self.loaded.precision

    @property
    def device(self) -> str:
        return str(self.loaded.device)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return encode_chat(self.tokenizer, messages, tools)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[Generation]:
        started = time.perf_counter()
        session = self.session()
        rows = session.add(prompts, params)
        while session:
            session.step()
        wall = time.perf_counter() - started
        return [self._finish(row, wall) for row in rows]

    def session(self) -> "DecodeSession":
        """A running batch that sequences can join between decode steps (continuous batching)."""
        return DecodeSession(self)

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

    def stream(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
               *, seeds_index: list[int] | None = None,
               should_abort: Callable[[], bool] | None = None) -> Iterator[list[StepEvent]]:
        """Yield, after each decode step, the new token of every sequence still running.

        ``seeds_index`` gives each sequence its index within its request (choice i of n), so
        seeded sequences draw the same numbers whatever batch they land in.
        """
        session = self.session()
        session.add(prompts, params, seeds_index)
        while session:
            yield session.step()
            if should_abort and should_abort():
                break

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


class DecodeSession:
    """A running batch: ``add`` sequences at any time, ``step`` decodes one token for each.

    Not thread-safe: one caller (the server's decode thread). A row's results do not depend on
    when it joined or beside whom it runs, up to the summation order of padded matmuls. Its KV
    cache is the engine's kind (``RolloutEngine.kv``): fixed slots (``slots.SlotKV``, whose decode
    steps CUDA graphs replay) or one left-padded ``DynamicCache`` (``PaddedKV``).
    """

    def __init__(self, engine: RolloutEngine):
        self.engine = engine
        self.rows: list[_Row] = []
        self._count = 0
        self.kv: SlotKV | PaddedKV | None = None
        """The running rows' KV cache (None while no row runs: taken on the first ``add``)."""
        self._logits_BV: torch.Tensor | None = None
        self._experts_BLK: torch.Tensor | None = None
        self._sampler: RowBatch | None = None
        self._drawn: list[list[float]] | None = None
        """The next draw (``RowBatch.packed`` rows, in row order) of the rows the last slot step
        ran, made inside it; rows that joined since (after them) draw in ``step``. None: every
        row draws in ``step`` (a padded cache, or draws kept outside the step)."""
        self._eos = set(engine.info.eos_token_ids)
        self._capture = RouterCapture(engine.model, engine.info.top_k or 1)

    def __len__(self) -> int:
        return len(self.rows)

    @torch.no_grad()
    def add(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
            seeds_index: list[int] | None = None) -> list[_Row]:
        """Prefill new sequences and join them to the batch; their first tokens come with the
        next ``step``. Returns their rows (``index`` numbers them within this session)."""
        engine = self.engine
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts) or not prompts:
            raise ValueError("need one SamplingParams per prompt and at least one prompt")
        seeds_index = seeds_index or list(range(len(prompts)))
        new: list[_Row] = []
        for prompt, p, si in zip(prompts, params, seeds_index):
            arr = np.asarray(prompt, dtype=np.int64)
            if arr.size == 0:
                raise ValueError("empty prompt")
            if arr.size + p.max_tokens > engine.info.max_context_tokens:
                raise ValueError(f"prompt of {arr.size} tokens + max_tokens {p.max_tokens} exceeds "
                                 f"the context of {engine.info.max_context_tokens}")
            new.append(_Row(self._count + len(new), arr, p, sequence_key(p.seed, si), cached=arr.size))
        device = engine.loaded.device
        n, longest = len(new), max(r.prompt.size for r in new)
        ids_BS = torch.full((n, longest), engine.pad_id, dtype=torch.long)
        mask_BS = torch.zeros((n, longest), dtype=torch.long)
        for b, r in enumerate(new):
            ids_BS[b, longest - r.prompt.size:] = torch.from_numpy(r.prompt)
            mask_BS[b, longest - r.prompt.size:] = 1
        ids_BS, mask_BS = ids_BS.to(device), mask_BS.to(device)
        from transformers import DynamicCache
        cache = DynamicCache()
        with self._capture:
            out = engine.model(input_ids=ids_BS, attention_mask=mask_BS,
                               position_ids=(mask_BS.cumsum(-1) - 1).clamp(min=0), use_cache=True,
                               logits_to_keep=1, **{engine._cache_arg: cache})
            experts_BSLK = self._capture.take(n, longest) if self._capture.active else None
        if experts_BSLK is not None:
            for b, r in enumerate(new):
                r.prompt_experts = experts_BSLK[b, longest - r.prompt.size:longest - 1].numpy()
        logits_BV = out.logits[:, -1].float()
        experts_BLK = experts_BSLK[:, -1] if experts_BSLK is not None else None
        if self.kv is None:
            self.kv = engine.slot_store() if engine.kv == "slots" else PaddedKV(engine)
        self.kv.join(new, cache, mask_BS)
        if self.rows:
            assert self._logits_BV is not None  # rows are running
            self._logits_BV = torch.cat([self._logits_BV, logits_BV], 0)
            if experts_BLK is not None and self._experts_BLK is not None:
                self._experts_BLK = torch.cat([self._experts_BLK, experts_BLK], 0)
        else:
            self._logits_BV, self._experts_BLK = logits_BV, experts_BLK
        self.rows += new
        self._count += n
        self._sampler = None  # the joiners' first tokens come from their prefill's logits (``step``)
        return new

    def remove(self, rows: list[_Row]) -> None:
        """Drop running rows (their requests were cancelled) before the next step."""
        gone = {id(r) for r in rows}
        self._keep([b for b, r in enumerate(self.rows) if id(r) not in gone])

    def _keep(self, keep: list[int]) -> None:
        if len(keep) == len(self.rows):
            return
        assert self.kv is not None and self._logits_BV is not None  # rows were running
        kept = set(keep)
        gone = [r for b, r in enumerate(self.rows) if b not in kept]
        self.rows = [self.rows[b] for b in keep]
        self.kv.keep(keep, self.rows, gone)
        self._sampler = None
        if self._drawn is not None:
            # Still a prefix of the rows (keep is ascending): the rows that joined since come after.
            self._drawn = [self._drawn[b] for b in keep if b < len(self._drawn)]
        if not keep:
            self._logits_BV = self._experts_BLK = self._drawn = None
            if isinstance(self.kv, SlotKV):
                # Handed back, graphs and all, for the engine's next session (or this one's next add).
                self.engine.give_back(self.kv)
            self.kv = None
            return
        self._logits_BV = self._logits_BV[torch.tensor(keep, device=self._logits_BV.device)]
        if self._experts_BLK is not None:
            self._experts_BLK = self._experts_BLK[torch.tensor(keep)]

    @torch.no_grad()
    def step(self) -> list[StepEvent]:
        """Sample one token for every row, report it, drop the rows that finished, and run the
        decode forward for the rest."""
        engine = self.engine
        if not self.rows:
            return []
        assert self._logits_BV is not None  # set by add() with the rows
        sampler = self._rows_sampler()
        ready = self._drawn or []
        drawn_before = len(ready)
        if drawn_before == len(self.rows):
            drawn = Drawn(ready, sampler)
        elif drawn_before:
            # Rows joined since the last slot step drew the others: only the joiners draw here, from
            # their prefill's logits (the last rows), each row with its own settings and uniform.
            joiners = self.rows[drawn_before:]
            tail = self._sampler_for(joiners)
            drawn = Drawn(ready + tail.draw(self._logits_BV[drawn_before:], [len(r.tokens) for r in joiners]).packed,
                          sampler)
        else:
            drawn = sampler.draw(self._logits_BV, [len(r.tokens) for r in self.rows])
        self._drawn = None  # used: the decode below draws the next ones
        events: list[StepEvent] = []
        keep: list[int] = []
        for b, r in enumerate(self.rows):
            token, logprob = drawn.token_id(b), drawn.logprob(b)
            top = drawn.top(b)
            r.tokens.append(token)
            r.logprobs.append(logprob)
            if r.params.top_logprobs:
                r.top.append(top)
            experts_LK = None
            if self._experts_BLK is not None:
                experts_LK = self._experts_BLK[b].numpy()
                r.experts.append(experts_LK)
            r.finish = engine._finish_reason(r, token, self._eos)
            events.append(StepEvent(r.index, token, logprob, top, experts_LK, r.finish))
            if r.finish is None:
                keep.append(b)
        self._keep(keep)
        if self.rows:
            assert self.kv is not None  # rows are running
            inside = self._rows_sampler() if isinstance(self.kv, SlotKV) and self.engine.fused_draw else None
            logits_BV, experts_BLK, self._drawn = self.kv.decode(self.rows, self._capture, inside)
            self._logits_BV = logits_BV
            if experts_BLK is not None:
                self._experts_BLK = experts_BLK
            for r in self.rows:
                r.cached += 1
        return events

    def _rows_sampler(self) -> RowBatch:
        """The running rows' sampling settings (built again whenever rows join or leave)."""
        if self._sampler is None:
            self._sampler = self._sampler_for(self.rows)
        return self._sampler

    def _sampler_for(self, rows: list[_Row]) -> RowBatch:
        assert self._logits_BV is not None  # rows are running
        return RowBatch.from_params([r.params for r in rows], [r.key for r in rows],
                                    self._logits_BV.shape[-1], self._logits_BV.device)


class PaddedKV:
    """The running rows' KV cache as one transformers ``DynamicCache``, left-padded so every row's
    newest token sits in the last column. Joining rows' caches are left-padded to one width and
    concatenated along the batch; leaving rows are dropped and columns no remaining row uses are
    trimmed from the left. Works for any model transformers can cache; every step has new shapes."""

    def __init__(self, engine: RolloutEngine):
        self.engine = engine
        self._cache: Any = None
        """transformers' DynamicCache of the running rows (None while no row runs)."""
        self._mask_BS: torch.Tensor | None = None

    def join(self, rows: list[_Row], cache: Any, mask_BS: torch.Tensor) -> None:
        if self._mask_BS is None:
            self._cache, self._mask_BS = cache, mask_BS
            return
        width = max(self._mask_BS.shape[1], mask_BS.shape[1])

        def left_pad(t: torch.Tensor, dim: int) -> torch.Tensor:
            missing = width - t.shape[dim]
            if not missing:
                return t
            shape = list(t.shape)
            shape[dim] = missing
            return torch.cat([t.new_zeros(shape), t], dim)

        # Padded key/value columns are masked out, so their zeros are never attended to.
        for mine, theirs in zip(_cache_layers(self._cache), _cache_layers(cache)):
            mine.keys = torch.cat([left_pad(mine.keys, 2), left_pad(theirs.keys, 2)], 0)
            mine.values = torch.cat([left_pad(mine.values, 2), left_pad(theirs.values, 2)], 0)
        self._mask_BS = torch.cat([left_pad(self._mask_BS, 1), left_pad(mask_BS, 1)], 0)

    def keep(self, keep: list[int], rows: list[_Row], gone: list[_Row]) -> None:
        """Keep rows ``keep`` (indices into the batch before), now ``rows``; ``gone`` left."""
        assert self._mask_BS is not None  # rows were running
        if not keep:
            self._cache = self._mask_BS = None
            return
        index = torch.tensor(keep, device=self._mask_BS.device)
        # Columns left of the longest remaining row hold only padding now: trim them.
        lead = self._mask_BS.shape[1] - max(r.cached for r in rows)
        for layer in _cache_layers(self._cache):
            layer.keys = layer.keys[index, :, lead:]
            layer.values = layer.values[index, :, lead:]
        self._mask_BS = self._mask_BS[index, lead:]

    def decode(self, rows: list[_Row], capture: RouterCapture, sampler: RowBatch | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        """The next logits (and experts) per row; draws stay with the next step (``sampler``
        is not used: every step has new shapes, no graph to draw inside)."""
        assert self._mask_BS is not None  # rows are running
        if len(rows) == 0:
            raise ValueError("no rows to decode")
        engine = self.engine
        device = self._mask_BS.device
        fed_B1 = torch.tensor([[r.tokens[-1]] for r in rows]).to(device, non_blocking=True)
        position_B1 = torch.tensor([[r.cached] for r in rows]).to(device, non_blocking=True)
        self._mask_BS = torch.cat([self._mask_BS, self._mask_BS.new_ones((len(rows), 1))], 1)
        experts_BLK = None
        with capture:
            out = engine.model(input_ids=fed_B1, attention_mask=self._mask_BS, position_ids=position_B1,
                               use_cache=True, **{engine._cache_arg: self._cache})
            if capture.active:
                experts_BLK = capture.take(len(rows), 1)[:, 0]
        return out.logits[:, -1].float(), experts_BLK, None


def _cache_layers(cache) -> list:
    """The per-layer key/value holders of a transformers ``DynamicCache`` (``.keys``/``.values``,
    [batch, heads, columns, head_dim]); joining and leaving rewrite them along the batch."""
    return list(cache.layers)
