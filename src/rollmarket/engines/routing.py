"""Capture the experts an MoE model routes each token to, as vLLM's ``routed_experts`` does.

Forward hooks sit on each MoE layer's router. Transformers' Qwen3-MoE router returns
``(logits, weights, indices)``; older versions use a plain Linear gate that returns logits, from
which the top-k is taken the same way the block does (softmax, then top-k).

Router replay (R3) uses the same hooks the other way round: it replaces each router's top-k
choice with the experts a rollout engine chose, so the trainer's forward routes as the rollout did.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def moe_routers(model: torch.nn.Module) -> list[Any]:
    """The router module of every MoE layer, in layer order (dense layers are skipped)."""
    layers = _decoder_layers(model)
    routers = []
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        gate = getattr(mlp, "gate", None)
        if gate is not None and hasattr(mlp, "experts"):
            routers.append(gate)
    return routers


def _decoder_layers(model: Any) -> list[Any]:
    # A peft-wrapped model (LoRA training) hides the transformers model one level further down.
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    body = getattr(base, "model", base)
    layers = getattr(body, "layers", None)
    return list(layers) if layers is not None else []


class RouterCapture:
    """Records the top-k expert ids of every token for the forward passes run inside ``with``.

    ``take()`` returns ``[batch, seq, moe_layers, top_k]`` int16 for the last forward pass, with
    column 0 the top-1 expert, and clears the record.
    """

    def __init__(self, model: torch.nn.Module, top_k: int):
        self.routers = moe_routers(model)
        self.top_k = top_k
        self._indices: list[torch.Tensor | None] = [None] * len(self.routers)
        self._handles: list = []

    @property
    def active(self) -> bool:
        return bool(self.routers)

    def __enter__(self) -> "RouterCapture":
        for i, router in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, layer: int):
        def record(_module, _inputs, output):
            if isinstance(output, tuple):
                indices = output[2]
            else:
                indices = torch.topk(output.float().softmax(-1), self.top_k, dim=-1).indices
            self._indices[layer] = indices.detach().reshape(-1, self.top_k)
        return record

    def take(self, batch: int, seq: int) -> torch.Tensor:
        if not self.routers:
            return torch.empty(batch, seq, 0, self.top_k, dtype=torch.int16)
        return self.stacked().reshape(batch, seq, len(self.routers), self.top_k).cpu()

    def stacked(self) -> torch.Tensor:
        """The last forward's experts ``[tokens, moe_layers, top_k]`` int16, left on the model's
        device (no wait for it): inside a CUDA graph capture this is part of the graph, and each
        replay refills it."""
        stacked_NLK = torch.stack([ix for ix in self._indices], dim=1)  # type: ignore[misc]
        self._indices = [None] * len(self.routers)
        return stacked_NLK.to(torch.int16)


OWN_ROUTING = -1
"""Expert id in a replay array meaning "let the trainer's router choose here" (prompt tokens,
padding, tool output the rollout engine never routed)."""


class RouterReplay:
    """Router replay (R3): inside ``with``, every MoE layer routes to the given experts.

    ``experts_NLK`` holds, for the N = batch × seq positions of the next forward pass (row-major,
    as the MoE block flattens them), each MoE layer's top-k expert ids; a row with any
    ``OWN_ROUTING`` entry keeps the router's own choice at that layer. The router still computes
    its logits, so the gate weights are its softmax taken at the replayed experts (renormalised
    over them when the model normalises its top-k) and carry its gradient; only the selection is
    replayed. Needs the top-k router module of transformers' Qwen3-MoE (``(logits, weights,
    indices)``); a bare Linear gate is refused, since its block takes the top-k itself.
    """

    def __init__(self, model: torch.nn.Module, experts_NLK: torch.Tensor):
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError("router replay needs an MoE model; this one has no routed layers")
        problem = replay_problem(experts_NLK, self.routers)
        if problem is not None:
            raise ValueError(problem)
        self.experts_NLK = experts_NLK.to(torch.long)
        self._handles: list = []

    def __enter__(self) -> "RouterReplay":
        device = self.routers[0].weight.device
        experts_NLK = self.experts_NLK.to(device)
        own_NL = (experts_NLK == OWN_ROUTING).any(-1)
        for layer, router in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(
                _replay_hook(experts_NLK[:, layer], own_NL[:, layer])))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def replay_problem(experts_XLK: torch.Tensor | np.ndarray, routers: list[Any]) -> str | None:
    """Why these experts cannot be replayed through ``routers`` (``moe_routers(model)``), or None:
    not ``[positions, layers, top_k]``, an id outside ``[0, num_experts)`` other than
    ``OWN_ROUTING``, or one expert twice in a row. Raises TypeError for a router replay cannot drive."""
    for router in routers:
        if not hasattr(router, "top_k") or not hasattr(router, "weight"):
            raise TypeError(f"router replay needs a top-k router module, not {type(router).__name__}")
    experts_XLK = torch.as_tensor(experts_XLK)
    layers, top_k, num_experts = len(routers), routers[0].top_k, routers[0].weight.shape[0]
    if experts_XLK.ndim != 3 or tuple(experts_XLK.shape[1:]) != (layers, top_k):
        return (f"replayed experts must be [positions, {layers} layers, top-k {top_k}], "
                f"not {list(experts_XLK.shape)}")
    if bool(((experts_XLK < OWN_ROUTING) | (experts_XLK >= num_experts)).any()):
        return f"replayed expert ids must lie in [0, {num_experts}) (or {OWN_ROUTING})"
    ordered_XLK = experts_XLK.sort(-1).values
    if bool(((ordered_XLK[..., 1:] == ordered_XLK[..., :-1]) & (ordered_XLK[..., 1:] != OWN_ROUTING)).any()):
        return "replayed experts name one expert twice at one position and layer"
    return None


def _replay_hook(replayed_NK: torch.Tensor, own_N: torch.Tensor):
    def replay(module, _inputs, output):
        logits_NE, _, own_NK = output
        if logits_NE.shape[0] != replayed_NK.shape[0]:
            raise ValueError(f"replayed experts cover {replayed_NK.shape[0]} positions, the forward "
                             f"pass has {logits_NE.shape[0]}")
        chosen_NK = torch.where(own_N[:, None], own_NK, replayed_NK)
        # As the router does: softmax in float32 over all experts, then the chosen ones.
        weights_NK = logits_NE.float().softmax(-1).gather(-1, chosen_NK)
        if getattr(module, "norm_topk_prob", False):
            weights_NK = weights_NK / weights_NK.sum(-1, keepdim=True)
        return logits_NE, weights_NK.to(logits_NE.dtype), chosen_NK
    return replay


def replayable(experts_TLK: np.ndarray | None, produced_T: np.ndarray) -> np.ndarray | None:
    """The rollout's experts with ``OWN_ROUTING`` on tokens the policy did not produce (tool output,
    template glue), whose experts the engine never chose; None stays None."""
    if experts_TLK is None:
        return None
    return np.where(np.asarray(produced_T, bool)[:, None, None], experts_TLK, OWN_ROUTING).astype(np.int16)


def replay_positions(rows: list[tuple[int, np.ndarray | None]], seq: int, layers: int, top_k: int
                     ) -> torch.Tensor:
    """``[batch × seq, layers, top_k]`` replay array for right-padded sequences.

    ``rows`` gives, per sequence, its prompt length P and the rollout's experts of its T response
    tokens (row t is the step that scored token t, fed at position P − 1 + t; None: route it all
    itself). Every other position is ``OWN_ROUTING``.
    """
    out_BSLK = torch.full((len(rows), seq, layers, top_k), OWN_ROUTING, dtype=torch.long)
    for b, (prompt, experts_TLK) in enumerate(rows):
        if experts_TLK is None:
            continue
        experts_TLK = np.asarray(experts_TLK)
        if experts_TLK.ndim != 3 or experts_TLK.shape[1:] != (layers, top_k):
            raise ValueError(f"routed experts of sequence {b} must be [tokens, {layers}, {top_k}], "
                             f"not {list(experts_TLK.shape)}")
        if prompt < 1 or prompt - 1 + experts_TLK.shape[0] > seq:
            raise ValueError(f"routed experts of sequence {b} run past its {seq} positions")
        out_BSLK[b, prompt - 1: prompt - 1 + experts_TLK.shape[0]] = torch.from_numpy(
            experts_TLK.astype(np.int64))
    return out_BSLK.reshape(-1, layers, top_k)
