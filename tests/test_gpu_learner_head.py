"""The learner's chunked head with its backward on CUDA (train/head.py), against float64.

Runs where CUDA exists (the lent GPU: `python -m pytest -q tests/test_gpu_learner_head.py`); the
CPU has the same comparisons in tests/test_train_head.py. At bf16 the logits themselves are rounded
by the lm-head's matmul, as in the model's own forward, so the chunked path must stay as close to
float64 as the naive bf16 path (full logits, float32 log-softmax, autograd) does.
"""

from __future__ import annotations

import pytest
import torch

from rollmarket.train.head import head_token_stats

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
VOCAB = 151936


def _case(N: int, H: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = (torch.randn(N, H, generator=g, device="cuda") * 2).to(dtype).requires_grad_()
    head = torch.nn.Linear(H, VOCAB, bias=False, device="cuda", dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB, H, generator=g, device="cuda") * H ** -0.5)
    targets = torch.randint(0, VOCAB, (N,), generator=g, device="cuda")
    g_lp, g_ent = torch.randn(N, generator=g, device="cuda"), torch.randn(N, generator=g, device="cuda")
    return hidden, head, targets, g_lp, g_ent


def _grads(lp, ent, g_lp, g_ent, hidden, weight):
    return torch.autograd.grad((lp.double() * g_lp + ent.double() * g_ent).sum(), (hidden, weight))


def _float64(hidden, weight, targets, temperature, g_lp, g_ent):
    """Logprobs, entropies and their gradients to (hidden, weight), all in float64."""
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    logp = torch.log_softmax((h64 @ w64.T) / temperature, -1)
    lp, ent = logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
    return lp.detach(), ent.detach(), _grads(lp, ent, g_lp, g_ent, h64, w64)


def _max_err(a, b) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


@pytest.mark.parametrize("N,chunk,temperature", [(1, 1024, 1.0), (4097, 1024, 0.7), (1500, 333, 1.3)])
def test_float32_matches_float64(N, chunk, temperature):
    hidden, head, targets, g_lp, g_ent = _case(N, 128, torch.float32)
    lp, ent = head_token_stats(hidden, head, targets, temperature=temperature, chunk=chunk)
    ref_lp, ref_ent, want = _float64(hidden, head.weight, targets, temperature, g_lp, g_ent)
    assert _max_err(lp, ref_lp) < 1e-4 and _max_err(ent, ref_ent) < 1e-4
    got = _grads(lp, ent, g_lp, g_ent, hidden, head.weight)
    for a, b in zip(got, want):
        assert _max_err(a, b) <= 1e-4 * max(1.0, float(b.abs().max()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_is_as_close_to_float64_as_the_naive_path(dtype):
    """Values and gradients: the chunked head's distance to float64 within 1.5× (plus a rounding
    step) of the naive path's, whose logits are the model's own low-precision matmul output."""
    N, temperature = 2049, 0.8
    hidden, head, targets, g_lp, g_ent = _case(N, 256, dtype, seed=1)
    lp, ent = head_token_stats(hidden, head, targets, temperature=temperature, chunk=1024)
    naive_logits = head(hidden).float() / temperature
    naive_logp = torch.log_softmax(naive_logits, -1)
    naive_lp = naive_logp.gather(-1, targets[:, None]).squeeze(-1)
    naive_ent = -(naive_logp.exp() * naive_logp).sum(-1)
    ref_lp, ref_ent, want = _float64(hidden, head.weight, targets, temperature, g_lp, g_ent)
    eps = torch.finfo(dtype).eps
    for got, naive, ref in ((lp, naive_lp, ref_lp), (ent, naive_ent, ref_ent)):
        assert _max_err(got, ref) <= 1.5 * _max_err(naive, ref) + 4 * eps
    got = _grads(lp, ent, g_lp, g_ent, hidden, head.weight)
    naive = _grads(naive_lp, naive_ent, g_lp, g_ent, hidden, head.weight)
    for a, b, ref in zip(got, naive, want):
        assert a.dtype == b.dtype == dtype
        assert _max_err(a, ref) <= 1.5 * _max_err(b, ref) + 4 * eps * float(ref.abs().max())
