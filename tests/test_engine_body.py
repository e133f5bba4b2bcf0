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
        # Tensors on another device type than the kernels' keep the eager rotary function.
        calls_cuda = {"rms_norm": 0, "swiglu": 0, "rope": 0}
        kernels = _float64_kernels(calls_cuda)
        with BodyPatch(decoder, "liger", kernels=Kernels("cuda", kernels.rms_norm, kernels.swiglu, kernels.rope)):
            decoder(input_ids=ids_BS, use_cache=False)
        assert calls_cuda["rope"] == 0 and calls_cuda["swiglu"] == layers


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
