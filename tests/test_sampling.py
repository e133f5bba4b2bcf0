"""The batched sampler (engines/sampling.py RowBatch): every row of a step sampled together with
its own temperature, top-k, top-p, logprob mode and seed. References are computed per row in
float64 from ``processed_logits`` (the one-row specification) and ``log_softmax``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rollmarket.engines.sampling import RowBatch, SamplingParams, inverse_cdf, processed_logits, row_uniforms, sequence_key

MIXED = [
    SamplingParams(temperature=0.7, top_k=5, top_logprobs=3),
    SamplingParams(temperature=0),
    SamplingParams(top_p=0.6, top_logprobs=4),
    SamplingParams(temperature=1.3, top_k=9, top_p=0.85, logprobs_mode="raw", top_logprobs=2),
    SamplingParams(),
    SamplingParams(temperature=0, top_logprobs=5),
    SamplingParams(temperature=0.5, top_p=0.3),
    SamplingParams(top_k=1),
]


def _logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _reference(logits_V: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a row reports its logprobs from, in float64."""
    if p.temperature == 0 or p.logprobs_mode == "raw":
        return torch.log_softmax(logits_V.double(), -1)
    return torch.log_softmax(processed_logits(logits_V.double(), p), -1)


def test_batched_masks_equal_processed_logits_row_by_row():
    logits_BV = _logits(len(MIXED) * 4, 97)
    params = MIXED * 4
    rows = RowBatch.from_params(params, [sequence_key(0, i) for i in range(len(params))], 97, "cpu")
    batched_BV = rows.processed(logits_BV)
    for b, p in enumerate(params):
        if p.temperature == 0:
            continue  # greedy rows never use the processed distribution
        expected_V = processed_logits(logits_BV[b], p)
        assert torch.equal(torch.isfinite(batched_BV[b]), torch.isfinite(expected_V)), p
        finite = torch.isfinite(expected_V)
        torch.testing.assert_close(batched_BV[b][finite], expected_V[finite])


@pytest.mark.parametrize("scale", [4.0, 0.2])
def test_top_p_over_a_large_vocabulary_equals_processed_logits(scale):
    """Vocab 4,096 (the CPU's candidate path): peaked rows (scale 4: the 1,024 largest logits
    hold top_p) and flat rows (scale 0.2: they do not, a full sort) keep exactly the set of the
    one-row specification, with top-p rows beside a row without it."""
    params = [SamplingParams(top_p=0.9), SamplingParams(temperature=0.8, top_p=0.5), SamplingParams(),
              SamplingParams(top_k=50, top_p=0.7)]
    logits_BV = _logits(len(params), 4096, seed=7) * scale
    probs_BV = torch.softmax(logits_BV.double(), -1)
    covered = torch.topk(probs_BV[0], 1024).values.sum()
    assert bool(covered > 0.9) == (scale > 1)  # row 0 (top-p 0.9) decides which path runs
    rows = RowBatch.from_params(params, [sequence_key(0, i) for i in range(len(params))], 4096, "cpu")
    batched_BV = rows.processed(logits_BV)
    for b, p in enumerate(params):
        expected_V = processed_logits(logits_BV[b], p)
        assert torch.equal(torch.isfinite(batched_BV[b]), torch.isfinite(expected_V)), p
        finite = torch.isfinite(expected_V)
        torch.testing.assert_close(batched_BV[b][finite], expected_V[finite])


def test_logprobs_and_top_logprobs_are_the_reported_distributions():
    logits_BV = _logits(len(MIXED), 64, seed=3)
    rows = RowBatch.from_params(MIXED, [sequence_key(5, i) for i in range(len(MIXED))], 64, "cpu")
    for step in range(6):
        drawn = rows.draw(logits_BV, [step] * len(MIXED))
        for b, p in enumerate(MIXED):
            ref_V = _reference(logits_BV[b], p)
            token = drawn.token_id(b)
            if p.temperature == 0:
                assert token == int(torch.argmax(logits_BV[b]))
            else:
                assert torch.isfinite(processed_logits(logits_BV[b], p)[token])  # never a masked token
            assert drawn.logprob(b) == pytest.approx(float(ref_V[token]), abs=1e-5)
            top = drawn.top(b)
            assert len(top) == p.top_logprobs
            values, ids = torch.topk(ref_V, p.top_logprobs)
            assert [i for i, _ in top] == ids.tolist()
            np.testing.assert_allclose([v for _, v in top], values.numpy(), atol=1e-5)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, top_k=6),
                                    SamplingParams(top_p=0.9, temperature=1.2), SamplingParams()])
def test_draws_follow_the_processed_distribution(params):
    """Chi-square over 16,000 draws (400 sequences × 40 steps) on a vocab of 8: the statistic
    stays under the 1e-4 critical value of its degrees of freedom; masked tokens never appear."""
    vocab, seqs, steps = 8, 400, 40
    logits_V = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    expected = torch.softmax(processed_logits(logits_V.double(), params), -1).numpy()
    rows = RowBatch.from_params([params] * seqs, [sequence_key(11, i) for i in range(seqs)], vocab, "cpu")
    counts = np.zeros(vocab)
    logits_BV = logits_V.expand(seqs, -1).contiguous()
    for step in range(steps):
        drawn = rows.draw(logits_BV, [step] * seqs)
        for b in range(seqs):
            counts[drawn.token_id(b)] += 1
    n = seqs * steps
    kept = expected > 0
    assert counts[~kept].sum() == 0
    chi2 = float((((counts - n * expected) ** 2)[kept] / (n * expected[kept])).sum())
    df = int(kept.sum()) - 1
    # Wilson–Hilferty approximation of the chi-square quantile at p = 1e-4 (z = 3.719).
    critical = df * (1 - 2 / (9 * df) + 3.719 * math.sqrt(2 / (9 * df))) ** 3
    assert chi2 < critical, (chi2, critical, counts / n, expected)


def test_a_sequence_draws_the_same_whatever_its_batch_and_step_neighbours():
    """The uniform is a function of (key, own step): a row alone at its step 3 and the
    same row in a batch of strangers at other steps draw the same token."""
    vocab = 151_936 // 64
    logits_BV = _logits(6, vocab, seed=9)
    params = [SamplingParams(temperature=1.1, top_p=0.95, seed=s) for s in range(6)]
    keys = [sequence_key(p.seed, 0) for p in params]
    together = RowBatch.from_params(params, keys, vocab, "cpu").draw(logits_BV, [3, 0, 7, 1, 3, 12])
    alone = RowBatch.from_params(params[:1], keys[:1], vocab, "cpu").draw(logits_BV[:1], [3])
    assert alone.token_id(0) == together.token_id(0)
    reordered = RowBatch.from_params(params[::-1], keys[::-1], vocab, "cpu").draw(
        logits_BV.flip(0), [12, 3, 1, 7, 0, 3])
    assert [reordered.token_id(5 - b) for b in range(6)] == [together.token_id(b) for b in range(6)]


def test_uniforms_are_uniform_and_uncorrelated_across_keys_and_steps():
    """The hash's uniforms: mean 1/2, variance 1/12, strictly inside (0, 1), no correlation
    between neighbouring keys or steps (|r| < 0.01 over 2^17 pairs: 3.6 standard errors)."""
    keys = [sequence_key(1, i) for i in range(512)]
    u = np.stack([row_uniforms(keys, [step] * len(keys)) for step in range(257)])  # [step, key]
    assert u.dtype == np.float64 and 0 < u.min() and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.003
    assert abs(u.var() - 1 / 12) < 0.002

    def corr(a, b):
        return float(np.corrcoef(a.ravel(), b.ravel())[0, 1])

    assert abs(corr(u[:, :-1], u[:, 1:])) < 0.01  # key i against key i+1
    assert abs(corr(u[:-1], u[1:])) < 0.01  # step t against step t+1
    # A row's number is its own: the same (key, step) anywhere in any batch.
    assert row_uniforms(keys[8:9], [40])[0] == row_uniforms(keys[:9], list(range(32, 41)))[8]
    seeded = sequence_key(3, 0)
    assert seeded == sequence_key(3, 0) and seeded != sequence_key(3, 1)
    assert sequence_key(None, 0) != sequence_key(None, 0)


@pytest.mark.parametrize("vocab,mass", [
    (5, {0: 0.1, 2: 0.3, 3: 0.6}),  # one (short) block; entries 1 and 4 weigh nothing
    (1300, {3: 0.2, 511: 0.05, 512: 0.25, 1299: 0.5}),  # two full blocks and a tail, block edges
])
def test_inverse_cdf_picks_the_bucket_of_each_uniform(vocab, mass):
    """Uniforms just inside each bucket of the cumulative mass pick that bucket's token (never a
    -inf entry), and the second value is the logsumexp of the (unnormalised) logits."""
    z_V = torch.full((vocab,), float("-inf"))
    for token, p in mass.items():
        z_V[token] = math.log(p) + 2.5  # unnormalised: inverse_cdf must not assume a sum of 1
    uniforms, expected, edge = [], [], 0.0
    for token, p in sorted(mass.items()):
        for u in (edge + 1e-6, edge + p / 2, edge + p - 1e-6):
            uniforms.append(u)
            expected.append(token)
        edge += p
    tokens_B, lse_B = inverse_cdf(z_V.expand(len(uniforms), -1).contiguous(), torch.tensor(uniforms, dtype=torch.float64))
    assert tokens_B.tolist() == expected
    torch.testing.assert_close(lse_B, torch.full_like(lse_B, 2.5))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA path: runs where a GPU exists")
def test_cuda_draws_equal_cpu_draws():
    logits_BV = _logits(len(MIXED), 151_936, seed=4)
    keys = [sequence_key(2, i) for i in range(len(MIXED))]
    cpu = RowBatch.from_params(MIXED, keys, 151_936, "cpu").draw(logits_BV, range(len(MIXED)))
    gpu = RowBatch.from_params(MIXED, keys, 151_936, "cuda").draw(logits_BV.cuda(), range(len(MIXED)))
    assert [cpu.token_id(b) for b in range(len(MIXED))] == [gpu.token_id(b) for b in range(len(MIXED))]
    np.testing.assert_allclose([gpu.logprob(b) for b in range(len(MIXED))],
                               [cpu.logprob(b) for b in range(len(MIXED))], atol=1e-4)
