"""Capture the experts an MoE model routes each token to, as vLLM's ``routed_experts`` does.

Forward hooks sit on each MoE layer's router. Transformers' Qwen3-MoE router returns
``(logits, weights, indices)``; older versions use a plain Linear gate that returns logits, from
which the top-k is taken the same way the block does (softmax, then top-k).
"""

from __future__ import annotations

import torch


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router module of every MoE layer, in layer order (dense layers are skipped)."""
    layers = _decoder_layers(model)
    routers = []
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        gate = getattr(mlp, "gate", None)
        if gate is not None and hasattr(mlp, "experts"):
            routers.append(gate)
    return routers


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    body = getattr(model, "model", model)
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
        stacked_NLK = torch.stack([ix for ix in self._indices], dim=1)  # type: ignore[misc]
        self._indices = [None] * len(self.routers)
        return stacked_NLK.to(torch.int16).reshape(batch, seq, len(self.routers), self.top_k).cpu()
