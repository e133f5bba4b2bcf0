"""The trainer engine's body replayed as CUDA graphs (engines/graphs.py) scores as the plain body does.

Runs where CUDA exists (the lent GPU: `benchmarks/gpu_run.sh tests`). The graph replays the very
kernels the plain forward launches, so on the same body the logprobs and entropies must be equal
bit for bit; a shape seen again replays its graph instead of capturing another; padded batches and
MoE models (router hooks) take the plain forward. The CPU tests at the end check the one thing the
graph's body does differently: it decides the causal mask itself, because transformers counts a
CUDA graph capture as tracing and would otherwise build a full mask inside the graph.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from rollmarket.engines import TrainerEngine
from rollmarket.engines.graphs import GraphUnavailable
from rollmarket.engines.loading import load_model

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MODELS = Path(__file__).resolve().parents[1] / "models"


def _pairs(vocab: int, lengths: list[tuple[int, int]], seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, vocab, size=p), rng.integers(3, vocab, size=t)) for p, t in lengths]


def _same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x.logprobs_T, y.logprobs_T)
        np.testing.assert_array_equal(x.entropies_T, y.entropies_T)


@needs_cuda
@pytest.mark.parametrize("body", ["eager", "compiled"])
def test_graphed_body_scores_bit_for_bit_and_reuses_its_graphs(body):
    loaded = load_model(MODELS / "tiny-dense", "bf16", "cuda")
    plain = TrainerEngine(loaded, body=body)
    graphed = TrainerEngine(loaded, body=body, graphs=True)
    vocab = loaded.info.vocab_size
    even = _pairs(vocab, [(16, 48)] * 4, seed=0)  # one unpadded [4, 64] batch
    other = _pairs(vocab, [(7, 25)] * 2, seed=1)  # another shape: [2, 32]
    for pairs in (even, other, _pairs(vocab, [(16, 48)] * 4, seed=2)):  # the first shape again
        _same(graphed.score_batch(pairs), plain.score_batch(pairs))
    assert graphed.graphs_error is None and graphed.graphs.captures == 2


@needs_cuda
def test_padded_batches_and_moe_models_take_the_plain_forward():
    loaded = load_model(MODELS / "tiny-dense", "bf16", "cuda")
    graphed = TrainerEngine(loaded, graphs=True)
    padded = _pairs(loaded.info.vocab_size, [(5, 20), (9, 30)], seed=3)
    _same(graphed.score_batch(padded), TrainerEngine(loaded).score_batch(padded))
    assert graphed.graphs.captures == 0

    moe = load_model(MODELS / "tiny-moe", "bf16", "cuda")
    graphed_moe = TrainerEngine(moe, graphs=True)
    pairs = _pairs(moe.info.vocab_size, [(8, 24)] * 2, seed=4)
    got, want = graphed_moe.score_batch(pairs), TrainerEngine(moe).score_batch(pairs)
    _same(got, want)
    for x, y in zip(got, want):
        np.testing.assert_array_equal(x.routed_experts_TLK, y.routed_experts_TLK)
    assert graphed_moe.graphs.captures == 0


def test_graphs_need_cuda():
    """On the CPU asking for graphs is a clear error, not a silent plain forward."""
    with pytest.raises(ValueError, match="CUDA"):
        TrainerEngine(load_model(MODELS / "tiny-dense", "fp32", "cpu"), graphs=True)


def test_the_graphs_body_leaves_the_mask_out_even_when_transformers_thinks_it_is_tracing(monkeypatch):
    """transformers 5.17 (the device's) answers is_tracing() with True during a CUDA graph capture
    and then builds a [B, 1, S, S] causal mask: other attention kernels than the plain forward's.
    The graphs' body hands every layer no mask, as the plain forward of an unpadded batch does."""
    import transformers.masking_utils as masking

    engine = TrainerEngine(load_model(MODELS / "tiny-dense", "fp32", "cpu"))
    ids_BS = torch.from_numpy(np.random.default_rng(5).integers(3, engine.info.vocab_size, size=(2, 24)))
    want_BSH = engine._plain_body(ids_BS)
    monkeypatch.setattr(masking, "is_tracing", lambda *a, **k: True)
    masks = []
    hook = engine.body.layers[0].register_forward_pre_hook(
        lambda module, args, kwargs: masks.append(kwargs.get("attention_mask")), with_kwargs=True)
    try:
        got_BSH = engine._unmasked_body(ids_BS)
    finally:
        hook.remove()
    assert masks == [None]
    torch.testing.assert_close(got_BSH, want_BSH, rtol=0, atol=0)


def test_sliding_window_layers_keep_their_mask_so_no_graph():
    engine = TrainerEngine(load_model(MODELS / "tiny-dense", "fp32", "cpu"))
    n = engine.body.config.num_hidden_layers
    engine.body.config.layer_types = ["sliding_attention"] * n
    with pytest.raises(GraphUnavailable, match="sliding_attention"):
        engine._unmasked_body(torch.zeros(1, 4, dtype=torch.long))
