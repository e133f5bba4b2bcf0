"""Sequences into padded tensors: the one layout every trainer forward uses.

A datum is a prompt P and a response T (what the engine returned, never re-tokenized) with the
engine's behaviour logprobs on the response and a mask of the tokens the policy produced. After
right-padding to S = max(P + T) positions, slot t of every ``*_BT`` tensor (T = S − 1) scores token
t + 1, so response token r of a datum with prompt length P sits in slot P − 1 + r.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..engines.routing import replay_positions


@dataclass(frozen=True)
class Datum:
    """One sequence to train on. Field names match the agent loop's TrainingView."""

    prompt_token_ids_P: np.ndarray
    response_token_ids_T: np.ndarray
    logprobs_T: np.ndarray
    """Behaviour logprobs: what the rollout engine reported for each response token."""
    action_mask_T: np.ndarray
    """1 on tokens the policy produced (not tool output or template glue)."""
    advantage: float = 0.0
    corrected: bool = False
    """Whether the off-policy correction applies to this sequence (the gate asked for it)."""
    old_logprobs_T: np.ndarray | None = None
    """The trainer's logprobs at the start of the step (teacher forcing); None: the learner scores
    them itself before its first update."""
    routed_experts_TLK: np.ndarray | None = None
    """Router replay (R3): the experts the trainer's forward uses at each response token
    (``OWN_ROUTING`` where it routes itself); None: it routes the whole sequence itself."""


@dataclass
class Batch:
    ids_BS: torch.Tensor
    attention_BS: torch.Tensor
    mask_BT: torch.Tensor
    behaviour_BT: torch.Tensor
    old_BT: torch.Tensor | None
    advantages_B: torch.Tensor
    corrected_B: torch.Tensor
    replay_BSLK: torch.Tensor | None = None
    """Experts every MoE layer uses at each position (``engines.routing.replay_positions``); None
    unless some datum carries routed experts."""


def pad_batch(data, pad_id: int):
    """Right-pad prompt+response of each datum → (ids_BS, attention_BS, action_BT, behaviour_BT)."""
    lengths = [len(d.prompt_token_ids_P) + len(d.response_token_ids_T) for d in data]
    B, S = len(data), max(lengths)
    ids_BS = torch.full((B, S), pad_id, dtype=torch.long)
    attn_BS = torch.zeros((B, S), dtype=torch.long)
    action_BT = torch.zeros((B, S - 1))
    behaviour_BT = torch.zeros((B, S - 1))
    for b, d in enumerate(data):
        P, R = len(d.prompt_token_ids_P), len(d.response_token_ids_T)
        ids_BS[b, :P] = torch.tensor(np.asarray(d.prompt_token_ids_P, dtype=np.int64))
        ids_BS[b, P:P + R] = torch.tensor(np.asarray(d.response_token_ids_T, dtype=np.int64))
        attn_BS[b, :P + R] = 1
        action_BT[b, P - 1:P - 1 + R] = torch.tensor(np.asarray(d.action_mask_T, dtype=np.float32))
        behaviour_BT[b, P - 1:P - 1 + R] = torch.tensor(np.asarray(d.logprobs_T, dtype=np.float32))
    return ids_BS, attn_BS, action_BT, behaviour_BT


def collate(data: list[Datum], pad_id: int) -> Batch:
    ids_BS, attn_BS, mask_BT, behaviour_BT = pad_batch(data, pad_id)
    old_BT = None
    if all(d.old_logprobs_T is not None for d in data):
        old_BT = torch.zeros_like(behaviour_BT)
        for b, d in enumerate(data):
            P, R = len(d.prompt_token_ids_P), len(d.response_token_ids_T)
            old_BT[b, P - 1:P - 1 + R] = torch.tensor(np.asarray(d.old_logprobs_T, dtype=np.float32))
    replay_BSLK = None
    shapes = [d.routed_experts_TLK.shape for d in data if d.routed_experts_TLK is not None]
    if shapes:
        B, S = ids_BS.shape
        _, layers, top_k = shapes[0]
        replay_BSLK = replay_positions([(len(d.prompt_token_ids_P), d.routed_experts_TLK) for d in data],
                                       S, layers, top_k).reshape(B, S, layers, top_k)
    return Batch(ids_BS, attn_BS, mask_BT, behaviour_BT, old_BT,
                 torch.tensor([d.advantage for d in data], dtype=torch.float32),
                 torch.tensor([d.corrected for d in data], dtype=torch.bool), replay_BSLK)
