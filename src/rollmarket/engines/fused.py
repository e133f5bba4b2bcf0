"""A fused Triton kernel for teacher forcing's softmax statistics on CUDA.

One program per row reads that row's logits once, in their own dtype (bf16 from a bf16 lm-head),
and keeps everything else in float32 registers: the running maximum m, s = Σ exp(z − m) and
u = Σ exp(z − m)·(z − m), with z = logit / temperature. At the end

    logprob = z[target] − m − log s        entropy = log s − u / s

so no ``[positions, vocab]`` float32 buffer is ever written. The torch path in ``teacher`` makes
three float32 passes over each chunk (shift and upcast, exp, the weighted sum) and holds two such
buffers; here the only ``[chunk, vocab]`` tensor is the lm-head's own output.

Import is lazy and guarded: ``available()`` is False where Triton is missing or there is no GPU,
and callers then keep the torch path.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

BLOCK = 2048
"""Vocabulary entries a program reads per step (4 KiB of bf16). On an H100, 2,048 entries and 4
warps read 4,096 × 151,936 bf16 logits in 0.62 ms (2.0 TB/s); 4,096 and 8 warps took 0.65 ms,
8,192 entries 0.93–1.03 ms."""
NUM_WARPS = 4


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


if triton is not None:

    @triton.jit
    def _token_stats_kernel(logits_ptr, row_stride, targets_ptr, logprobs_ptr, entropies_ptr,
                            vocab, inv_temperature, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * row_stride
        offsets = tl.arange(0, BLOCK)
        # m is the running maximum and may be −inf (a masked vocabulary, a first logit of −inf);
        # the sums are kept relative to r, which is m where m is finite and 0 while every logit so
        # far was −inf (then s and u are still 0). Only finite numbers are ever subtracted or
        # multiplied by a sum, so no −inf − (−inf) and no 0·(−inf) arise. These are per-block
        # scalars: the per-entry work is what it was.
        m = tl.full([], float("-inf"), tl.float32)
        r = tl.full([], 0.0, tl.float32)
        s_B = tl.zeros([BLOCK], dtype=tl.float32)
        u_B = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, vocab, BLOCK):
            index = start + offsets
            # Entries past the vocabulary read as −inf: e = 0, and they never win the maximum.
            z_B = tl.load(base + index, mask=index < vocab, other=float("-inf")).to(tl.float32) * inv_temperature
            m_new = tl.maximum(m, tl.max(z_B, axis=0))
            r_new = tl.where(m_new == float("-inf"), 0.0, m_new)
            # Per-lane sums, rescaled to the new reference: Σe(z − r') = scale·(Σe(z − r) + (r − r')Σe).
            # While m is −inf the sums are 0 and stay so (scale = e^(−inf) = 0, and r − r' is not used).
            scale = tl.exp(m - r_new)
            shift = tl.where(m == float("-inf"), 0.0, r - r_new)
            u_B = scale * (u_B + shift * s_B)
            s_B = scale * s_B
            shifted_B = z_B - r_new
            e_B = tl.exp(shifted_B)
            s_B += e_B
            u_B += tl.where(e_B > 0.0, e_B * shifted_B, 0.0)
            m = m_new
            r = r_new
        s = tl.sum(s_B, axis=0)
        u = tl.sum(u_B, axis=0)
        log_s = tl.log(s)
        # A target whose logit is −inf gets −inf; a row of −inf only gets NaN for both, as torch's
        # softmax does (s = 0: the distribution does not exist).
        target = tl.load(targets_ptr + row)
        z_target = tl.load(base + target).to(tl.float32) * inv_temperature
        tl.store(logprobs_ptr + row, z_target - r - log_s)
        tl.store(entropies_ptr + row, log_s - u / s)


def token_stats(logits_CV: torch.Tensor, targets_C: torch.Tensor, temperature: float = 1.0,
                *, block: int = BLOCK, num_warps: int = NUM_WARPS
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (logprob of each target, entropy) of ``softmax(logits / temperature)`` per row.

    ``logits_CV`` may be any float dtype (it is read once, never converted) and hold −inf anywhere:
    a −inf target gets logprob −inf, and a row of −inf only NaN for both, as ``torch.softmax``.
    Targets are not range-checked (that would synchronize with the GPU): they must be < vocab.
    """
    if logits_CV.stride(-1) != 1:
        logits_CV = logits_CV.contiguous()
    C, V = logits_CV.shape
    logprobs_C = torch.empty(C, dtype=torch.float32, device=logits_CV.device)
    entropies_C = torch.empty(C, dtype=torch.float32, device=logits_CV.device)
    if C:
        _token_stats_kernel[(C,)](logits_CV, logits_CV.stride(0), targets_C.contiguous(),
                                  logprobs_C, entropies_C, V, 1.0 / temperature,
                                  BLOCK=block, num_warps=num_warps)
    return logprobs_C, entropies_C


def fused_chunked_token_stats(hidden_NH: torch.Tensor, lm_head: torch.nn.Module,
                              targets_N: torch.Tensor, *, temperature: float = 1.0,
                              chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """``teacher.chunked_token_stats`` with the kernel above: the lm-head at model precision per
    chunk, then one read of its output. No autograd (callers use it under ``no_grad``)."""
    N = hidden_NH.shape[0]
    logprobs_N = torch.empty(N, dtype=torch.float32, device=hidden_NH.device)
    entropies_N = torch.empty(N, dtype=torch.float32, device=hidden_NH.device)
    for start in range(0, N, chunk):
        logits_CV = lm_head(hidden_NH[start:start + chunk])
        lp_C, ent_C = token_stats(logits_CV, targets_N[start:start + chunk], temperature)
        logprobs_N[start:start + chunk] = lp_C
        entropies_N[start:start + chunk] = ent_C
        del logits_CV
    return logprobs_N, entropies_N
