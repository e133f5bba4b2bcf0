"""A KV cache of fixed slots, so that one decode step has fixed shapes and can be a CUDA graph.

The padded cache (``rollout.PaddedKV``) keeps the running rows left-padded in transformers'
``DynamicCache``: every join concatenates and re-pads it, every step appends a column, so no two
steps have the same shapes, and the eager model launches ~1,700 kernels a step on the Qwen3-0.6B
shape. Measured on an H200, such a step took 35–40 ms for 4 ms of kernels (docs/benchmarks.md,
"Where a decode step's time goes"): the host, not the GPU, sets the pace.

Here each layer's keys and values live in one buffer ``[slots, kv_heads, width, head_dim]``. A
row owns a slot from its prefill to its end; its token at position p sits in column p. A decode
step feeds every slot in ``[0, B)`` one token at its own position, writes that token's key and
value into its column, and attends over columns ``[0, L)`` with a mask per row (column <= its
position). With B and L rounded up to buckets (powers of two) a step's shapes repeat, so
``BodyGraphs`` captures it once per (B, L) and replays it with one launch. Slots in the range
that hold no row are fed a pad token at position 0: they compute garbage into their own column 0,
which the next row to take the slot overwrites with its prompt.

The step also draws each row's next token (``sampling.RowBatch.packed``) from the logits it just
made, so a graphed step is one replay for the forward and the sampling together (drawn outside,
the sampler's ~40 small kernels took 1.0–1.4 ms a step on an H200, as long as a small model's whole
forward). Its one input is a float64 ``[B, 9]`` array built on the host: each slot's token id,
position and uniform, then its sampling settings (``sampling.SETTINGS``); holes sample as the first
row does, so they change no flag. The flags (which passes the draw runs) key the graph beside (B, L).

The buffers start small and double (slots or width) when a row needs more; growing copies the
buffers and drops the captured graphs, a few times per server life. Graphs are used on CUDA for
models whose layers all attend fully (a sliding window needs its own mask); everything else runs
the same slot steps eagerly. An MoE model's step is graphed with its router capture inside: the
hooks record each router's top-k into the graph's memory as the step is captured, the step stacks
them into one ``[B, moe_layers, top_k]`` tensor there, and every replay refills it. transformers'
grouped expert dispatch keeps fixed shapes for a fixed token count (it sorts the (token, expert)
pairs and hands the kernel per-expert offsets on the device), so it captures too in bf16; a
dispatch that waits for the host (the eager loop over the experts hit, or torch's grouped matmul in
fp32, which reads the offsets on the host) fails the capture, and the store then steps eagerly
(``graphs_error``).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from .graphs import BodyGraphs, GraphUnavailable
from .routing import RouterCapture
from .sampling import SETTINGS, RowBatch, RowFlags, row_uniforms

log = logging.getLogger(__name__)

MIN_WIDTH = 128
"""Columns of a fresh cache, and the smallest length bucket a graph attends over."""
MIN_SLOTS = 4
STEP_COLUMNS = 3 + len(SETTINGS)
"""A decode step's input per slot: token id, position, uniform, then the row's sampling settings."""


def bucket(n: int, least: int = 1) -> int:
    """The smallest power of two >= max(n, least)."""
    size = max(least, 1)
    while size < n:
        size *= 2
    return size


class SlotCache:
    """Per-layer key/value buffers ``[slots, kv_heads, width, head_dim]`` with transformers' cache
    ``update`` hook: during a decode step each layer writes its new key/value at each row's position
    and reads back columns ``[0, L)`` of the step's slots."""

    def __init__(self, layers: int, slots: int, width: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (slots, kv_heads, width, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self._pos_B: torch.Tensor | None = None
        self._columns = 0

    @property
    def slots(self) -> int:
        return self.keys[0].shape[0]

    @property
    def width(self) -> int:
        return self.keys[0].shape[2]

    def grown(self, slots: int, width: int) -> "SlotCache":
        """A larger cache holding this one's contents."""
        k = self.keys[0]
        bigger = SlotCache(len(self.keys), slots, width, k.shape[1], k.shape[3], k.dtype, k.device)
        for mine, theirs in zip(self.keys + self.values, bigger.keys + bigger.values):
            theirs[:self.slots, :, :self.width].copy_(mine)
        return bigger

    def bind(self, pos_B: torch.Tensor, columns: int) -> None:
        """The positions the next forward writes at (slot b at ``pos_B[b]``) and how many columns
        its attention reads."""
        self._pos_B, self._columns = pos_B, columns

    def update(self, key_BH1D: torch.Tensor, value_BH1D: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._pos_B is not None, "bind() the step's positions before the forward"
        B = key_BH1D.shape[0]
        rows_B = torch.arange(B, device=key_BH1D.device)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[rows_B, :, self._pos_B] = key_BH1D[:, :, 0]
        values[rows_B, :, self._pos_B] = value_BH1D[:, :, 0]
        return keys[:B, :, :self._columns], values[:B, :, :self._columns]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # Asked only when no positions are passed (this module always passes them).
        return 0

    def fill(self, cache: Any, mask_BS: torch.Tensor, slots: list[int]) -> None:
        """Copy a left-padded prefill's keys and values (transformers' cache of ``len(slots)`` rows
        by ``S`` columns) into columns ``[0, P)`` of the rows' slots."""
        n, S = mask_BS.shape
        device = self.keys[0].device
        lengths_B = mask_BS.sum(1).to(device)
        # Row b's token j sits at prefill column S - P_b + j; columns past P_b take the last one
        # (never read: the mask ends at each row's position).
        source_BS = (S - lengths_B)[:, None] + torch.arange(S, device=device)[None, :]
        source_BS = source_BS.clamp(max=S - 1)
        slots_B = torch.tensor(slots, device=device)
        for layer, keys, values in zip(cache.layers, self.keys, self.values):
            index = source_BS[:, None, :, None].expand(n, layer.keys.shape[1], S, layer.keys.shape[3])
            keys[slots_B, :, :S] = layer.keys.gather(2, index).to(keys.dtype)
            values[slots_B, :, :S] = layer.values.gather(2, index).to(values.dtype)


class SlotKV:
    """The slot store of a ``DecodeSession``: which row owns which slot, the cache, the graphs."""

    def __init__(self, model: Any, pad_id: int, *, graphs: bool, cache_arg: str, buckets: bool = False):
        """``cache_arg``: the name the model's forward takes its cache by (``RolloutEngine``).
        ``buckets``: round eager steps' (B, L) up to buckets too, as graphed ones always are
        (``RolloutEngine(step_buckets=...)`` decides, and says why)."""
        self.model = model
        self.pad_id = pad_id
        self.graphs_wanted = graphs
        self.buckets = buckets
        config = model.config
        self._config = (config.num_hidden_layers, config.num_key_value_heads,
                        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.cache: SlotCache | None = None
        self.owner: list[Any] = []
        """owner[s]: the row in slot s, or None."""
        self._graphs: BodyGraphs | None = None
        self._graphed_weights: tuple[int, ...] = ()
        self.graphs_error: str | None = None
        """Why the graphs were given up (the steps then run eagerly), if they were."""
        self.captures = 0
        """Graphs captured over this store's life (regrowing the cache drops them)."""
        self._cache_arg = cache_arg
        self._columns: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._capture: RouterCapture | None = None
        """The session's router capture, for the step ``_step`` runs (and a graph captures)."""

    def _weights(self) -> tuple[int, ...]:
        return tuple(p.data_ptr() for p in self.model.parameters())

    def reuse(self) -> "SlotKV":
        """This (empty) store for a new session. Its graphs are kept while they still read the
        model's weights: an optimizer updates them in place, but anything that replaced a
        parameter tensor would leave the graphs reading old memory, so they are dropped then.
        Checked when a session takes the store, not every step."""
        assert not self.owner, "a store in use"
        if self._graphs is not None and self._weights() != self._graphed_weights:
            self._graphs = None
        return self

    @staticmethod
    def supports(model: Any) -> str | None:
        """Why this model cannot use slots, or None when it can."""
        config = getattr(model, "config", None)
        kinds = set(getattr(config, "layer_types", None) or ("full_attention",))
        if kinds != {"full_attention"}:
            return f"layers of kinds {sorted(kinds - {'full_attention'})} need a mask of their own"
        if not all(hasattr(config, k) for k in ("num_hidden_layers", "num_key_value_heads", "num_attention_heads")):
            return "the model's config names no layer or head counts"
        return None

    @staticmethod
    def ungraphable(model: Any) -> str | None:
        """Why this model's decode steps cannot be CUDA graphs, or None. FSDP2's hooks gather each
        layer's weights into fresh memory with collectives: a graph would replay the gather of its
        capture, not read the current weights."""
        from torch.distributed.fsdp import FSDPModule

        if any(isinstance(m, FSDPModule) for m in model.modules()):
            return "the model is FSDP-sharded (its weights are gathered anew for every forward)"
        return None

    def _ensure(self, slots: int, width: int) -> SlotCache:
        if self.cache is None:
            layers, kv_heads, head_dim = self._config
            param = next(self.model.parameters())
            self.cache = SlotCache(layers, bucket(slots, MIN_SLOTS), bucket(width, MIN_WIDTH), kv_heads,
                                   head_dim, param.dtype, param.device)
        elif slots > self.cache.slots or width > self.cache.width:
            self.cache = self.cache.grown(bucket(slots, self.cache.slots), bucket(width, self.cache.width))
            self._graphs = None  # they hold the old buffers' addresses
        return self.cache

    def join(self, rows: list[Any], cache: Any, mask_BS: torch.Tensor) -> None:
        """Give each new row the lowest free slot and copy its prefilled keys/values there."""
        slots = []
        for row in rows:
            free = next((s for s, r in enumerate(self.owner) if r is None), len(self.owner))
            if free == len(self.owner):
                self.owner.append(None)
            self.owner[free] = row
            row.slot = free
            slots.append(free)
        self._ensure(len(self.owner), mask_BS.shape[1] + 1).fill(cache, mask_BS, slots)

    def keep(self, keep: list[int], rows: list[Any], gone: list[Any]) -> None:
        """Rows ``gone`` left (the others keep their slots): their slots are free again."""
        for row in gone:
            self.owner[row.slot] = None
        while self.owner and self.owner[-1] is None:
            self.owner.pop()

    def decode(self, rows: list[Any], capture: RouterCapture, sampler: RowBatch | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None, list[list[float]] | None]:
        """Feed every row its last token at its position: the next logits (and experts) per row,
        and with a ``sampler`` (``rows``' settings and keys, in their order) each row's next draw
        (a ``RowBatch.packed`` row), made inside the step."""
        used = len(self.owner)
        longest = max(r.cached for r in rows) + 1
        graphs = self.graphs_wanted and self.graphs_error is None
        B, L = (bucket(used), bucket(longest, MIN_WIDTH)) if graphs or self.buckets else (used, longest)
        cache = self._ensure(B, L)
        step_BC = np.empty((B, STEP_COLUMNS))
        step_BC[:, :3] = (self.pad_id, 0, 0.5)
        slots = [r.slot for r in rows]
        step_BC[slots, 0] = [r.tokens[-1] for r in rows]
        step_BC[slots, 1] = [r.cached for r in rows]
        if sampler is not None:
            assert sampler.settings_BC is not None, "a sampler built on the host (from_params)"
            step_BC[:, 3:] = sampler.settings_BC[0]  # holes sample as the first row: no new flag
            # Each row's next uniform: its draw number is the count of tokens it holds now.
            step_BC[slots, 2] = row_uniforms(sampler.keys, [len(r.tokens) for r in rows])
            step_BC[slots, 3:] = sampler.settings_BC
        else:
            step_BC[:, 3:] = 0.0
        device = cache.keys[0].device
        step_t = torch.from_numpy(step_BC).to(device, non_blocking=True)
        columns_L = self._columns.get((L, device))
        if columns_L is None:
            columns_L = self._columns[(L, device)] = torch.arange(L, device=device)
        flags = sampler.flags if sampler is not None else None
        self._capture = capture
        out = self._graphed(step_t, columns_L, flags) if graphs else None
        if out is None:
            out = self._step(step_t, columns_L, flags)
        logits_BV, packed_BC, experts_BLK = out
        index = torch.tensor(slots).to(device, non_blocking=True)
        # Copies: a graph's outputs are overwritten by its next replay.
        picked = logits_BV[index]
        experts = experts_BLK[index].cpu() if experts_BLK is not None else None
        if packed_BC is None:
            return picked, experts, None
        packed = packed_BC.cpu().tolist()  # the step's wait for the device (done already with experts)
        return picked, experts, [packed[s] for s in slots]

    def _graphed(self, step_BC: torch.Tensor, columns_L: torch.Tensor, flags: RowFlags | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
        if self._graphs is None:
            self._graphs = BodyGraphs(self._step, shapes=64)
            self._graphed_weights = self._weights()
        before = self._graphs.captures
        try:
            out = self._graphs(step_BC, columns_L, options=(flags,))
        except GraphUnavailable as exc:
            self.graphs_error = str(exc)
            self._graphs = None
            log.warning("decode steps run eagerly: %s", exc)  # once per store: it stays eager
            return None
        self.captures += self._graphs.captures - before
        return out

    def _step(self, step_BC: torch.Tensor, columns_L: torch.Tensor, flags: RowFlags | None
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``forward`` with the routers' choices recorded: ``(logits, draws, experts)``, the experts
        ``[B, moe_layers, top_k]`` int16 on the device (None for a dense model). What the graphs
        capture, hooks and all."""
        capture = self._capture
        assert capture is not None, "decode() sets the session's capture"
        with capture:
            logits_BV, packed_BC = self.forward(step_BC, columns_L, flags)
            experts_BLK = capture.stacked() if capture.active else None
        return logits_BV, packed_BC, experts_BLK

    def forward(self, step_BC: torch.Tensor, columns_L: torch.Tensor, flags: RowFlags | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode step over slots ``[0, B)`` attending over columns ``[0, L)``, then (with
        ``flags``) each slot's draw: the logits ``[B, vocab]`` in float32 and the draws
        (``RowBatch.packed``, None without flags).
        Fixed shapes for fixed (B, L) and flags: what the graphs capture."""
        assert self.cache is not None
        ids_B, pos_B = step_BC[:, 0].long(), step_BC[:, 1].long()
        self.cache.bind(pos_B, columns_L.shape[0])
        dtype = self.cache.keys[0].dtype
        # Additive, as transformers builds its own masks: 0 where a row may attend, the most
        # negative number elsewhere (every row attends to at least its own column).
        mask_B11L = torch.zeros(pos_B.shape[0], 1, 1, columns_L.shape[0], dtype=dtype, device=pos_B.device)
        mask_B11L.masked_fill_((columns_L[None, :] > pos_B[:, None])[:, None, None, :], torch.finfo(dtype).min)
        # A 4D mask is taken as is (transformers builds none of its own, even under a graph capture,
        # which it counts as tracing: see TrainerEngine._unmasked_body).
        out = self.model(input_ids=ids_B[:, None], position_ids=pos_B[:, None],
                         attention_mask=mask_B11L, use_cache=True,
                         **{self._cache_arg: self.cache})
        logits_BV = out.logits[:, -1].float()
        if flags is None:
            return logits_BV, None
        rows = RowBatch.from_settings(step_BC[:, 3:], flags)
        return logits_BV, rows.packed(logits_BV, step_BC[:, 2])
