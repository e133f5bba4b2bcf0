"""Issue 13's training math, each formula against numbers worked out by hand (docs/training.md).

- the loss aggregations under verl's names, with Dr. GRPO's constant normaliser (never the padded
  width) and its gradients;
- the KL estimators k1, k2, k3, low_var_kl: values and per-token gradients on small tensors, and the
  expected gradient of each exactly on a categorical distribution (k1 → 0, k2 → ∇KL(π‖π_ref),
  k3 → ∇KL(π_ref‖π));
- the reward-tie figures (retrain's definitions);
- the planning-token detector on hand-labelled examples with the shipped tokenizer;
- a learner step with two mini-batches against an independent re-computation of the whole step.

Do not change an expected number without a decision.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from rollmarket.train.batch import Datum
from rollmarket.train.config import TrainConfigError, resolve
from rollmarket.train.losses import LossConfig, aggregate, kl_to_ref, policy_loss
from rollmarket.train.planning import DEFAULT_PLANNING_GRAMS, PlanningDetector, decode_fn, token_spans
from rollmarket.train.reward_stats import reward_tie_stats

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "tiny-moe"
T = torch.tensor


def close(actual, expected, atol=1e-6, rtol=0.0):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64),
                               torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=rtol)


# --- aggregation ------------------------------------------------------------------------------

# Per-token losses L: row 0 has 3 valid tokens [1, 2, 3], row 1 one valid token [4], row 2 none
# (all masked, e.g. rejected). Padding holds 100s that must never count. B = 3 rows.
L_BT = T([[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0], [100.0, 100.0, 100.0, 100.0]])
M_BT = T([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize("aggregation,norm_len,expected", [
    ("token-mean", None, 10 / 4),                 # Σ L / Σ m = (1+2+3+4)/4 = 2.5
    ("seq-mean-token-sum", None, (6 + 4) / 2),    # token sums 6 and 4 over the 2 non-empty rows = 5
    ("seq-mean-token-mean", None, (2 + 4) / 2),   # token means 6/3 = 2 and 4/1 = 4 → 3
    ("seq-mean-token-sum-norm", 8, 10 / (3 * 8)),  # Σ L / (B · norm_len) = 10/24 = 0.4166667
])
def test_aggregations_match_verl_semantics_and_ignore_the_padded_width(aggregation, norm_len, expected):
    close(aggregate(L_BT, M_BT, aggregation, norm_len), expected)
    # The same tokens padded to width 10: no mode may move (the old Dr. GRPO mode divided by T).
    wide_L = torch.cat([L_BT, torch.full((3, 6), 100.0)], dim=1)
    wide_M = torch.cat([M_BT, torch.zeros(3, 6)], dim=1)
    close(aggregate(wide_L, wide_M, aggregation, norm_len), expected)


def test_aggregation_gradients():
    # reinforce with lp the variable: L_t = −A_t·lp_t, so ∂L_t/∂lp_t = −A_t; A = L_BT above.
    # token-mean: −A_t/4. seq-mean-token-sum: −A_t/2 (2 non-empty rows). seq-mean-token-mean:
    # row 0 −A_t/(2·3), row 1 −A_t/(2·1). seq-mean-token-sum-norm (norm_len 8): −A_t/(3·8).
    # Padding and the empty row get 0.
    expected = {
        "token-mean": [[-1 / 4, -2 / 4, -3 / 4, 0], [-4 / 4, 0, 0, 0]],
        "seq-mean-token-sum": [[-1 / 2, -2 / 2, -3 / 2, 0], [-4 / 2, 0, 0, 0]],
        "seq-mean-token-mean": [[-1 / 6, -2 / 6, -3 / 6, 0], [-4 / 2, 0, 0, 0]],
        "seq-mean-token-sum-norm": [[-1 / 24, -2 / 24, -3 / 24, 0], [-4 / 24, 0, 0, 0]],
    }
    for aggregation, grad in expected.items():
        lp = torch.full((3, 4), -1.0, requires_grad=True)
        loss, _ = policy_loss(lp, torch.zeros(3, 4), L_BT, M_BT,
                              LossConfig(kind="reinforce", aggregation=aggregation, norm_len=8))
        loss.backward()
        close(lp.grad, grad + [[0.0] * 4], atol=1e-7)


def test_dr_grpo_needs_a_constant_and_old_names_are_refused_with_the_new_one():
    with pytest.raises(ValueError, match="needs norm_len"):
        LossConfig(aggregation="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="needs norm_len"):
        aggregate(L_BT, M_BT, "seq-mean-token-sum-norm")
    for old, new in [("token_mean", "token-mean"), ("seq_mean_token_mean", "seq-mean-token-mean"),
                     ("seq_mean_token_sum", "seq-mean-token-sum-norm")]:
        with pytest.raises(ValueError, match=f"renamed '{new}'"):
            LossConfig(aggregation=old)
        with pytest.raises(TrainConfigError, match=f"renamed '{new}'") as caught:
            resolve(None, [f"algorithm.aggregation={old}"])
        assert new in caught.value.fix


def test_norm_len_defaults_to_the_generation_budget(tmp_path):
    cfg = resolve(None, ["algorithm.aggregation=seq-mean-token-sum-norm", "rollout.max_tokens=48",
                         "agent.max_turns=3"])
    assert cfg.algorithm.norm_length(cfg.rollout, cfg.agent) == 48 * 3  # policy tokens: ≤ 48 per turn, 3 turns
    cfg = resolve(None, ["algorithm.norm_len=100", "rollout.max_tokens=48"])
    assert cfg.algorithm.norm_length(cfg.rollout, cfg.agent) == 100
    path = tmp_path / "old.toml"
    path.write_text('[algorithm]\naggregation = "seq_mean_token_sum"\n')
    with pytest.raises(TrainConfigError, match="seq-mean-token-sum-norm"):
        resolve(path)


# --- KL estimators ----------------------------------------------------------------------------

# u = lp − ref = log(π/π_ref) per token; lp = 0, so ref = −u.
U = [-0.5, 0.3, 2.0, 8.0, -3.0, 25.0, -25.0]


def _value_and_grad(kind: str):
    lp = torch.zeros(1, len(U), dtype=torch.float64, requires_grad=True)
    ref = -T([U], dtype=torch.float64)
    kl = kl_to_ref(lp, ref, kind)
    kl.sum().backward()
    return kl.detach()[0].tolist(), lp.grad[0].tolist()


def test_kl_estimator_values_and_gradients_by_hand():
    e = math.exp
    # k1 = u, ∂/∂lp = 1.
    value, grad = _value_and_grad("k1")
    close(value, U)
    close(grad, [1.0] * len(U))
    # k2 = u²/2, ∂/∂lp = u.   (−0.5 → 0.125; 0.3 → 0.045; 2 → 2; 8 → 32; −3 → 4.5; ±25 → 312.5)
    value, grad = _value_and_grad("k2")
    close(value, [0.125, 0.045, 2.0, 32.0, 4.5, 312.5, 312.5])
    close(grad, U)
    # k3 = e^{−u} + u − 1, ∂/∂lp = 1 − e^{−u}. u = −0.5: 1.6487213 − 1.5 = 0.1487213, grad −0.6487213;
    # u = 0.3: 0.7408182 − 0.7 = 0.0408182, grad 0.2591818; u = 2: 0.1353353 + 1 = 1.1353353, grad 0.8646647.
    value, grad = _value_and_grad("k3")
    close(value, [e(-u) + u - 1 for u in U], rtol=1e-12)
    close(value[:3], [0.1487213, 0.0408182, 1.1353353], atol=1e-7)
    close(grad, [1 - e(-u) for u in U], rtol=1e-12)
    close(grad[:3], [-0.6487213, 0.2591818, 0.8646647], atol=1e-7)
    # low_var_kl (verl): d = −u clamped to ±20, estimate e^d − d − 1 clamped to ±10.
    #   u = −0.5, 0.3, 2: as k3.  u = 8: e^{−8} + 7 = 7.0003355, grad 1 − e^{−8} = 0.9996645 (no clamp).
    #   u = −3: e^3 − 4 = 16.0855369 > 10 → 10, grad 0.  u = 25: d → −20, e^{−20} + 19 > 10 → 10, grad 0.
    #   u = −25: d → 20 → 10, grad 0.
    value, grad = _value_and_grad("low_var_kl")
    close(value, [0.1487213, 0.0408182, 1.1353353, 7.0003355, 10.0, 10.0, 10.0], atol=1e-7)
    close(grad, [-0.6487213, 0.2591818, 0.8646647, 0.9996645, 0.0, 0.0, 0.0], atol=1e-7)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_expected_kl_gradient_on_a_categorical_policy(kind):
    """E_{y~π}[∇θ k(y)], the gradient a sampled KL loss gives on average, summed exactly over the
    outcomes of π = softmax(θ). Hand-derived: k1 → 0; k2 → ∇KL(π‖π_ref) = π ⊙ (u − E_π u), u = log π −
    log π_ref; k3 and low_var_kl (no clamp binds here) → ∇KL(π_ref‖π) = π − π_ref."""
    theta = T([0.3, -1.2, 0.8, 0.0], dtype=torch.float64, requires_grad=True)
    ref_logp = torch.log_softmax(T([0.0, 0.5, -0.5, 1.0], dtype=torch.float64), dim=0)
    logp = torch.log_softmax(theta, dim=0)
    pi = logp.exp().detach()
    k = kl_to_ref(logp[None], ref_logp[None], kind)[0]
    (pi * k).sum().backward()
    u = (logp - ref_logp).detach()
    expected = {"k1": torch.zeros(4, dtype=torch.float64),
                "k2": pi * (u - (pi * u).sum()),
                "k3": pi - ref_logp.exp(),
                "low_var_kl": pi - ref_logp.exp()}[kind]
    close(theta.grad, expected, atol=1e-12)
    if kind == "k2":  # and it is the forward KL's own gradient
        t2 = theta.detach().clone().requires_grad_()
        lp2 = torch.log_softmax(t2, dim=0)
        (lp2.exp() * (lp2 - ref_logp)).sum().backward()
        close(theta.grad, t2.grad, atol=1e-12)


def test_kl_ref_is_null_without_a_reference():
    _, m = policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
    assert m["actor/kl_ref"] is None


# --- reward ties -----------------------------------------------------------------------------

def test_reward_tie_stats_by_hand():
    groups = [[1.0, 0.0, 0.0, 1.0],  # tie; pairs 6, tied 1 + 1 = 2; distinct 2/4
              [1.0, 1.0, 1.0, 1.0],  # tie, uniform; pairs 6, tied 6; distinct 1/4
              [1.0, 0.0, 0.5],       # no tie; pairs 3, tied 0; distinct 3/3
              [0.7]]                 # one rollout: not eligible, counts nowhere
    s = reward_tie_stats(groups)
    assert s["reward_tie_eligible_groups"] == 3
    close(s["reward_tie_group_rate"], 2 / 3)
    close(s["reward_uniform_group_rate"], 1 / 3)
    close(s["reward_tie_pair_rate"], (2 + 6 + 0) / (6 + 6 + 3))          # 8/15, pooled over pairs
    close(s["reward_unique_fraction_mean"], (2 / 4 + 1 / 4 + 3 / 3) / 3)  # 0.5833333
    # Binary rewards, G = 3: every group repeats a reward (pigeonhole) → rate 1; pairs still tell:
    # [1,0,0] ties 1 of 3 pairs, [1,1,1] all 3 → 4/6.
    s = reward_tie_stats([[1, 0, 0], [1, 1, 1]])
    assert s["reward_tie_group_rate"] == 1.0
    close(s["reward_tie_pair_rate"], 4 / 6)
    none = reward_tie_stats([[1.0], []])
    assert none == {"reward_tie_group_rate": None, "reward_uniform_group_rate": None, "reward_tie_pair_rate": None,
                    "reward_unique_fraction_mean": None, "reward_tie_eligible_groups": 0}


# --- planning tokens ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL)


# (text, phrases (None: the shipped list), the tokens a reader marks by hand). The shipped tokenizer
# splits "The key insight" as 'T','he',' ','ke','y',' in','si','g','h','t'; a token is planning when
# its text overlaps a phrase (so ' L' of " LET" counts: its letter is in the phrase).
LABELLED = [
    ("The key insight: wait, let me check. First I need to add.", None,
     # "wait, let" has a comma: not "wait let me". "let me check" and "the key insight" match.
     ["T", "he", " ", "ke", "y", " in", "si", "g", "h", "t", " let", " ", "me", " c", "he", "ck"]),
    ("The key insight: wait, let me check. First I need to add.", ["first I need to", "wait"],
     [" w", "a", "it", " F", "ir", "st", " I", " need", " to"]),
    ("Notice that 3 + 4 = 7. LET ME VERIFY:\n  double check it", None,
     ["N", "o", "tic", "e", " th", "at", " L", "E", "T", " M", "E", " V", "E", "R", "I", "F", "Y",
      " d", "ou", "bl", "e", " c", "he", "ck"]),
    # Whole words only ("outwait", "meow"), "double-check" is not "double check", any whitespace run
    # between words matches ("let me\n\nthink").
    ("outwait let meow, double-check and let me\n\nthink", None,
     [" let", " ", "me", "\n\n", "th", "in", "k"]),
    ("the answer is 12", None, []),
]


@pytest.mark.parametrize("text,grams,marked", LABELLED)
def test_planning_detector_on_labelled_examples(tokenizer, text, grams, marked):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    decode = decode_fn(tokenizer)
    detector = PlanningDetector(tuple(grams)) if grams else PlanningDetector()
    mask = detector.mask(ids, decode)
    assert [decode([i]) for i, m in zip(ids, mask) if m] == marked


def test_token_spans_cover_the_text_even_when_characters_split_across_tokens(tokenizer):
    decode = decode_fn(tokenizer)
    # 'é' and the emoji are split over byte-level tokens: single-token decodes do not concatenate.
    text = "café 🙂 wait let me think"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert "".join(decode([i]) for i in ids) != text
    decoded, starts, ends = token_spans(ids, decode)
    assert decoded == text and starts[0] == 0 and ends[-1] == len(text)
    assert (starts[1:] == ends[:-1]).all() and (ends >= starts).all()
    marked = [i for i, m in zip(ids, PlanningDetector().mask(ids, decode)) if m]
    assert decode(marked) == " wait let me think"  # both "wait let me" and "let me think", nothing before


def test_planning_settings_are_checked(tmp_path):
    for transform in ("gtpo_hicra", "gtpo_sepa"):
        with pytest.raises(TrainConfigError, match="planning_detector") as caught:
            resolve(None, [f"algorithm.transform={transform}"])
        assert "strategic_grams" in caught.value.fix
        ok = resolve(None, [f"algorithm.transform={transform}", "algorithm.planning_detector=strategic_grams"])
        assert ok.algorithm.planning_grams is None  # the shipped list
    with pytest.raises(TrainConfigError, match="planning_grams"):
        resolve(None, ["algorithm.planning_detector=strategic_grams", "algorithm.planning_grams=['  ']"])
    assert len(DEFAULT_PLANNING_GRAMS) == 18


# --- a learner step with two mini-batches ----------------------------------------------------

RESPONSES = ["wait let me check: 3 + 4 = 7", "the answer is 12", "let me think about 5 and 6, notice that",
             "12 + 30 is 42", "on second thought it is 9", "done: 77"]
ADVANTAGES = [1.0, -1.0, 0.5, -0.5, 1.5, -1.5]


def _learner_and_data(tmp_path, *overrides):
    from rollmarket.train.learner import Learner

    cfg = resolve(None, [f"model.path={json.dumps(str(MODEL))}", "rollout.max_tokens=16", "agent.max_turns=2",
                         "optim.lr=1e-3", "algorithm.updates_per_batch=2", *overrides])
    learner = Learner(cfg)
    tok = learner.loaded.tokenizer
    prompt = np.asarray(tok("Q: add the numbers.", add_special_tokens=False)["input_ids"])
    rng = np.random.default_rng(0)
    pairs = [(prompt, np.asarray(tok(r, add_special_tokens=False)["input_ids"])) for r in RESPONSES]
    scored = learner.score(pairs, temperature=1.0)
    data = []
    for (p, r), s, adv in zip(pairs, scored, ADVANTAGES):
        action_T = np.ones(len(r), dtype=np.float32)
        action_T[-1] = 0.0  # the last token stands for tool output: never trained on
        # π_old away from the current policy, so that the clip binds in both mini-batches.
        old_T = s.logprobs_T + rng.normal(0, 0.4, len(r)).astype(np.float32)
        data.append(Datum(p, r, s.logprobs_T.copy(), action_T, advantage=adv, old_logprobs_T=old_T))
    return learner, data


def _independent_step(learner, data, aggregation, norm_len, kl_coef):
    """The step redone on copies, with the per-token figures computed here and pooled over the whole
    batch (not per mini-batch): what the step's metrics must equal."""
    from rollmarket.train.batch import collate
    from rollmarket.train.transforms import TransformConfig, token_advantages

    model = copy.deepcopy(learner.model)
    reference = copy.deepcopy(learner.reference)
    o = learner.config.optim
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=o.lr,
                            weight_decay=o.weight_decay, betas=o.betas)
    a = learner.config.algorithm
    tok = learner.loaded.tokenizer
    detector = PlanningDetector()
    pad = learner.pad_id
    per_token = {k: [] for k in ("pg", "clip", "ppo_kl", "kl", "entropy", "plan", "rows")}
    grad_norms, last = [], None
    halves = [list(range(0, 3)), list(range(3, 6))]  # np.array_split of 6 rows into 2
    for rows in halves:
        sub = collate([data[i] for i in rows], pad)
        m_BT = sub.mask_BT
        logits = model(input_ids=sub.ids_BS, attention_mask=sub.attention_BS).logits.float()[:, :-1]
        logp_BTV = torch.log_softmax(logits, dim=-1)
        lp_BT = logp_BTV.gather(-1, sub.ids_BS[:, 1:, None]).squeeze(-1)
        ent_BT = -(logp_BTV.exp() * logp_BTV).sum(-1).detach()
        with torch.no_grad():
            ref_logits = reference(input_ids=sub.ids_BS, attention_mask=sub.attention_BS).logits.float()[:, :-1]
            ref_BT = torch.log_softmax(ref_logits, dim=-1).gather(-1, sub.ids_BS[:, 1:, None]).squeeze(-1)
        plan_BT = torch.zeros_like(m_BT)
        for b, i in enumerate(rows):
            P, R = len(data[i].prompt_token_ids_P), len(data[i].response_token_ids_T)
            plan_BT[b, P - 1:P - 1 + R] = torch.from_numpy(
                detector.mask(data[i].response_token_ids_T.tolist(), decode_fn(tok)).astype(np.float32))
        adv_BT, _ = token_advantages(sub.advantages_B, ent_BT, m_BT, TransformConfig("gtpo_hicra"),
                                     planning_mask_BT=plan_BT)
        cfg = LossConfig(aggregation=aggregation, norm_len=norm_len, kl_coef=kl_coef, kl_kind="low_var_kl",
                         clip_low=a.clip_low, clip_high=a.clip_high)
        loss, metrics = policy_loss(lp_BT, sub.old_BT, adv_BT, m_BT, cfg, ref_logprobs_BT=ref_BT)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters() if p.grad is not None))
        grad_norms.append(norm)
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], o.grad_clip)
        opt.step()
        last = metrics
        # per-token figures, by their definitions (docs/training.md), on valid tokens only
        valid = m_BT.bool()
        lp, old, adv = lp_BT.detach()[valid], sub.old_BT[valid], adv_BT[valid]
        ratio = (lp - old).exp()
        clipped = ratio.clamp(1 - a.clip_low, 1 + a.clip_high)
        d = (ref_BT[valid] - lp).clamp(-20, 20)
        kl = (d.exp() - d - 1).clamp(-10, 10)
        per_token["pg"].append(torch.maximum(-adv * ratio, -adv * clipped))
        per_token["kl"].append(kl)
        per_token["clip"].append(((adv > 0) & (ratio > 1 + a.clip_high)) | ((adv < 0) & (ratio < 1 - a.clip_low)))
        per_token["ppo_kl"].append(old - lp)
        per_token["entropy"].append(ent_BT[valid])
        per_token["plan"].append(plan_BT[valid].bool())
        per_token["rows"].append(len(rows))
    cat = {k: torch.cat(v) for k, v in per_token.items() if k != "rows"}
    n_tokens = len(cat["pg"])
    divide = n_tokens if aggregation == "token-mean" else len(data) * norm_len
    h, plan = cat["entropy"], cat["plan"]
    return {
        "actor/pg_loss": float(cat["pg"].sum() / divide),
        "loss": float((cat["pg"] + kl_coef * cat["kl"]).sum() / divide),
        "actor/pg_clipfrac": float(cat["clip"].double().mean()),
        "actor/ppo_kl": float(cat["ppo_kl"].mean()),
        "actor/kl_ref": float(cat["kl"].mean()),
        "actor/entropy": float(h.mean()),
        "actor/grad_norm": float(np.mean(grad_norms)),
        "plan_entropy_mean": float(h[plan].mean()), "plan_entropy_var": float(h[plan].var(unbiased=False)),
        "exec_entropy_mean": float(h[~plan].mean()), "exec_entropy_var": float(h[~plan].var(unbiased=False)),
        "plan_token_fraction": float(plan.double().mean()),
    }, last, model


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-sum-norm"])
def test_two_minibatch_step_reports_the_whole_step(tmp_path, aggregation):
    torch.manual_seed(0)
    learner, data = _learner_and_data(
        tmp_path, f"algorithm.aggregation={aggregation}", "algorithm.kl_coef=0.5", "algorithm.kl_kind=low_var_kl",
        "algorithm.transform=gtpo_hicra", "algorithm.planning_detector=strategic_grams")
    expected, last, twin = _independent_step(learner, data, aggregation, norm_len=16 * 2, kl_coef=0.5)
    got = learner.step(data, temperature=1.0)
    # The twin took the same two updates: the weights agree, so the figures compare like for like.
    # (An Adam step moves a weight by about lr·sign(g): where g is ~0, summation order can flip the
    # sign, so over two steps a few weights may differ by up to 4·lr = 4e-3.)
    for p, q in zip(learner.model.parameters(), twin.parameters()):
        close(p.detach(), q.detach(), atol=4.1e-3)
    assert got["actor/num_minibatches"] == 2
    for key, value in expected.items():
        close(got[key], value, atol=1e-5, rtol=1e-4)
    # Not the last mini-batch's figures (what the step reported before issue 13).
    assert abs(last["actor/ppo_kl"] - expected["actor/ppo_kl"]) > 1e-3
    assert 0 < expected["actor/pg_clipfrac"] < 1 and 0 < expected["plan_token_fraction"] < 1
    assert got["sepa_lambda"] is None and got["sepa_gate_open"] is None  # not gtpo_sepa


def test_figures_that_do_not_apply_are_null(tmp_path):
    learner, data = _learner_and_data(tmp_path, "algorithm.updates_per_batch=1")
    got = learner.step(data[:2], temperature=1.0)
    for key in ("plan_entropy_mean", "plan_entropy_var", "plan_token_fraction", "actor/kl_ref", "sepa_lambda",
                "sepa_gate_open"):
        assert key in got and got[key] is None, key
    assert got["exec_entropy_mean"] > 0  # every token is execution without a detector
    # A detector that finds nothing: plan figures null, not 0.
    learner, data = _learner_and_data(tmp_path, "algorithm.planning_detector=strategic_grams",
                                      "algorithm.planning_grams=['xyzzy plugh']", "algorithm.transform=gtpo_sepa")
    got = learner.step(data, temperature=1.0)
    assert got["plan_entropy_mean"] is None and got["plan_token_fraction"] == 0.0
    assert got["sepa_lambda"] == 0.0 and got["sepa_gate_open"] == 1.0  # gate 0: open; steps 0: λ = 0


def test_token_logprobs_reads_the_next_token_under_the_softmax():
    from rollmarket.train import token_logprobs

    # Logits (0, ln 3): p = (1/4, 3/4). Row 0 took token 1, row 1 token 0.
    logits_BTV = torch.tensor([[[0.0, math.log(3.0)]], [[0.0, math.log(3.0)]]])
    got_BT = token_logprobs(logits_BTV, torch.tensor([[1], [0]]))
    assert torch.allclose(got_BT, torch.tensor([[math.log(0.75)], [math.log(0.25)]]))
