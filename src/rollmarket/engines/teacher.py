"""Teacher forcing: the trainer engine's view of tokens someone else sampled.

The lm-head and log-softmax run over chunks of positions, so a ``[tokens, vocab]`` float32
matrix never exists whole: at 16k tokens and a 150k vocabulary that matrix alone is 9.8 GB.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .body import Body, BodyPatch, default_body
from .fingerprint import canonical_pairs, fingerprint_from_logprobs
from .graphs import BodyGraphs, GraphUnavailable
from .loading import LoadedModel, load_model
from .precision import Precision
from .routing import RouterCapture, RouterReplay, replay_positions

CPU_CHUNK = 1024
CUDA_CHUNK = 4096
"""Positions per lm-head call on CUDA: a 4,096 × 151,936 bf16 chunk is 1.2 GiB (H100 sweep in
docs/benchmarks.md)."""


@dataclass(frozen=True)
class TeacherForced:
    """Per response token: the trainer's logprob, the entropy of its distribution, its experts."""

    logprobs_T: np.ndarray
    """float32 log π(y_t | prefix) at the given temperature."""
    entropies_T: np.ndarray
    """float32 entropy (nats) of the full next-token distribution at position t."""
    routed_experts_TLK: np.ndarray | None
    """int16 top-k experts of the forward step that scored y_t (the step fed y_{t-1}); None for
    dense models. Same alignment as the rollout engine, so row t of both describes one step."""


def chunked_token_stats(hidden_NH: torch.Tensor, lm_head: torch.nn.Module, targets_N: torch.Tensor,
                        *, temperature: float = 1.0, chunk: int = 1024, fused: bool | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each target and the distribution's entropy, ``chunk`` positions at a time.

    Works in float32 whatever the model's dtype: the lm-head runs at model precision (as the
    trainer engine would), the softmax statistics in float32. With z the logits shifted by their
    maximum, e = exp(z) and s = Σe: logprob = z[target] − log s and entropy = log s − Σ e·z / s,
    so one exponential pass serves both and at most two ``[chunk, vocab]`` float32 buffers live
    at once (logsumexp plus softmax would take twice the passes and a third buffer).

    On CUDA without autograd the same statistics come from one fused Triton pass over each chunk's
    logits (``engines.fused``), which never builds the float32 buffers; this torch path stays for
    the CPU, for gradients and where Triton is missing. ``fused=False`` forces it (benchmarks).
    """
    if fused is not False and hidden_NH.is_cuda and not torch.is_grad_enabled():
        from . import fused as kernels

        if kernels.available():
            return kernels.fused_chunked_token_stats(hidden_NH, lm_head, targets_N,
                                                     temperature=temperature, chunk=chunk)
    logprobs, entropies = [], []
    for start in range(0, hidden_NH.shape[0], chunk):
        logits_CV = lm_head(hidden_NH[start:start + chunk])
        # One pass shifts by the row maximum and upcasts (bf16 minus float32 gives float32).
        shifted_CV = logits_CV - logits_CV.amax(dim=-1, keepdim=True).float()
        del logits_CV
        if temperature != 1.0:
            shifted_CV = shifted_CV / temperature
        exp_CV = shifted_CV.exp()
        sum_C = exp_CV.sum(-1)
        log_sum_C = sum_C.log()
        target_C = shifted_CV.gather(-1, targets_N[start:start + chunk, None]).squeeze(-1)
        logprobs.append(target_C - log_sum_C)
        # A −inf logit (a masked vocabulary) has e = 0 and z = −inf, and 0·(−inf) is NaN. Without
        # a gradient the product is taken in place (no third buffer) and nansum drops those NaNs:
        # no extra pass, and a NaN logit still makes log s, so both results, NaN. With one, the
        # NaN would also reach the gradient through the product, so such entries are zeroed first.
        if exp_CV.requires_grad:
            weighted_sum_C = (exp_CV * shifted_CV.where(exp_CV > 0, 0.0)).sum(-1)
        else:
            weighted_sum_C = exp_CV.mul_(shifted_CV).nansum(-1)
        entropies.append(log_sum_C - weighted_sum_C / sum_C)
        del shifted_CV, exp_CV
    return torch.cat(logprobs), torch.cat(entropies)


def _body_and_head(model: Any) -> tuple[Any, Any]:
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model, model.lm_head


class TrainerEngine:
    """Scores response tokens given their prompt, at the loaded model's precision.

    Sequences are right-padded into one batch per call; ``max_batch_tokens`` splits larger calls.
    ``chunk`` is the positions per lm-head call; by default 1,024 on the CPU and 4,096 on CUDA,
    where the fused kernel holds only the chunk's logits at model precision.

    ``body`` picks how the model body runs (``engines.body``): "eager", "liger" (Liger-Kernel's
    fused Triton kernels, CUDA), "compiled" (each decoder layer ``torch.compile``d) or
    "compiled-liger". By default: "compiled" for a dense model on CUDA, chosen by speed and by a
    numerics criterion against the float32 model (docs/benchmarks.md), and eager on the CPU and for
    MoE models. The body applies only inside the engine's forward, so a model shared with a
    rollout engine or a learner stays eager for them. A compiled body compiles on its first call
    (seconds) and once more for the next new batch shape, after which shapes are dynamic.

    ``graphs=True`` (CUDA) replays the body as a CUDA graph per batch shape (``engines.graphs``):
    for unpadded batches of a dense model, whose shapes repeat (a fixed packing); each new shape
    costs a capture of about three forwards. If the body cannot be captured the engine says why in
    ``graphs_error`` and runs without graphs.
    """

    name = "rollmarket-teacher"

    def __init__(self, loaded: LoadedModel, *, chunk: int | None = None,
                 max_batch_tokens: int = 16384, body: Body | None = None, graphs: bool = False):
        self.loaded = loaded
        self.info = loaded.info
        self.chunk = chunk or (CUDA_CHUNK if torch.device(loaded.device).type == "cuda" else CPU_CHUNK)
        self.max_batch_tokens = max_batch_tokens
        self.body, self.head = _body_and_head(loaded.model)
        body = body or default_body(self.body, loaded.device, moe=bool(loaded.info.num_moe_layers))
        self.body_patch = BodyPatch(self.body, body)
        if graphs and torch.device(loaded.device).type != "cuda":
            raise ValueError("CUDA graphs need a model on CUDA")
        self.graphs = BodyGraphs(self._unmasked_body) if graphs else None
        self.graphs_error: str | None = None

    def _plain_body(self, ids_BS: torch.Tensor, mask_BS: torch.Tensor | None = None) -> torch.Tensor:
        with self.body_patch:
            return self.body(input_ids=ids_BS, attention_mask=mask_BS, use_cache=False).last_hidden_state

    def _unmasked_body(self, ids_BS: torch.Tensor) -> torch.Tensor:
        """The body on an unpadded batch with the causal mask decided here, not by the model.

        Left to decide, transformers drops the mask of an unpadded batch (SDPA's ``is_causal`` path)
        unless it thinks it is tracing, and a CUDA graph capture counts as tracing: under capture
        it would build a full ``[B, 1, S, S]`` mask, so the graph would run another attention
        kernel than the plain forward (other numbers, slower), and a compiled layer would
        recompile inside the capture and fail. A prepared mapping with no mask takes the same path
        in both. Sliding-window layers need their mask: no graphs for them.
        """
        other = set(getattr(self.body.config, "layer_types", None) or ()) - {"full_attention"}
        if other:
            raise GraphUnavailable(f"the body has {sorted(other)} layers, whose mask a graph cannot leave out")
        with self.body_patch:
            return self.body(input_ids=ids_BS, attention_mask={"full_attention": None},
                             use_cache=False).last_hidden_state

    @classmethod
    def from_path(cls, path, precision: str | Precision = "fp32", device="cpu", **kw) -> "TrainerEngine":
        return cls(load_model(path, precision, device), **kw)

    @property
    def precision(self) -> Precision:
        return self.loaded.precision

    def fingerprint(self) -> str:
        pairs = canonical_pairs(self.loaded.tokenizer)
        return fingerprint_from_logprobs([tf.logprobs_T for tf in self.score_batch(pairs)])

    @torch.no_grad()
    def score(self, prompt_ids_P, response_ids_T, *, temperature: float = 1.0,
              replayed_experts_TLK: np.ndarray | None = None) -> TeacherForced:
        replay: list[np.ndarray | None] | None = None if replayed_experts_TLK is None else [replayed_experts_TLK]
        return self.score_batch([(prompt_ids_P, response_ids_T)], temperature=temperature,
                                replayed_experts=replay)[0]

    @torch.no_grad()
    def score_batch(self, pairs: list[tuple], *, temperature: float = 1.0,
                    replayed_experts: list[np.ndarray | None] | None = None) -> list[TeacherForced]:
        """Teacher-force each (prompt, response) pair.

        ``replayed_experts`` (router replay, R3): per pair, the rollout engine's ``[T, moe_layers,
        top_k]`` experts of its response tokens (None: the trainer routes that pair itself); the
        MoE layers then route those tokens to them (``RouterReplay``), and the returned experts
        are the ones the forward used.
        """
        if replayed_experts is not None and len(replayed_experts) != len(pairs):
            raise ValueError(f"{len(replayed_experts)} replayed expert arrays for {len(pairs)} pairs")
        out: list[TeacherForced] = []
        batch: list[tuple[np.ndarray, np.ndarray]] = []
        replays: list[np.ndarray | None] = []
        longest = 0
        for i, (prompt, response) in enumerate(pairs):
            prompt_P = np.asarray(prompt, dtype=np.int64)
            response_T = np.asarray(response, dtype=np.int64)
            if prompt_P.size == 0:
                raise ValueError("teacher forcing needs at least one prompt token")
            replay = None if replayed_experts is None else replayed_experts[i]
            if replay is not None and len(replay) != response_T.size:
                raise ValueError(f"{len(replay)} rows of replayed experts for {response_T.size} response tokens")
            length = prompt_P.size + response_T.size
            if length > self.info.max_context_tokens:
                raise ValueError(f"prompt + response of {length} tokens exceeds the context of "
                                 f"{self.info.max_context_tokens}")
            if batch and max(longest, length) * (len(batch) + 1) > self.max_batch_tokens:
                out.extend(self._forward(batch, temperature, replays))
                batch, replays, longest = [], [], 0
            batch.append((prompt_P, response_T))
            replays.append(replay)
            longest = max(longest, length)
        if batch:
            out.extend(self._forward(batch, temperature, replays))
        return out

    def _graphed_body(self, ids_BS: torch.Tensor) -> torch.Tensor | None:
        assert self.graphs is not None
        try:
            return self.graphs(ids_BS)
        except GraphUnavailable as exc:
            self.graphs, self.graphs_error = None, str(exc)
            return None

    def _forward(self, batch: list[tuple[np.ndarray, np.ndarray]], temperature: float,
                 replays: list[np.ndarray | None] | None = None) -> list[TeacherForced]:
        device = self.loaded.device
        lengths = [p.size + r.size for p, r in batch]
        B, S = len(batch), max(lengths)
        ids_BS = torch.zeros(B, S, dtype=torch.long)
        mask_BS = torch.zeros(B, S, dtype=torch.long)
        for b, (p, r) in enumerate(batch):
            ids_BS[b, : lengths[b]] = torch.from_numpy(np.concatenate([p, r]))
            mask_BS[b, : lengths[b]] = 1
        ids_BS = ids_BS.to(device)
        # Without padding the mask is all ones, which the model would check and drop (a sync on
        # the GPU); no KV cache is kept (it would hold K and V of every layer for nothing).
        padded_BS = mask_BS.to(device) if min(lengths) < S else None
        capture = RouterCapture(self.loaded.model, self.loaded.info.top_k or 1)
        replay: contextlib.AbstractContextManager = contextlib.nullcontext()
        if replays is not None and any(e is not None for e in replays):
            top_k = self.loaded.info.top_k or 1
            replay = RouterReplay(self.loaded.model, replay_positions(
                [(p.size, e) for (p, _), e in zip(batch, replays)], S, len(capture.routers), top_k))
        # Replay first, so the capture (registered after it) records the experts actually used.
        with replay, capture:
            hidden_BSH = self._graphed_body(ids_BS) if (
                self.graphs is not None and padded_BS is None and not capture.active) else None
            if hidden_BSH is None:
                hidden_BSH = self._plain_body(ids_BS, padded_BS)
        experts_BSLK = capture.take(B, S) if capture.active else None
        # Position i predicts token i+1: the response's scores sit at P-1 .. P+T-2.
        rows, targets = [], []
        for b, (p, r) in enumerate(batch):
            P, T = p.size, r.size
            rows.append(hidden_BSH[b, P - 1: P - 1 + T])
            targets.append(ids_BS[b, P: P + T])
        logprobs_N, entropies_N = chunked_token_stats(
            torch.cat(rows), self.head, torch.cat(targets), temperature=temperature, chunk=self.chunk)
        logprobs_np_N = logprobs_N.cpu().numpy().astype(np.float32)
        entropies_np_N = entropies_N.cpu().numpy().astype(np.float32)
        out, offset = [], 0
        for b, (p, r) in enumerate(batch):
            P, T = p.size, r.size
            experts = None
            if experts_BSLK is not None:
                experts = experts_BSLK[b, P - 1: P - 1 + T].numpy().astype(np.int16)
            out.append(TeacherForced(logprobs_np_N[offset: offset + T], entropies_np_N[offset: offset + T],
                                     experts))
            offset += T
        return out
