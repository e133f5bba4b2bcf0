"""The learner's chunked lm-head with its backward (train/head.py) against autograd on the full logits.

The reference is the naive path spelt out here: full logits, log-softmax, gather, −Σ p log p.
"""

from __future__ import annotations

import pytest
import torch

from rollmarket.train.head import ChunkedHead, head_token_stats


def _naive(hidden_NH, weight_VH, targets_N, temperature):
    logp_NV = torch.log_softmax((hidden_NH @ weight_VH.T) / temperature, dim=-1)
    return logp_NV.gather(-1, targets_N[:, None]).squeeze(-1), -(logp_NV.exp() * logp_NV).sum(-1)


def _inputs(N, H, V, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g, dtype=dtype) * 0.7).requires_grad_()
    return hidden, weight, torch.randint(0, V, (N,), generator=g)


@pytest.mark.parametrize("temperature,chunk", [(1.0, 3), (0.6, 4), (1.7, 64)])
def test_gradcheck_in_float64(temperature, chunk):
    hidden, weight, targets = _inputs(N=7, H=5, V=11)
    # Both outputs at once: gradcheck feeds random cotangents to logprob and entropy together.
    assert torch.autograd.gradcheck(lambda h, w: ChunkedHead.apply(h, w, targets, temperature, chunk),
                                    (hidden, weight))


@pytest.mark.parametrize("temperature,chunk", [(1.0, 5), (0.7, 8), (1.3, 200)])
def test_equals_the_full_logits_path_values_and_grads(temperature, chunk):
    """Chunks that do not divide N, a mask on the loss, temperature ≠ 1; float32 as the learner runs."""
    N, H, V = 37, 16, 97
    hidden, weight, targets = _inputs(N, H, V, dtype=torch.float32, seed=1)
    mask = (torch.arange(N) % 3 != 0).float()
    g_lp, g_h = torch.randn(N), torch.randn(N)

    def loss(lp, ent):  # any combination of both outputs, masked
        return ((lp * g_lp + ent * g_h) * mask).sum()

    head = torch.nn.Linear(H, V, bias=False)
    head.weight = torch.nn.Parameter(weight.detach().clone())
    lp, ent = head_token_stats(hidden, head, targets, temperature=temperature, chunk=chunk)
    grads = torch.autograd.grad(loss(lp, ent), (hidden, head.weight))
    ref_lp, ref_ent = _naive(hidden.double(), weight.double(), targets, temperature)
    ref_grads = torch.autograd.grad(loss(ref_lp.float(), ref_ent.float()), (hidden, weight))
    assert lp.shape == ent.shape == (N,) and lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp, ref_lp.float(), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent.float(), atol=2e-5, rtol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want.float(), atol=1e-4, rtol=1e-4)
    # Masked positions get no gradient into their hidden state.
    assert grads[0][mask == 0].abs().max() == 0


def test_tied_weight_sums_both_gradients():
    """A tied lm-head (embedding = head weight) gets the head's gradient added to the embedding's."""
    N, H, V = 9, 6, 13
    hidden, weight, targets = _inputs(N, H, V)
    emb = torch.nn.Embedding(V, H, dtype=torch.float64)
    emb.weight = torch.nn.Parameter(weight.detach().clone())
    head = torch.nn.Linear(H, V, bias=False, dtype=torch.float64)
    head.weight = emb.weight  # tied
    ids = targets.roll(1)
    lp, _ = head_token_stats(emb(ids) + hidden, head, targets, chunk=4)
    lp.sum().backward()
    w = weight.detach().clone().requires_grad_()
    ref_lp, _ = _naive(w[ids] + hidden.detach(), w, targets, 1.0)
    ref_lp.sum().backward()
    torch.testing.assert_close(emb.weight.grad, w.grad)


def test_bad_heads_and_settings_are_refused():
    hidden, weight, targets = _inputs(4, 3, 5)
    with pytest.raises(TypeError, match="bias-free"):
        head_token_stats(hidden, torch.nn.Linear(3, 5, bias=True, dtype=torch.float64), targets)
    with pytest.raises(TypeError, match="bias-free"):
        head_token_stats(hidden, torch.nn.Identity(), targets)
    head = torch.nn.Linear(3, 5, bias=False, dtype=torch.float64)
    with pytest.raises(ValueError, match="temperature"):
        head_token_stats(hidden, head, targets, temperature=0.0)
    with pytest.raises(ValueError, match="chunk"):
        head_token_stats(hidden, head, targets, chunk=-1)


def test_activation_checkpointing_recomputes_layers_and_takes_the_same_update():
    """trainer.activation_checkpointing: each decoder layer runs again in the backward (a forward
    hook inside it fires twice per update), and the step's update and metrics are the plain step's."""
    import json
    from pathlib import Path

    import numpy as np

    from rollmarket.train.batch import Datum
    from rollmarket.train.config import resolve
    from rollmarket.train.learner import Learner

    model = Path(__file__).resolve().parents[1] / "models" / "tiny-dense"
    args = [f"model.path={json.dumps(str(model))}", "optim.lr=1e-3"]
    rng = np.random.default_rng(0)
    data = [Datum(rng.integers(3, 200, 5), rng.integers(3, 200, n), np.full(n, -2.0, np.float32),
                  np.ones(n, np.float32), advantage=a, old_logprobs_T=np.full(n, -2.0, np.float32))
            for n, a in ((7, 1.0), (4, -1.0))]
    learners, calls = {}, {}
    for on in (False, True):
        learners[on] = Learner(resolve(None, [*args, f"trainer.activation_checkpointing={str(on).lower()}"]))
        inside = learners[on].model.model.layers[0].mlp  # in the checkpointed region however it is wrapped
        calls[on] = []
        # A pre-hook: the recompute stops once the last saved tensor is rebuilt, before the mlp returns.
        inside.register_forward_pre_hook(lambda *_, on=on: calls[on].append(1))
        metrics = learners[on].step(data, temperature=1.0)
        calls[on] = (len(calls[on]), metrics)
    assert calls[False][0] == 1 and calls[True][0] == 2  # the update's forward, and its recompute
    for key, value in calls[False][1].items():
        if isinstance(value, float):
            assert calls[True][1][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    for p, q in zip(learners[False].model.parameters(), learners[True].model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)
