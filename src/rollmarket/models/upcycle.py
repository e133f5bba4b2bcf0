"""Sparse upcycling: start the MoE from the trained dense model (Komatsuzaki et al., 2022).

Trained from scratch on this CPU budget, the tiny MoE stays on the loss plateau before copying
emerges (the skill every tool task needs) long after the dense model has left it. Starting
from the dense model's embeddings, attention and norms, and building each expert from a slice
of the dense MLP, it keeps the dense model's skills and then trains its experts and router.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, Qwen3MoeConfig, Qwen3MoeForCausalLM


@torch.no_grad()
def upcycle(dense: PreTrainedModel, config: Qwen3MoeConfig, noise: float = 0.01, seed: int = 0) -> Qwen3MoeForCausalLM:
    """A Qwen3-MoE model whose shared weights are `dense`'s and whose experts are dense MLP slices.

    Expert e takes slice e mod (dense_intermediate / moe_intermediate) of the dense MLP (gate,
    up and down), times a small multiplicative noise so experts sharing a slice differ; its down
    projection is scaled so two routed experts add up to about half the dense MLP's output scale.
    The router starts random.
    """
    torch.manual_seed(seed)
    moe = Qwen3MoeForCausalLM(config)
    moe_state = moe.state_dict()
    dense_state = dense.state_dict()
    for key, value in dense_state.items():
        if ".mlp." not in key and key in moe_state and moe_state[key].shape == value.shape:
            moe_state[key].copy_(value)
    width = config.moe_intermediate_size
    slices = dense.config.intermediate_size // width
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp."
        gate = dense_state[prefix + "gate_proj.weight"]  # [I, H]
        up = dense_state[prefix + "up_proj.weight"]  # [I, H]
        down = dense_state[prefix + "down_proj.weight"]  # [H, I]
        gate_up_EIH = moe_state[prefix + "experts.gate_up_proj"]  # [E, 2*w, H]
        down_EHI = moe_state[prefix + "experts.down_proj"]  # [E, H, w]
        for e in range(config.num_experts):
            s = slice((e % slices) * width, (e % slices + 1) * width)
            jitter = 1 + noise * torch.randn(2 * width, gate.shape[1])
            gate_up_EIH[e].copy_(torch.cat([gate[s], up[s]], dim=0) * jitter)
            down_EHI[e].copy_(down[:, s] * (slices / 2) * (1 + noise * torch.randn(down.shape[0], width)))
    moe.load_state_dict(moe_state)
    moe.tie_weights()
    return moe
