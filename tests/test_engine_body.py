"""The trainer engine's model body (engines/body.py) on the CPU, on the tiny dense Qwen3 model.

Liger-Kernel's Triton kernels cannot run here (no GPU); what can is tested: the CPU default stays
eager, a body that cannot run is a typed error that changes nothing, the fused-kernel wiring
replaces exactly Qwen3's RMSNorm, SwiGLU and rotary function (driven here by float64 kernels
written in this file) and leaves the model as transformers built it outside the engine's span,
and the compiled body agrees with the eager one. The same wiring with Liger's kernels is
measured on the GPU by benchmarks/teacher_forcing.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from rollmarket.engines import TrainerEngine, load_model
from rollmarket.engines.body import BodyPatch, BodyUnavailable, Kernels

MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-dense"


@pytest.fixture(scope="module")
def loaded():
    return load_model(MODEL, "fp32")


def _pairs(vocab: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(3)
    return [(rng.integers(3, vocab, size=p), rng.integers(3, vocab, size=t)) for p, t in ((5, 40), (17, 9))]


def _instance_forwards(model: torch.nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if "forward" in vars(m)]


def _float64_kernels(calls: dict[str, int]) -> Kernels:
    """Qwen3's elementwise math in float64, counting its calls (the math is transformers'; only the
    precision differs, so outputs agree with eager float32 to rounding)."""
    def rms_norm(x, weight, eps):
        calls["rms_norm"] += 1
        x64 = x.double()
        return weight * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def swiglu(gate, up):
        calls["swiglu"] += 1
        return (torch.nn.functional.silu(gate.double()) * up.double()).to(gate.dtype)

    def rope(q, k, cos, sin):
        calls["rope"] += 1
        cos, sin = cos.double().unsqueeze(1), sin.double().unsqueeze(1)

        def rotate(x):
            x64 = x.double()
            half = x64.shape[-1] // 2
            rotated = torch.cat((-x64[..., half:], x64[..., :half]), dim=-1)
            return (x64 * cos + rotated * sin).to(x.dtype)
        return rotate(q), rotate(k)

    return Kernels(device_type="cpu", rms_norm=rms_norm, swiglu=swiglu, rope=rope)


def test_cpu_default_is_eager_and_a_body_that_cannot_run_is_a_typed_error(loaded):
    engine = TrainerEngine(loaded)
    assert engine.body_patch.body == "eager" and engine.body_patch.fused == ()
    before = engine.score_batch(_pairs(loaded.info.vocab_size))
    with pytest.raises(BodyUnavailable, match="needs CUDA"):
        TrainerEngine(loaded, body="liger")
    with pytest.raises(BodyUnavailable, match="unknown body"):
        TrainerEngine(loaded, body="fast")
    # Nothing changed: no module carries a replacement forward, and scores are bit-identical.
    assert _instance_forwards(loaded.model) == []
    after = engine.score_batch(_pairs(loaded.info.vocab_size))
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a.logprobs_T, b.logprobs_T)


def test_fused_kernels_replace_qwen3_elementwise_work_only_inside_the_span(loaded):
    config = loaded.model.config
    layers = config.num_hidden_layers
    decoder = loaded.model.get_decoder()
    ids_BS = torch.from_numpy(np.random.default_rng(0).integers(3, config.vocab_size, size=(2, 33)))
    with torch.no_grad():
        eager_BSH = decoder(input_ids=ids_BS, use_cache=False).last_hidden_state
        calls = {"rms_norm": 0, "swiglu": 0, "rope": 0}
        patch = BodyPatch(decoder, "liger", kernels=_float64_kernels(calls))
        assert patch.fused == ("Qwen3MLP", "Qwen3RMSNorm", "apply_rotary_pos_emb")
        for _ in range(2):  # the patch is reusable
            with patch:
                fused_BSH = decoder(input_ids=ids_BS, use_cache=False).last_hidden_state
        # Per layer: input, post-attention, q and k norms, then the final norm; one MLP and one
        # rotary call per layer.
        assert calls == {"rms_norm": 2 * (4 * layers + 1), "swiglu": 2 * layers, "rope": 2 * layers}
        torch.testing.assert_close(fused_BSH, eager_BSH, rtol=1e-5, atol=1e-5)
        # Outside the span the model is as transformers built it: bit-identical, no kernel called.
        assert _instance_forwards(loaded.model) == []
        again_BSH = decoder(input_ids=ids_BS, use_cache=False).last_hidden_state
        assert calls["rms_norm"] == 2 * (4 * layers + 1)
        assert torch.equal(again_BSH, eager_BSH)
        # Kernels for another device than the model's are refused before anything is patched.
        kernels = _float64_kernels(calls)
        with pytest.raises(BodyUnavailable, match="run on cuda; this model is on cpu"):
            BodyPatch(decoder, "liger", kernels=Kernels("cuda", kernels.rms_norm, kernels.swiglu, kernels.rope))
        assert _instance_forwards(loaded.model) == []


def test_compiled_body_agrees_with_eager_and_stays_inside_the_engine(loaded):
    pairs = _pairs(loaded.info.vocab_size)
    eager = TrainerEngine(loaded).score_batch(pairs)
    # A hook on an MLP sees whether it runs inside a compiled graph (True while Dynamo traces it).
    seen: list[bool] = []
    mlp = loaded.model.get_decoder().layers[0].mlp
    handle = mlp.register_forward_hook(lambda *_: seen.append(torch.compiler.is_compiling()))
    try:
        compiled = TrainerEngine(loaded, body="compiled").score_batch(pairs)
        assert True in seen, "the compiled body ran eagerly"
        # Outside the engine's forward the layers run eagerly again: the hook fires on every call.
        seen.clear()
        ids = torch.tensor([[5, 6, 7, 8]])
        with torch.no_grad():
            for _ in range(3):
                loaded.model(input_ids=ids)
    finally:
        handle.remove()
    assert seen == [False, False, False]
    for e, c in zip(eager, compiled):
        np.testing.assert_allclose(c.logprobs_T, e.logprobs_T, rtol=0, atol=1e-4)
        np.testing.assert_allclose(c.entropies_T, e.entropies_T, rtol=0, atol=1e-4)


def _render_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_render_bodies", MODEL.parents[1] / "docs" / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_body_section_says_not_measured_then_renders_the_verdict_from_the_json(tmp_path, monkeypatch):
    """docs/benchmarks.md's body section before the GPU run, and from a result in the benchmark's
    format (numbers made up here; the verdict's expectations are worked out by hand below)."""
    import json

    render = _render_module()
    monkeypatch.setattr(render, "ROOT", tmp_path)
    assert "Not measured yet" in render.BLOCKS["tfb-provenance"]()
    assert render.BLOCKS["tfb-goal"]() == "Verdict: not measured yet."

    def speed(shape, method, tok_s, memory, peak):
        return dict(shape=shape, method=method, tokens_per_s=tok_s, speedup_vs_naive=tok_s / 100_000,
                    peak_extra_ratio_vs_naive=memory, fraction_of_peak=peak, model_tflops=700 * peak,
                    matmul_peak_tflops=700.0, first_call_s=5.0)

    def variant(label, mean, p999):
        stats = dict(mean=mean, p999=p999, max=2 * p999, mean_exact=mean / 2, p999_exact=p999 / 2, max_exact=p999)
        return dict(label=label, body=label.split(",")[0], **stats, mean_vs_eager=mean, max_vs_eager=p999,
                    meets_criterion=mean <= 0.04 and p999 <= 0.2,
                    by_depth=[dict(depth=1, **{k: x / 10 for k, x in stats.items()}), dict(depth=36, **stats)])

    results = []
    for shape, compiled_tok_s, peak, layers in (("qwen3-0.6b", 170_000, 0.50, 28), ("qwen3-1.7b", 160_000, 0.65, 28),
                                                ("qwen3-4b", 155_000, 0.72, 36)):
        results += [dict(shape=shape, method="naive", tokens_per_s=100_000),
                    speed(shape, "engine-eager", 112_000, 0.05, 0.45),
                    speed(shape, "engine-compiled", compiled_tok_s, 0.05, peak),
                    dict(shape=shape, method="engine-liger", error="body unavailable: no liger"),
                    dict(shape=shape, method="numerics", layers=layers, bound=dict(mean=0.04, p999=0.2),
                         variants=[variant("eager", 0.04, 0.2), variant("eager, one sequence a forward", 0.039, 0.19),
                                   variant("compiled", 0.036, 0.3)])]
    meta = dict(date="2026-11-27T00:00:00+00:00", machine="test", gpu="H100", cuda_default_body="compiled",
                liger_kernel=None)
    (tmp_path / "benchmarks/results").mkdir(parents=True)
    (tmp_path / render.TFB).write_text(json.dumps(dict(meta=meta, results=results)))
    render.load.cache_clear()

    table = render.BLOCKS["tfb-table"]()
    assert "| Qwen3-4B | compiled | 155,000 | **1.55×** | 0.050× | 72% (504 of 700 TFLOP/s) | 5.0 s | **no** |" in table
    assert "| Qwen3-4B | liger | error: body unavailable: no liger |" in table
    goal = render.BLOCKS["tfb-goal"]()
    # 0.6B: 1.70× ≥ 1.6 met, peak 50% missed; 4B: 1.55× ≥ 1.5 met, 72% met, but p99.9 0.3 > 0.2.
    assert "- Qwen3-0.6B: 1.70× the naive path (goal ≥ 1.6×) met;" in goal
    assert "50% of the matmul peak (≥ 70%) **missed**" in goal
    assert "- Qwen3-4B: 1.55× the naive path (goal ≥ 1.5×) met; 0.050× its memory (≤ 0.06×) met; " \
           "72% of the matmul peak (≥ 70%) met; numerics not within eager's **missed**." in goal
    assert "Not met on Qwen3-0.6B, Qwen3-1.7B, Qwen3-4B." in goal
    assert "per shape: Qwen3-0.6B `eager`, Qwen3-1.7B `eager`, Qwen3-4B `eager`." in goal
    why = render.BLOCKS["tfb-why"]()
    assert why.startswith("On the Qwen3-4B shape") and "the compiled body is 1.8e-2 (p99.9 1.5e-1, max 3.0e-1)" in why
    assert "| Qwen3-4B | compiled | 3.6e-2 / 3.0e-1 / 6.0e-1 | 1.8e-2 / 1.5e-1 / 3.0e-1 | 1: 1.8e-3 | " \
           "3.6e-2 / 3.0e-1 | **no** |" in render.BLOCKS["tfb-numerics"]()
