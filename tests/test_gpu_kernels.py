"""Teacher forcing's softmax statistics against float64 on the shapes and values that break them.

Two implementations compute (logprob of the target, entropy) of ``softmax(logits / temperature)``
per row: the fused Triton kernel (``engines/fused.py``, CUDA without autograd) and the torch chunk
math (``engines/teacher.py``, everywhere else). Both are checked here on awkward shapes (Qwen3's
vocabulary of 151,936 and odd sizes around the kernel's 2,048-entry block; 1 and 4,097 rows, which
leaves one row past a 4,096-row chunk), bf16/fp16/fp32 logits, temperature ≠ 1, non-contiguous
rows, −inf entries (a first logit of −inf, whole blocks of −inf, one finite entry, a masked tail,
rows of −inf only) and targets at both ends of the vocabulary.

The CUDA tests are skipped on the CPU with "needs CUDA: run on the device": the lead runs this file
on the lent GPU whenever the kernel changes (``bash benchmarks/gpu_run.sh``; docs/benchmarks.md,
"GPU tests", says when it last ran there and what it gave). The torch path's cases run everywhere.

The file imports nothing from the test helpers (the device runs it with ``--noconftest``, without
the server packages).

Tolerances. Both paths read the logits exactly (bf16 and fp16 widen to float32 without rounding)
and the reference takes those same values to float64, so no bf16 error enters the comparison: what
is left is float32 rounding. z/T and z − max are one rounding each (|z|·6e-8). s = Σe^(z−max) ≥ 1
is a sum of positive terms: the kernel adds V/2,048 ≤ 75 terms per lane, then a 2,048-lane tree
(11 levels), so its relative error is below (75 + 11)·6e-8 ≈ 5e-6, and log s is off by at most that
much absolutely. u = Σe·(z−max) has terms of one sign (z − max ≤ 0), so u/s has the same relative
bound; entropy = log s − u/s adds two non-negative numbers and cannot cancel. Hence 2e-5 absolute
plus 2e-5 relative (against the magnitude of the reference, up to ~400 for logprobs of the scaled
rows): a margin of 4× over the bound. −inf and NaN must match exactly.
"""

from __future__ import annotations

import pytest
import torch

from rollmarket.engines import fused
from rollmarket.engines.teacher import chunked_token_stats

CUDA = pytest.mark.skipif(not fused.available(), reason="needs CUDA: run on the device")

VOCABS = (1, 7, 2049, 151_936, 151_937)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TEMPERATURES = (1.0, 0.7)
ATOL = RTOL = 2e-5
NEG_INF = float("-inf")

PATTERNS = ("normal", "scaled", "first-inf", "blocks-inf", "one-finite", "masked-tail", "rows-of-inf")
"""normal: N(0, 3²) logits; scaled: N(0, 30²) (exp overflows without the shift by the maximum);
first-inf: the first logit −inf; blocks-inf: the first two 2,048-entry blocks −inf but for the last
entry; one-finite: every entry −inf but one, half the targets on it; masked-tail: the last eighth
−inf (a padded vocabulary); rows-of-inf: every third row −inf only (NaN, as torch's softmax gives)."""


def make_case(rows: int, vocab: int, pattern: str, dtype: torch.dtype, device: str, seed: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Logits ``[rows, vocab]`` in ``dtype`` and targets, the first row's target the vocabulary's
    last entry and the last row's its first; None where the pattern needs more entries."""
    gen = torch.Generator(device=device).manual_seed(seed)
    scale = 30.0 if pattern == "scaled" else 3.0
    logits = torch.randn(rows, vocab, generator=gen, device=device) * scale
    targets = torch.randint(0, vocab, (rows,), generator=gen, device=device)
    targets[0], targets[-1] = vocab - 1, 0
    if pattern == "first-inf":
        if vocab < 2:
            return None
        logits[:, 0] = NEG_INF
    elif pattern == "blocks-inf":
        if vocab < 2:
            return None
        logits[:, :min(2 * fused.BLOCK, vocab - 1)] = NEG_INF
    elif pattern == "one-finite":
        if vocab < 2:
            return None
        keep = torch.randint(0, vocab, (rows,), generator=gen, device=device)
        keep[0], keep[-1] = 0, vocab - 1
        kept = logits.gather(1, keep[:, None])
        logits.fill_(NEG_INF).scatter_(1, keep[:, None], kept)
        targets[::2] = keep[::2]
    elif pattern == "masked-tail":
        if vocab < 2:
            return None
        logits[:, vocab - max(1, vocab // 8):] = NEG_INF
    elif pattern == "rows-of-inf":
        logits[::3] = NEG_INF
    return logits.to(dtype), targets


def reference(logits_CV: torch.Tensor, targets_C: torch.Tensor, temperature: float,
              rows_per_step: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 logprobs and entropies from log_softmax (−Σ p·log p, 0·log 0 = 0), a few rows at a
    time so the float64 copies of a 4,097 × 151,937 case stay small."""
    logprobs, entropies = [], []
    for start in range(0, logits_CV.shape[0], rows_per_step):
        logp = torch.log_softmax(logits_CV[start:start + rows_per_step].double() / temperature, -1)
        logprobs.append(logp.gather(1, targets_C[start:start + rows_per_step, None]).squeeze(1))
        p = logp.exp()
        # A row of −inf has no distribution: p is NaN there, and so is its entropy.
        entropies.append((-torch.where(p > 0, p * logp, 0.0).sum(-1)).masked_fill(p.isnan().any(-1), torch.nan))
    return torch.cat(logprobs), torch.cat(entropies)


def check(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor], what: str) -> None:
    for name, g, w in zip(("logprob", "entropy"), got, want):
        assert g.dtype == torch.float32, f"{what}: {name} is {g.dtype}"
        torch.testing.assert_close(g.double(), w, atol=ATOL, rtol=RTOL, equal_nan=True,
                                   msg=lambda m, n=name: f"{what}: {n}: {m}")


def kernel(logits_CV: torch.Tensor, targets_C: torch.Tensor, temperature: float):
    # The engine's chunk of 4,096 positions: 4,097 rows leave one row for a second launch.
    with torch.no_grad():
        return fused.fused_chunked_token_stats(logits_CV, torch.nn.Identity(), targets_C,
                                               temperature=temperature, chunk=4096)


def torch_path(logits_CV: torch.Tensor, targets_C: torch.Tensor, temperature: float):
    with torch.no_grad():
        return chunked_token_stats(logits_CV, torch.nn.Identity(), targets_C, temperature=temperature,
                                   chunk=1024, fused=False)


def run_patterns(rows: int, vocab: int, dtype: torch.dtype, temperature: float, device: str, paths) -> None:
    for pattern in PATTERNS:
        case = make_case(rows, vocab, pattern, dtype, device)
        if case is None:
            continue
        want = reference(*case, temperature)
        for name, path in paths:
            check(path(*case, temperature), want, f"{name}, {pattern}, {rows}×{vocab} {dtype}, T={temperature}")
        del case, want


def test_the_patterns_hold_what_they_claim():
    """The reference sees what each pattern is meant to give (so no case is vacuous)."""
    logits, targets = make_case(5, 4200, "first-inf", torch.float32, "cpu")
    assert torch.isinf(logits[:, 0]).all() and targets[0] == 4199 and targets[-1] == 0
    logits, targets = make_case(4, 4200, "blocks-inf", torch.float32, "cpu")
    assert torch.isinf(logits[:, :4096]).all() and torch.isfinite(logits[:, 4096:]).all()
    logits, targets = make_case(6, 300, "one-finite", torch.bfloat16, "cpu")
    assert (torch.isfinite(logits).sum(1) == 1).all()
    lp, ent = reference(logits, targets, 1.0)
    assert (lp[::2] == 0).all() and (ent == 0).all()  # a one-point distribution
    assert torch.isinf(lp[1::2]).any()
    logits, targets = make_case(7, 300, "rows-of-inf", torch.float16, "cpu")
    lp, ent = reference(logits, targets, 0.7)
    assert lp.isnan().tolist() == ent.isnan().tolist() == [True, False, False, True, False, False, True]


# ---- the torch path, on the CPU (these run in CI) ----------------------------------------------

CPU_SHAPES = [(1, 1), (1, 7), (4097, 7), (7, 2049), (1, 151_936), (2, 151_937)]
CPU_PRECISIONS = [(torch.bfloat16, 1.0), (torch.bfloat16, 0.7), (torch.float16, 0.7), (torch.float32, 1.0)]
"""Fewer than the GPU's 3 × 2 (the CPU suite stays lean); each dtype and each temperature is in."""


@pytest.mark.parametrize(("dtype", "temperature"), CPU_PRECISIONS, ids=str)
@pytest.mark.parametrize(("rows", "vocab"), CPU_SHAPES, ids=str)
def test_torch_path_matches_float64_on_the_cpu(rows, vocab, dtype, temperature):
    run_patterns(rows, vocab, dtype, temperature, "cpu", [("torch path", torch_path)])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_non_contiguous_rows(device):
    """Every other row of a wider buffer starting 3 entries in (an odd, unaligned row stride), and a
    transposed buffer (entries not adjacent), with −inf first logits and a masked tail."""
    paths = [("torch path", torch_path)] + ([("kernel", kernel)] if device == "cuda" else [])
    for vocab in (2049, 151_937):
        for dtype in DTYPES:
            logits, targets = make_case(2 * 5, vocab + 5, "masked-tail", dtype, device, seed=1)
            strided = logits[::2, 3:3 + vocab]
            strided[:, 0] = NEG_INF
            transposed = strided.t().contiguous().t()
            assert not strided.is_contiguous() and transposed.stride(-1) != 1
            targets = targets[::2].clamp(max=vocab - 1)
            for view in (strided, transposed):
                want = reference(view, targets, 0.7)
                for name, path in paths:
                    check(path(view, targets, 0.7), want, f"{name}, {vocab} {dtype} {view.stride()}")


def test_torch_path_gradient_is_finite_and_exact_with_minus_inf_logits():
    """The learner differentiates the torch path: −inf logits must give 0 gradient, not NaN.
    Expected: d logprob/dz_j = (δ_jt − p_j)/T and d entropy/dz_j = −p_j·(log p_j + H)/T, in float64."""
    temperature = 0.7
    logits, targets = make_case(6, 2049, "masked-tail", torch.float32, "cpu", seed=2)
    logits[:, 0] = NEG_INF
    logits[1, :1700] = NEG_INF  # 93 finite entries left (the tail from 1,793 is masked)
    # Finite targets: a −inf logprob has no gradient.
    targets = targets.clamp(1, 1792)
    targets[1] = 1750
    w_lp, w_ent = torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    z = logits.clone().requires_grad_(True)
    lp, ent = chunked_token_stats(z, torch.nn.Identity(), targets, temperature=temperature, chunk=4)
    check((lp.detach(), ent.detach()), reference(logits, targets, temperature), "torch path with autograd")
    (lp.double() @ w_lp + ent.double() @ w_ent).backward()

    logp = torch.log_softmax(logits.double() / temperature, -1)
    p = logp.exp()
    entropy = -torch.where(p > 0, p * logp, 0.0).sum(-1, keepdim=True)
    onehot = torch.zeros_like(p).scatter_(1, targets[:, None], 1.0)
    d_lp = (onehot - p) / temperature
    d_ent = -torch.where(p > 0, p * (logp + entropy), 0.0) / temperature
    want = w_lp[:, None] * d_lp + w_ent[:, None] * d_ent
    assert torch.isfinite(z.grad).all()
    assert (z.grad[torch.isinf(logits)] == 0).all()
    torch.testing.assert_close(z.grad.double(), want, atol=1e-6, rtol=1e-4)


# ---- the kernel (and the torch path on the GPU) -----------------------------------------------

@CUDA
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("rows", [1, 4097])
def test_kernel_matches_float64(rows, vocab, dtype, temperature):
    run_patterns(rows, vocab, dtype, temperature, "cuda", [("kernel", kernel), ("torch path", torch_path)])


@CUDA
def test_the_engine_takes_the_kernel_on_cuda_without_autograd():
    """``chunked_token_stats`` routes to the kernel on CUDA under no_grad: its result is the kernel's,
    bit for bit, and differs from the torch path's rounding somewhere."""
    logits, targets = make_case(4097, 151_936, "normal", torch.bfloat16, "cuda", seed=3)
    with torch.no_grad():
        routed = chunked_token_stats(logits, torch.nn.Identity(), targets, chunk=4096)
    direct = kernel(logits, targets, 1.0)
    for a, b in zip(routed, direct):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(routed, torch_path(logits, targets, 1.0)))
