"""Engine tests on the tiny shipped models: real forward passes, no mocks.

The rollout engine (KV-cache sampling) and the trainer engine (teacher forcing, chunked lm-head)
must agree on what a token's logprob is, per precision profile, within the bounds stated below;
the bounds were measured on these models and carry the margin explained in each test. Do not
loosen a bound to make a change pass without a decision: a mismatch between the two engines is
exactly what the observatory exists to measure, so our own must stay small and known.
"""

from __future__ import annotations

from itertools import combinations
from pathlib import Path

import numpy as np
import pytest
import torch

from rollmarket.engines import (
    ModelLoadError,
    Precision,
    RolloutEngine,
    SamplingParams,
    TrainerEngine,
    chunked_token_stats,
    load_model,
    parse_precision,
)
from rollmarket.engines.precision import FP8_MAX, fp8_quantize_dequantize
from rollmarket.engines.sampling import RowBatch, processed_logits, row_uniforms, sequence_key

PROFILES = [p.value for p in Precision]
TEXTS = ("What is 17 * 23?", "hello", "Read the file notes/readme.txt and tell me the port.",
         "Who founded the town of Velmora? Search for it.")


@pytest.fixture(scope="module")
def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(repo_root):
    def get(name: str) -> Path:
        path = repo_root / "models" / name
        assert (path / "config.json").exists(), f"{path} is missing; build the tiny models first"
        return path
    return get


@pytest.fixture(scope="module")
def engines(model_dir):
    """(RolloutEngine, TrainerEngine) over one loaded model per (model, precision), shared."""
    cache: dict[tuple[str, str], tuple[RolloutEngine, TrainerEngine]] = {}

    def get(name: str, precision: str) -> tuple[RolloutEngine, TrainerEngine]:
        if (name, precision) not in cache:
            loaded = load_model(model_dir(name), precision)
            cache[name, precision] = (RolloutEngine(loaded), TrainerEngine(loaded))
        return cache[name, precision]
    return get


def prompts_for(engine: RolloutEngine, texts=TEXTS) -> list[list[int]]:
    return [engine.encode_chat([{"role": "user", "content": t}]) for t in texts]


# ----------------------------------------------------------------------------- routed experts


def test_routed_experts_shape_moe(engines):
    rollout, trainer = engines("tiny-moe", "fp32")
    info = rollout.info
    assert (info.num_moe_layers, info.num_experts, info.top_k) == (4, 8, 2)
    prompt = prompts_for(rollout)[0]
    gen = rollout.generate([prompt], SamplingParams(max_tokens=12, seed=0, ignore_eos=True))[0]
    T, P = gen.token_ids_T.size, len(prompt)
    experts_TLK = gen.routed_experts_TLK
    assert experts_TLK.shape == (T, 4, 2) and experts_TLK.dtype == np.int16
    assert experts_TLK.min() >= 0 and experts_TLK.max() < 8
    assert (experts_TLK[..., 0] != experts_TLK[..., 1]).all(), "top-k experts of a token are distinct"
    assert gen.prompt_routed_experts_PLK.shape == (P - 1, 4, 2)
    tf = trainer.score(prompt, gen.token_ids_T)
    assert tf.routed_experts_TLK.shape == (T, 4, 2) and tf.routed_experts_TLK.dtype == np.int16


def test_routed_experts_none_for_dense(engines):
    rollout, trainer = engines("tiny-dense", "fp32")
    assert not rollout.info.is_moe
    prompt = prompts_for(rollout)[0]
    gen = rollout.generate([prompt], SamplingParams(max_tokens=6, seed=0))[0]
    assert gen.routed_experts_TLK is None and gen.prompt_routed_experts_PLK is None
    assert trainer.score(prompt, gen.token_ids_T).routed_experts_TLK is None


# ----------------------------------------------------------------------------- seeded sampling


@pytest.mark.parametrize("precision", PROFILES)
def test_seeded_sampling_reproducible(engines, precision):
    """Same seed, prompts, profile and batch → the same tokens and the same logprobs, bit for bit."""
    rollout, _ = engines("tiny-moe", precision)
    prompts = prompts_for(rollout)[:2]
    params = SamplingParams(max_tokens=12, seed=7, ignore_eos=True)
    first = rollout.generate(prompts, params)
    again = rollout.generate(prompts, params)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a.token_ids_T, b.token_ids_T)
        np.testing.assert_array_equal(a.logprobs_T, b.logprobs_T)
        np.testing.assert_array_equal(a.routed_experts_TLK, b.routed_experts_TLK)


def test_seeds_give_independent_streams_per_sequence():
    """A sequence's random stream depends on (seed, index in its request) alone."""
    def stream(seed, index):
        return row_uniforms([sequence_key(seed, index)] * 4, range(4)).tolist()

    assert stream(7, 0) == stream(7, 0)
    assert stream(7, 0) != stream(8, 0)
    assert stream(7, 0) != stream(7, 1)
    assert len(set(stream(7, 0))) == 4  # and differs step to step


def test_seeded_sampling_batch_vs_alone_fp32(engines):
    """At fp32 a sequence draws the same tokens alone as in a left-padded batch; its logprobs
    agree to 1e-5 (padding changes matmul shapes, so summation order, not the maths)."""
    rollout, _ = engines("tiny-moe", "fp32")
    prompts = prompts_for(rollout)
    short, long = min(prompts, key=len), max(prompts, key=len)
    assert len(short) < len(long), "the short prompt must be left-padded in the batch"
    params = SamplingParams(max_tokens=16, seed=11, ignore_eos=True)
    in_batch = rollout.generate([short, long], params)[0]
    alone = rollout.generate([short], params)[0]
    np.testing.assert_array_equal(in_batch.token_ids_T, alone.token_ids_T)
    np.testing.assert_allclose(in_batch.logprobs_T, alone.logprobs_T, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(in_batch.routed_experts_TLK, alone.routed_experts_TLK)


# ----------------------------------------------------------------------------- precision profiles


def test_precision_profiles_differ_yet_each_reproducible(engines):
    """Every pair of profiles disagrees by max |Δlogp| > 1e-4 on one 64-token response, while
    repeated scoring at one profile is identical. Measured on the random-init models: fp16 vs
    fp32 ~5e-4 (fp16's unit roundoff is 4.9e-4), bf16 vs fp32 ~5e-3 to 6e-2, fp8 vs bf16 ~0.2."""
    rollout, _ = engines("tiny-moe", "fp32")
    prompt = prompts_for(rollout)[0]
    response = rollout.generate([prompt], SamplingParams(max_tokens=64, seed=1, ignore_eos=True))[0]
    scored = {}
    for precision in PROFILES:
        _, trainer = engines("tiny-moe", precision)
        first = trainer.score(prompt, response.token_ids_T).logprobs_T
        np.testing.assert_array_equal(first, trainer.score(prompt, response.token_ids_T).logprobs_T)
        scored[precision] = first
    for a, b in combinations(PROFILES, 2):
        gap = np.abs(scored[a] - scored[b]).max()
        assert gap > 1e-4, f"{a} and {b} are indistinguishable (max |Δ| {gap:.2e})"


# Bounds on |teacher-forced − sampled| logprobs, per profile: (max, mean).
# (max, 99th percentile, mean) of |Δlogp| per profile; why each, in the test's docstring.
TEACHER_BOUNDS = {"fp32": (1e-4, 1e-4, 1e-5), "fp16": (2.0, 0.05, 0.01),
                  "bf16": (2.0, 0.5, 0.04), "fp8": (2.0, 0.5, 0.04)}
EXPERT_AGREEMENT = {"fp32": 0.99, "fp16": 0.95, "bf16": 0.95, "fp8": 0.95}


@pytest.mark.parametrize("model", ["tiny-moe", "tiny-dense"])
@pytest.mark.parametrize("precision", PROFILES)
def test_teacher_forcing_reproduces_sampled_logprobs(engines, model, precision):
    """Teacher forcing the sampled tokens at the sampler's profile gives back its logprobs.

    The two paths compute the same function in a different order: the sampler runs a prefill
    then one-token steps against a KV cache, the trainer one full-sequence pass; the matmuls'
    sums are split and reordered differently, so results differ by rounding only.

    * fp32: max |Δ| ≤ 1e-4 (measured ≤ 1e-6; ~1e-5 is the expected scale for logits of
      magnitude ~10, which trained models reach).
    * fp16: p99 ≤ 0.05, mean ≤ 0.01; bf16 and fp8 (bf16 compute): p99 ≤ 0.5, mean ≤ 0.04. Measured
      over sampling seeds 0–7 (issue 18's batched sampler): the worst seed's p99 / mean were 0.015 /
      0.006 (fp16), 0.36 / 0.025 (bf16) and 0.35 / 0.021 (fp8) on the MoE, 0.10 / 0.012 at bf16 on
      the dense model. bf16 keeps 8 significant bits and the logits leave the lm-head in bf16, so one
      token moves by a half-ulp of its logit (0.06 for logits in [16, 32)), and the differences
      grow through the layers; in the MoE a router flip sends a token through another expert and
      moves it, and every later token through attention, by up to ~1 nat (the largest single gap
      over those seeds: 0.57 at fp16, 0.55 at bf16, 1.27 at fp8). So the max is bounded only
      against gross errors (≤ 2 nats): the p99 and the mean catch a misaligned or systematically
      shifted path, which moves them by nats.

    Routed experts: the share of (token, MoE layer) whose top-k set matches is ≥ 0.99 at fp32
    (measured 1.0) and ≥ 0.95 otherwise (measured ≥ 0.974 per sequence, 0.993 overall for bf16).
    """
    rollout, trainer = engines(model, precision)
    gens = rollout.generate(prompts_for(rollout),
                            SamplingParams(max_tokens=32, seed=3, ignore_eos=True))
    scored = trainer.score_batch([(g.prompt_token_ids_P, g.token_ids_T) for g in gens])
    gaps = np.concatenate([np.abs(tf.logprobs_T - g.logprobs_T) for tf, g in zip(scored, gens)])
    max_bound, p99_bound, mean_bound = TEACHER_BOUNDS[precision]
    p99 = float(np.quantile(gaps, 0.99))
    assert gaps.max() <= max_bound and p99 <= p99_bound and gaps.mean() <= mean_bound, (
        f"{precision}: max |Δ| {gaps.max():.2e} (≤ {max_bound}), p99 {p99:.2e} (≤ {p99_bound}), "
        f"mean {gaps.mean():.2e} (≤ {mean_bound})")
    if rollout.info.is_moe:
        same = np.concatenate([
            (np.sort(tf.routed_experts_TLK, -1) == np.sort(g.routed_experts_TLK, -1)).all(-1).ravel()
            for tf, g in zip(scored, gens)])
        assert same.mean() >= EXPERT_AGREEMENT[precision], f"experts agree on {same.mean():.3f}"


# ----------------------------------------------------------------------------- logprobs modes


def test_processed_and_raw_logprobs(engines):
    """At temperature 0.7 both modes draw the same tokens (the draw always uses the processed
    distribution) but report different logprobs: processed = teacher forcing at T=0.7, raw =
    teacher forcing at T=1. At T=1 with top-p/top-k off the two modes report the same numbers."""
    rollout, trainer = engines("tiny-moe", "fp32")
    prompt = prompts_for(rollout)[1]

    def sample(temperature: float, mode: str):
        params = SamplingParams(temperature=temperature, max_tokens=24, seed=5, ignore_eos=True,
                                logprobs_mode=mode)
        return rollout.generate([prompt], params)[0]

    processed, raw = sample(0.7, "processed"), sample(0.7, "raw")
    np.testing.assert_array_equal(processed.token_ids_T, raw.token_ids_T)
    assert np.abs(processed.logprobs_T - raw.logprobs_T).max() > 1e-3
    at_07 = trainer.score(prompt, processed.token_ids_T, temperature=0.7).logprobs_T
    at_1 = trainer.score(prompt, processed.token_ids_T).logprobs_T
    np.testing.assert_allclose(processed.logprobs_T, at_07, atol=1e-4, rtol=0)
    np.testing.assert_allclose(raw.logprobs_T, at_1, atol=1e-4, rtol=0)

    processed_1, raw_1 = sample(1.0, "processed"), sample(1.0, "raw")
    np.testing.assert_array_equal(processed_1.token_ids_T, raw_1.token_ids_T)
    np.testing.assert_array_equal(processed_1.logprobs_T, raw_1.logprobs_T)


# ----------------------------------------------------------------------------- top-p / top-k


def allowed_tokens(logits_V: np.ndarray, temperature: float, top_k: int, top_p: float) -> set[int]:
    """The support vLLM's sampler keeps, computed independently in float64."""
    z = logits_V.astype(np.float64) / temperature
    keep = np.ones_like(z, dtype=bool)
    if top_k:
        keep &= z >= np.sort(z)[-top_k]
    order = np.argsort(-np.where(keep, z, -np.inf), kind="stable")
    p = np.exp(z - z[keep].max()) * keep
    p /= p.sum()
    before = np.cumsum(p[order]) - p[order]
    kept = {int(i) for i, b in zip(order, before) if keep[i] and b < top_p}
    return kept


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 5, 1.0), (1.0, 0, 0.5), (0.7, 8, 0.8), (1.3, 0, 0.9), (1.0, 1, 1.0)])
def test_top_p_top_k_never_draw_a_masked_token(temperature, top_k, top_p):
    """Every draw lies in the kept set, and its processed logprob is the renormalised one."""
    gen_logits = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    for row in range(20):
        logits_V = torch.randn(64, generator=gen_logits) * 3
        kept = allowed_tokens(logits_V.numpy(), temperature, top_k, top_p)
        masked_V = processed_logits(logits_V, params)
        assert {int(i) for i in torch.isfinite(masked_V).nonzero().ravel()} == kept
        z = logits_V.double() / temperature
        log_norm = torch.logsumexp(z[sorted(kept)], 0)
        rows = RowBatch.from_params([params] * 50, [sequence_key(row, i) for i in range(50)], 64, "cpu")
        drawn = rows.draw(logits_V.expand(50, -1).contiguous(), [0] * 50)
        for b in range(50):
            assert drawn.token_id(b) in kept
            assert drawn.logprob(b) == pytest.approx(float(z[drawn.token_id(b)] - log_norm), abs=1e-5)


def test_engine_top_k_one_is_greedy_and_top_p_keeps_its_support(engines):
    rollout, _ = engines("tiny-moe", "fp32")
    prompt = prompts_for(rollout)[2]
    greedy = rollout.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    top1 = rollout.generate([prompt], SamplingParams(top_k=1, max_tokens=16, seed=2, ignore_eos=True))[0]
    np.testing.assert_array_equal(greedy.token_ids_T, top1.token_ids_T)
    np.testing.assert_array_equal(top1.logprobs_T, np.zeros_like(top1.logprobs_T))  # renormalised: p = 1
    params = SamplingParams(temperature=0.9, top_k=6, top_p=0.7, top_logprobs=20, max_tokens=24,
                            seed=4, ignore_eos=True)
    gen = rollout.generate([prompt], params)[0]
    for token, top in zip(gen.token_ids_T, gen.top_logprobs):
        support = {i for i, lp in top if np.isfinite(lp)}
        assert 1 <= len(support) <= 6 and int(token) in support


# ----------------------------------------------------------------------------- fp8


def test_fp8_quantize_dequantize_error_bounded_by_e4m3_spacing():
    """e4m3 keeps 3 mantissa bits: a normal value's rounding error is at most half its spacing,
    2^-4 of its magnitude; below 2^-6 (subnormal) the spacing is 2^-9, so the error is at most
    2^-10. In weight units each bound is times the channel's scale (absmax / 448)."""
    gen = torch.Generator().manual_seed(0)
    scales_O = 10.0 ** (torch.rand(48, 1, generator=gen) * 5 - 3)  # channels from 1e-3 to 1e2
    weight_OI = torch.randn(48, 96, generator=gen) * scales_O
    weight_OI[5] = 0.0  # an all-zero channel must survive
    qdq_OI = fp8_quantize_dequantize(weight_OI)
    scale_O1 = weight_OI.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    error_OI = (qdq_OI - weight_OI).abs()
    bound_OI = weight_OI.abs() * 2.0 ** -4 + scale_O1 * 2.0 ** -10
    assert (error_OI <= bound_OI * (1 + 1e-6)).all()
    assert (error_OI.amax(-1) <= weight_OI.abs().amax(-1) / 28 + 1e-30).all()  # 16/448 of absmax
    assert error_OI.max() > 0, "fp8 must actually round"
    np.testing.assert_allclose(qdq_OI.abs().amax(-1), weight_OI.abs().amax(-1), rtol=1e-6)
    assert (qdq_OI[5] == 0).all()
    on_grid = (qdq_OI / scale_O1).to(torch.float8_e4m3fn).float() * scale_O1
    np.testing.assert_allclose(on_grid, qdq_OI, rtol=1e-6, atol=0)


def test_fp8_profile_quantizes_projections_only(engines):
    """fp8 = e4m3 weights for attention and expert projections; embeddings, norms, the router
    and the lm-head stay at bf16, as FP8 checkpoints leave them."""
    bf16 = dict(engines("tiny-moe", "bf16")[0].loaded.model.named_parameters())
    fp8 = dict(engines("tiny-moe", "fp8")[0].loaded.model.named_parameters())
    for name, param in fp8.items():
        keeps = param.ndim < 2 or "embed" in name or "lm_head" in name or name.endswith("mlp.gate.weight")
        assert param.dtype == torch.bfloat16
        assert torch.equal(param, bf16[name]) is keeps, name


# ----------------------------------------------------------------------------- chunked lm-head


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_token_stats_equals_naive_log_softmax(temperature):
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 101, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(101, 16, generator=gen))
    hidden_NH = torch.randn(37, 16, generator=gen)
    targets_N = torch.randint(0, 101, (37,), generator=gen)
    with torch.no_grad():
        logp_NV = torch.log_softmax(head(hidden_NH).float() / temperature, -1)
        want_lp_N = logp_NV.gather(-1, targets_N[:, None]).squeeze(-1)
        want_ent_N = -(logp_NV.exp() * logp_NV).sum(-1)
        for chunk in (1, 5, 36, 37, 64, 1024):
            lp_N, ent_N = chunked_token_stats(hidden_NH, head, targets_N, temperature=temperature,
                                              chunk=chunk)
            torch.testing.assert_close(lp_N, want_lp_N, atol=1e-5, rtol=0)
            torch.testing.assert_close(ent_N, want_ent_N, atol=1e-5, rtol=0)


def test_trainer_engine_chunk_size_does_not_change_results(engines):
    _, trainer = engines("tiny-moe", "fp32")
    pairs = [([5, 6, 7], list(range(10, 40))), ([9], list(range(100, 113)))]
    small = TrainerEngine(trainer.loaded, chunk=4).score_batch(pairs)
    for a, b in zip(small, trainer.score_batch(pairs)):
        np.testing.assert_allclose(a.logprobs_T, b.logprobs_T, atol=1e-5, rtol=0)
        np.testing.assert_allclose(a.entropies_T, b.entropies_T, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- fingerprint


def test_fingerprint_stable_and_distinct_per_profile(engines, model_dir):
    prints = {p: engines("tiny-moe", p)[1].fingerprint() for p in PROFILES}
    assert len(set(prints.values())) == len(PROFILES), prints
    assert all(f.startswith("fp1:") for f in prints.values())
    fresh = TrainerEngine.from_path(model_dir("tiny-moe"), "fp32")
    assert fresh.fingerprint() == prints["fp32"] == fresh.fingerprint()
    assert engines("tiny-moe", "fp32")[0].fingerprint() == prints["fp32"]  # the rollout engine's


# ----------------------------------------------------------------------------- bad input


def test_bad_input_gives_typed_errors_and_changes_nothing(engines, model_dir, tmp_path):
    rollout, trainer = engines("tiny-moe", "fp32")
    prompt = prompts_for(rollout)[0]
    before = trainer.score(prompt, [10, 11, 12]).logprobs_T

    with pytest.raises(ValueError, match="empty prompt"):
        rollout.generate([[]], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="at least one prompt token"):
        trainer.score([], [1, 2, 3])
    with pytest.raises(ValueError, match="expected one of fp32, bf16, fp16, fp8"):
        load_model(model_dir("tiny-moe"), "fp4")
    with pytest.raises(ValueError, match="unknown precision"):
        parse_precision("int8")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path, "fp32")
    context = rollout.info.max_context_tokens
    with pytest.raises(ValueError, match="exceeds the context"):
        rollout.generate([[5] * (context - 2)], SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="exceeds the context"):
        trainer.score([5] * context, [6])
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)

    np.testing.assert_array_equal(trainer.score(prompt, [10, 11, 12]).logprobs_T, before)
