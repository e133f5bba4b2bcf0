"""The learner's lm-head: logprobs and entropies through chunks of positions, with a backward.

The naive step materialises ``[batch, tokens, vocab]`` float32 logits and their log-softmax, and
autograd keeps them for the backward: at 16k tokens and a 152k vocabulary that is 10 GB a copy.
``ChunkedHead`` runs the lm-head ``chunk`` positions at a time and keeps only the hidden states and
two float32 numbers per position (the log-partition and the entropy); its backward recomputes each
chunk's logits. With z = logits / τ, p = softmax(z), H = −Σ p log p:

    d logprob(y) / dz = onehot(y) − p            d H / dz = −p · (log p + H)

and d/dlogits = d/dz / τ. The lm-head runs at the weight's dtype (bf16 on the GPU, as the model's
own forward would), the statistics and the gradient of the logits in float32 (float64 when the
inputs are, for gradcheck).
"""

from __future__ import annotations

import torch

CHUNK = 1024
"""Positions per lm-head call in training, on the CPU and on CUDA. The backward holds two float32
``[chunk, vocab]`` buffers (log p, then the logits' gradient in its place; p) and the gradient at
model precision: 1.5 GB at a 152k vocabulary, where the naive step keeps several 10 GB copies at
16k tokens (docs/benchmarks.md). The matmuls stay large enough at 1,024 rows to run near an
H100's peak."""


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _scaled_logits(hidden_CH: torch.Tensor, weight_VH: torch.Tensor, temperature: float) -> torch.Tensor:
    """z = (hidden · weightᵀ) / τ in the statistics dtype, from a matmul at the weight's dtype."""
    z_CV = (hidden_CH @ weight_VH.T).to(_stat_dtype(weight_VH.dtype))
    return z_CV.div_(temperature) if temperature != 1.0 else z_CV


class ChunkedHead(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], targets [N], τ, chunk) → (logprob [N], entropy [N]).

    Both outputs are differentiable, to the hidden states and to the weight (a tied weight gets
    its gradient from both uses, as autograd sums them). No ``[N, V]`` tensor exists at any time.
    """

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, targets_N, temperature: float, chunk: int):
        N = hidden_NH.shape[0]
        stat = _stat_dtype(weight_VH.dtype)
        logprob_N = torch.empty(N, dtype=stat, device=hidden_NH.device)
        entropy_N = torch.empty_like(logprob_N)
        lse_N = torch.empty_like(logprob_N)
        for s in range(0, N, chunk):
            z_CV = _scaled_logits(hidden_NH[s:s + chunk], weight_VH, temperature)
            lse_C = torch.logsumexp(z_CV, dim=-1)
            lse_N[s:s + chunk] = lse_C
            logprob_N[s:s + chunk] = z_CV.gather(-1, targets_N[s:s + chunk, None]).squeeze(-1) - lse_C
            # p·z in p's own buffer, so no third [chunk, vocab] buffer is made (a batched dot product
            # would avoid it too, but loses digits on the CPU: 4e-4 in the entropy at a 3k vocabulary).
            pz_CV = (z_CV - lse_C[:, None]).exp_().mul_(z_CV)
            entropy_N[s:s + chunk] = lse_C - pz_CV.sum(-1)
            del z_CV, pz_CV
        ctx.save_for_backward(hidden_NH, weight_VH, targets_N, lse_N, entropy_N)
        ctx.temperature, ctx.chunk = temperature, chunk
        return logprob_N, entropy_N

    @staticmethod
    def backward(ctx, grad_logprob_N, grad_entropy_N):
        hidden_NH, weight_VH, targets_N, lse_N, entropy_N = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden_NH = torch.empty_like(hidden_NH) if need_hidden else None
        # Accumulated at the weight's dtype, as autograd keeps the weight's gradient (Liger-Kernel's
        # fused linear cross-entropy does the same); a float32 copy would add 1.2 GB at 1.7B's head.
        grad_weight_VH = torch.zeros_like(weight_VH) if need_weight else None
        for s in range(0, hidden_NH.shape[0], chunk):
            h_CH = hidden_NH[s:s + chunk]
            g_lp_C1, g_h_C1 = grad_logprob_N[s:s + chunk, None], grad_entropy_N[s:s + chunk, None]
            logp_CV = _scaled_logits(h_CH, weight_VH, temperature).sub_(lse_N[s:s + chunk, None])
            p_CV = logp_CV.exp()
            # dz = g_lp·(onehot − p) − g_H·p·(log p + H) = −p·(g_lp + g_H·(log p + H)) + g_lp·onehot,
            # built in place in logp_CV's buffer.
            dz_CV = logp_CV.add_(entropy_N[s:s + chunk, None]).mul_(g_h_C1).add_(g_lp_C1).mul_(p_CV).neg_()
            del p_CV
            dz_CV.scatter_add_(-1, targets_N[s:s + chunk, None], g_lp_C1)
            if temperature != 1.0:
                dz_CV.div_(temperature)
            dlogits_CV = dz_CV.to(weight_VH.dtype)
            del dz_CV
            if need_hidden:
                grad_hidden_NH[s:s + chunk] = dlogits_CV @ weight_VH
            if need_weight:
                grad_weight_VH.addmm_(dlogits_CV.T, h_CH)
            del dlogits_CV
        return grad_hidden_NH, grad_weight_VH, None, None, None


def body_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A causal LM's decoder body (input ids → last hidden states) and its lm-head, as
    ``engines.teacher`` splits it (peft-wrapped models forward ``get_decoder`` and ``lm_head``)."""
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model, model.lm_head


def head_token_stats(hidden_NH: torch.Tensor, lm_head: torch.nn.Module, targets_N: torch.Tensor, *,
                     temperature: float = 1.0, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position, log π(target) and the entropy of π at ``temperature`` through ``lm_head`` (a
    bias-free ``nn.Linear``, as every causal LM here has), differentiable, ``chunk`` positions at a
    time (``CHUNK`` when None)."""
    weight = getattr(lm_head, "weight", None)
    if not isinstance(lm_head, torch.nn.Linear) or lm_head.bias is not None or weight is None:
        raise TypeError(f"the chunked head needs a bias-free nn.Linear lm-head, not {type(lm_head).__name__}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    chunk = chunk or CHUNK
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if hidden_NH.dtype != weight.dtype:  # autocast or a float32 body before a low-precision head
        hidden_NH = hidden_NH.to(weight.dtype)
    return ChunkedHead.apply(hidden_NH, weight, targets_N.to(hidden_NH.device), float(temperature), int(chunk))


def policy_token_stats(model: torch.nn.Module, ids_BS: torch.Tensor, attention_BS: torch.Tensor, at_N: torch.Tensor,
                       temperature: float, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob and entropy of the next token at the flat [B·T] slots ``at_N`` of a right-padded
    batch: the model body once, then ``ChunkedHead`` on those slots' hidden
    states alone, so no [B, T, vocab] tensor exists in the forward or the backward."""
    body, head = body_and_head(model)
    hidden_BSH = body(input_ids=ids_BS, attention_mask=attention_BS, use_cache=False).last_hidden_state
    B, S, H = hidden_BSH.shape
    hidden_NH = hidden_BSH[:, :-1].reshape(B * (S - 1), H)[at_N]
    return head_token_stats(hidden_NH, head, ids_BS[:, 1:].reshape(-1)[at_N], temperature=temperature, chunk=chunk)
