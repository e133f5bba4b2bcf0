"""Router replay (R3) on the real tiny MoE: the trainer's MoE forward routes to given experts.

What the forward used is read from the expert modules' own inputs (a pre-hook on each layer's
``mlp.experts``), not from the replay code or the engine's capture.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from rollmarket.engines import RolloutEngine, SamplingParams, TrainerEngine, load_model
from rollmarket.engines.routing import OWN_ROUTING, RouterReplay, moe_routers, replay_positions, replayable
from rollmarket.gate.budget import router_flip_rate
from rollmarket.train.batch import Datum
from rollmarket.train.config import resolve

MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-moe"
TEXTS = ("What is 17 * 23?", "Read the file notes/readme.txt and tell me the port.",
         "Who founded the town of Velmora? Search for it.")


@pytest.fixture(scope="module")
def trainer() -> TrainerEngine:
    return TrainerEngine(load_model(MODEL, "fp32"))


@pytest.fixture(scope="module")
def samples(trainer):
    """(prompt, response) pairs sampled by an fp32 rollout engine on the trainer's weights."""
    rollout = RolloutEngine(trainer.loaded)
    prompts = [rollout.encode_chat([{"role": "user", "content": t}]) for t in TEXTS]
    gens = rollout.generate(prompts, SamplingParams(max_tokens=24, seed=3, ignore_eos=True))
    return [(np.asarray(p), g.token_ids_T) for p, g in zip(prompts, gens)]


class ExpertInputs:
    """Records, per MoE layer, the (top-k ids, top-k weights) each ``mlp.experts`` module receives."""

    def __init__(self, model: torch.nn.Module):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft (LoRA)
        self.blocks = [layer.mlp for layer in base.model.layers]
        self.calls: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.blocks]
        self.handles = []

    def __enter__(self):
        for i, block in enumerate(self.blocks):
            self.handles.append(block.experts.register_forward_pre_hook(self._record(i)))
        return self

    def _record(self, layer: int):
        def hook(_module, args):
            _, index_NK, weights_NK = args
            self.calls[layer].append((index_NK.detach().clone(), weights_NK.detach().clone()))
        return hook

    @property
    def seen(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's inputs of the last forward pass."""
        return [calls[-1] for calls in self.calls]

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def indices_NLK(self, call: int = -1) -> np.ndarray:
        return torch.stack([calls[call][0] for calls in self.calls], dim=1).numpy()


def _other_experts(experts_TLK: np.ndarray, num_experts: int) -> np.ndarray:
    """A different, still valid top-k at every position: each id shifted by 3 (ids stay distinct)."""
    return ((experts_TLK.astype(np.int64) + 3) % num_experts).astype(np.int16)


def test_replaying_own_choice_changes_nothing(trainer, samples):
    own = trainer.score_batch(samples)
    replayed = trainer.score_batch(samples, replayed_experts=[s.routed_experts_TLK for s in own])
    for a, b in zip(own, replayed):
        np.testing.assert_allclose(b.logprobs_T, a.logprobs_T, atol=1e-6, rtol=0)
        np.testing.assert_array_equal(b.routed_experts_TLK, a.routed_experts_TLK)


def test_replayed_experts_are_the_ones_used(trainer, samples):
    prompt, response = samples[1]
    P, T = prompt.size, response.size
    num_experts = moe_routers(trainer.loaded.model)[0].weight.shape[0]
    with ExpertInputs(trainer.loaded.model) as plain:
        own = trainer.score(prompt, response)
    other_TLK = _other_experts(own.routed_experts_TLK, num_experts)
    with ExpertInputs(trainer.loaded.model) as used:
        replayed = trainer.score(prompt, response, replayed_experts_TLK=other_TLK)
    used_SLK, plain_SLK = used.indices_NLK(), plain.indices_NLK()
    # Response steps (positions P-1 .. P+T-2) use exactly the replayed experts, in their order.
    np.testing.assert_array_equal(used_SLK[P - 1:P - 1 + T], other_TLK)
    # The prompt's other positions keep the router's own choice.
    np.testing.assert_array_equal(used_SLK[:P - 1], plain_SLK[:P - 1])
    assert (plain_SLK[P - 1:P - 1 + T] != other_TLK).all()
    np.testing.assert_array_equal(replayed.routed_experts_TLK, other_TLK)
    assert np.abs(replayed.logprobs_T - own.logprobs_T).max() > 1e-3


def test_gate_weights_are_the_routers_softmax_at_replayed_experts(trainer, samples):
    """Gate weights = softmax(router logits) at the replayed experts, renormalised (norm_topk_prob),
    computed here from each router's input; and the router weights get a gradient."""
    model = trainer.loaded.model
    prompt, response = samples[0]
    ids = torch.from_numpy(np.concatenate([prompt, response]))[None]
    S, routers = ids.shape[1], moe_routers(model)
    top_k = routers[0].top_k
    own = trainer.score(prompt, response)
    other_TLK = _other_experts(own.routed_experts_TLK, routers[0].weight.shape[0])
    router_inputs: dict[int, torch.Tensor] = {}
    handles = [r.register_forward_pre_hook(
        lambda _m, args, i=i: router_inputs.__setitem__(i, args[0].detach())) for i, r in enumerate(routers)]
    model.zero_grad(set_to_none=True)
    try:
        with ExpertInputs(model) as used, RouterReplay(
                model, replay_positions([(prompt.size, other_TLK)], S, len(routers), top_k)):
            logits = model(input_ids=ids, use_cache=False).logits
            logprobs = logits[0, prompt.size - 1:-1].log_softmax(-1).gather(
                -1, torch.from_numpy(response)[:, None])
            logprobs.sum().backward()
    finally:
        for h in handles:
            h.remove()
    for layer, router in enumerate(routers):
        index_NK, weights_NK = used.seen[layer]
        probs_NE = torch.nn.functional.linear(router_inputs[layer], router.weight.detach()).softmax(-1)
        expected_NK = probs_NE.gather(-1, index_NK)
        expected_NK = expected_NK / expected_NK.sum(-1, keepdim=True)
        torch.testing.assert_close(weights_NK, expected_NK, atol=1e-6, rtol=1e-5)
        grad = router.weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp8"])
def test_replay_of_a_lower_precision_rollout(trainer, precision):
    """An fp32 trainer replaying a lower-precision rollout's experts: no router flip by
    construction, and |Δlogp| on those tokens no larger than without replay (printed: -s)."""
    rollout = RolloutEngine(load_model(MODEL, precision))
    prompts = [rollout.encode_chat([{"role": "user", "content": t}]) for t in TEXTS]
    gens = rollout.generate(prompts, SamplingParams(max_tokens=48, seed=5, ignore_eos=True))
    pairs = [(np.asarray(p), g.token_ids_T) for p, g in zip(prompts, gens)]
    rollout_experts = [g.routed_experts_TLK for g in gens]
    plain = trainer.score_batch(pairs)
    replayed = trainer.score_batch(pairs, replayed_experts=rollout_experts)
    valid = [np.ones(len(g.token_ids_T), bool) for g in gens]
    flips_plain = router_flip_rate(rollout_experts, [s.routed_experts_TLK for s in plain], valid)
    flips_replay = router_flip_rate(rollout_experts, [s.routed_experts_TLK for s in replayed], valid)
    behaviour = np.concatenate([g.logprobs_T for g in gens])
    gap_plain = np.abs(np.concatenate([s.logprobs_T for s in plain]) - behaviour)
    gap_replay = np.abs(np.concatenate([s.logprobs_T for s in replayed]) - behaviour)
    print(f"\n{precision} rollout → fp32 trainer: top-1 flips {flips_plain:.4f} → {flips_replay:.4f}; "
          f"mean |Δlogp| {gap_plain.mean():.5f} → {gap_replay.mean():.5f}, "
          f"max {gap_plain.max():.4f} → {gap_replay.max():.4f}")
    assert flips_replay == 0.0
    for s, e in zip(replayed, rollout_experts):
        np.testing.assert_array_equal(s.routed_experts_TLK, e)
    assert gap_replay.mean() <= gap_plain.mean() + 1e-6


def test_bad_replay_input_is_refused(trainer, samples):
    prompt, response = samples[0]
    routers = moe_routers(trainer.loaded.model)
    L, K, E = len(routers), routers[0].top_k, routers[0].weight.shape[0]
    with pytest.raises(ValueError, match="must be"):
        trainer.score(prompt, response, replayed_experts_TLK=np.zeros((response.size, L + 1, K), np.int16))
    with pytest.raises(ValueError, match="must lie in"):
        trainer.score(prompt, response, replayed_experts_TLK=np.full((response.size, L, K), E, np.int16))
    twice = np.zeros((response.size, L, K), np.int16)  # expert 0 at both top-k slots
    with pytest.raises(ValueError, match="twice"):
        trainer.score(prompt, response, replayed_experts_TLK=twice)
    with pytest.raises(ValueError, match="rows of replayed experts"):
        trainer.score(prompt, response, replayed_experts_TLK=np.zeros((response.size - 1, L, K), np.int16))
    with pytest.raises(ValueError, match="pairs"):
        trainer.score_batch([(prompt, response)], replayed_experts=[])
    with pytest.raises(ValueError, match="no routed layers"):
        RouterReplay(load_model(MODEL.parent / "tiny-dense", "fp32").model,
                     torch.full((4, L, K), OWN_ROUTING))
    # Refused input left no hook behind: scoring afterwards routes as before.
    np.testing.assert_array_equal(trainer.score(prompt, response).logprobs_T,
                                  trainer.score(prompt, response).logprobs_T)


@pytest.mark.parametrize("lora", [False, True])
def test_learner_step_with_router_replay(lora):
    """``trainer.router_replay`` is a saved setting; a GRPO step on datums carrying routed experts
    runs every forward (π_old and the update) through them, and in full fine-tuning the routers
    still learn. With LoRA (peft wraps the model) the routers are found all the same."""
    from rollmarket.train.learner import Learner

    args = [f"model.path={json.dumps(str(MODEL))}", "algorithm.updates_per_batch=1", "optim.lr=1e-2",
            f"lora.enabled={str(lora).lower()}"]
    assert resolve(None, args).trainer.router_replay is False
    cfg = resolve(None, [*args, "trainer.router_replay=true"])
    saved = cfg.model_dump(mode="json")
    assert saved["trainer"]["router_replay"] is True
    assert resolve(None, [], base=saved).trainer.router_replay is True
    learner = Learner(cfg)
    tok = learner.loaded.tokenizer
    prompt = np.asarray(tok("Q: add the numbers.", add_special_tokens=False)["input_ids"])
    pairs = [(prompt, np.asarray(tok(r, add_special_tokens=False)["input_ids"]))
             for r in ("the answer is 12", "12 + 30 is 42, done")]
    routers = moe_routers(learner.model)
    scored = learner.score(pairs, temperature=1.0)
    data, expected = [], []
    for (p, r), s, adv in zip(pairs, scored, (1.0, -1.0)):
        action_T = np.ones(len(r), dtype=np.float32)
        action_T[-1] = 0.0  # stands for tool output: the trainer routes it itself
        other_TLK = _other_experts(s.routed_experts_TLK, routers[0].weight.shape[0])
        expected.append((p.size, other_TLK[:-1]))
        data.append(Datum(p, r, s.logprobs_T.copy(), action_T, advantage=adv,
                          routed_experts_TLK=replayable(other_TLK, action_T)))
    before = [r.weight.detach().clone() for r in routers]
    with ExpertInputs(learner.model) as used:
        metrics = learner.step(data, temperature=1.0)
    assert np.isfinite(metrics["loss"])
    S = max(p.size + r.size for p, r in pairs)
    calls = len(used.calls[0])
    assert calls == 2  # π_old (no old_logprobs_T given) and the one update
    for call in range(calls):
        used_BSLK = used.indices_NLK(call).reshape(len(pairs), S, len(routers), -1)
        for b, (P, other_TLK) in enumerate(expected):
            np.testing.assert_array_equal(used_BSLK[b, P - 1:P - 1 + len(other_TLK)], other_TLK)
    assert len(routers) == learner.loaded.info.num_moe_layers > 0
    # A worker's array that does not fit the model is not replayed (the trainer routes it itself).
    E = routers[0].weight.shape[0]
    produced = np.ones(len(pairs[0][1]), np.float32)
    good = scored[0].routed_experts_TLK
    assert learner.replay_input(np.full_like(good, E), produced) is None
    assert learner.replay_input(good[:, :1], produced) is None
    assert learner.replay_input(None, produced) is None
    np.testing.assert_array_equal(learner.replay_input(good, produced), good)
    for r, w in zip(routers, before):
        assert torch.equal(r.weight.detach(), w) is lora  # LoRA leaves the MoE block alone


def test_router_replay_needs_an_moe_model():
    from rollmarket.train.config import TrainConfigError
    from rollmarket.train.learner import Learner

    with pytest.raises(TrainConfigError, match="needs an MoE model"):
        Learner(resolve(None, [f"model.path={json.dumps(str(MODEL.parent / 'tiny-dense'))}",
                               "trainer.router_replay=true"]))
