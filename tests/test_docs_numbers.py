"""Evidence kept with its numbers (issue 13 §5): every measured number in docs/benchmarks.md and
docs/experiments.md is written by docs/render.py from a raw result committed in the repository, and
these tests fail when a doc and its results disagree, or a result is committed that no doc uses."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def renderer():
    """docs/render.py as a fresh module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("docs_render", ROOT / "docs" / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_match_their_raw_results():
    """The check a contributor runs: exits 0 only when every generated block is what the results give."""
    done = subprocess.run([sys.executable, "docs/render.py", "--check"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_changed_number_is_caught_and_restored():
    """Edit one digit of a table by hand: the renderer writes the result's number back, so --check fails."""
    render = renderer()
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| 16 | msgpack |"))
    tampered_row = row.replace("| 16 | msgpack | ", "| 16 | msgpack | 9", 1)
    tampered = text.replace(row, tampered_row)
    assert tampered != text
    assert render.render(tampered) == text


def test_check_fails_when_a_result_changes_and_the_rewrite_follows(tmp_path, monkeypatch):
    """A copy of the repository's docs and results where one raw number moved: --check exits 1 and
    changes nothing; the plain run rewrites the doc to the new number; --check then passes."""
    import shutil

    for folder in ("docs", "benchmarks/results", "experiments/results"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    (tmp_path / "models/tiny-start").mkdir(parents=True)
    shutil.copy(ROOT / "models/tiny-start/build_report.json", tmp_path / "models/tiny-start")
    path = tmp_path / "benchmarks/results/agent_collect.json"
    data = json.loads(path.read_text())
    data["rows"][2]["runs_per_s"] = 99.5
    path.write_text(json.dumps(data))
    doc = tmp_path / "docs/benchmarks.md"
    before = doc.read_text()

    def run(*args: str) -> int:
        render = renderer()
        monkeypatch.setattr(render, "ROOT", tmp_path)
        return render.main(list(args))

    assert run("--check") == 1
    assert doc.read_text() == before
    assert run() == 0
    row = next(line for line in doc.read_text().splitlines() if line.startswith("| 32 | 96 |"))
    assert "| 99.50 |" in row
    assert run("--check") == 0


def test_a_table_number_comes_from_the_json():
    """An independent read of one raw result: the exchange's 16-worker msgpack rate, in millions."""
    results = json.loads((ROOT / "benchmarks/results/exchange_throughput.json").read_text())["results"]
    rate = next(r["tokens_per_s"] for r in results if r["workers"] == 16 and r["mode"] == "msgpack")
    row = next(line for line in (ROOT / "docs/benchmarks.md").read_text().splitlines()
               if line.startswith("| 16 | msgpack |"))
    assert f"**{rate / 1e6:.2f}M**" in row


def test_experiment_a_gain_is_recomputed_from_the_raw_per_task_evals():
    """The doc's pass@1 gain, t interval and exact p against a computation here from each run's
    evals.jsonl alone (per task: correct samples / samples, at step 0 and at the last step)."""
    from scipy import stats as sps

    gains = []
    for evals in sorted((ROOT / "experiments/results/exp-a/runs").glob("*/*/evals.jsonl")):
        rows = [json.loads(line) for line in evals.read_text().splitlines() if line.strip()]
        last = max(r["step"] for r in rows)
        mean = {step: sum(sum(r["sampled_passed"]) / len(r["sampled_passed"]) for r in rows if r["step"] == step)
                / sum(r["step"] == step for r in rows) for step in (0, last)}
        assert {len(r["sampled_passed"]) for r in rows} == {16}
        gains.append(mean[last] - mean[0])
    assert len(gains) == 8
    lo, hi = sps.ttest_1samp(gains, 0).confidence_interval(0.95)
    # Exact sign-flip p: the share of the 2^8 sign patterns whose |sum| reaches the observed one.
    sums = [abs(sum(g if (k >> i) & 1 else -g for i, g in enumerate(gains))) for k in range(256)]
    p = sum(s >= abs(sum(gains)) - 1e-12 for s in sums) / 256
    text = (ROOT / "docs/experiments.md").read_text()
    row = f"| 8 | {sum(gains) / 8:+.3f} | [{lo:+.3f}, {hi:+.3f}]".replace("-", "−")
    assert row in text and f"| {p:.4f} (" in text


def test_an_unknown_block_is_an_error():
    render = renderer()
    with pytest.raises(render.RenderError, match="no-such-block"):
        render.render("<!-- generated: no-such-block -->\nx\n<!-- /generated -->\n")


def test_every_committed_result_is_used_by_a_doc():
    """A raw result no doc renders is evidence for nothing; a doc block without a renderer fails above."""
    render = renderer()
    for doc in render.DOCS:
        render.render((ROOT / doc).read_text())
    committed = {str(p.relative_to(ROOT)) for folder in ("benchmarks/results", "experiments/results")
                 for p in (ROOT / folder).rglob("*.json")}
    assert committed - render.LOADED == set()


def test_every_result_keeps_its_machine_and_date():
    """Each generated block that names a raw result also names the machine and the date it ran."""
    for doc in ("docs/benchmarks.md", "docs/experiments.md"):
        blocks = re.findall(r"<!-- generated: [a-z0-9-]+ -->\n(.*?)<!-- /generated -->", (ROOT / doc).read_text(), re.S)
        named = [b for b in blocks if re.search(r"(?i)raw results?:? `", b)]
        assert named, doc
        for text in named:
            assert re.search(r"Machine: \S", text) and re.search(r"Date: 2\d{3}-\d\d-\d\d", text), text


# -- issue 14: experiments (a) with its shuffled-reward control, and (c) --------------------------
# Small campaign directories written here with hand-chosen per-task passes (2 held-out tasks × 16
# samples, so a run's pass@1 is correct samples / 32); the blocks must show what an independent
# computation (scipy's t interval, the 2^n sign flips enumerated here) gives for them.


def _write_campaign(root: Path, name: str, stats: dict, runs: dict, gate: dict | None = None,
                    ess: dict | None = None) -> None:
    """runs: {(condition, seed): (correct before, correct after, minutes, quarantined groups)} out of
    32 samples; each run has 2 steps of 4 groups, the last with the final evaluation. ess:
    {(condition, seed): (token ESS at step 1, at step 2)} (default 0.99, 0.97)."""
    conditions = list(dict.fromkeys(c for c, _ in runs))
    entries = []
    for (condition, seed), (before, after, minutes, quarantined) in runs.items():
        rel = f"runs/{condition}__s{seed}/20261126T1900{seed:02d}Z-{condition[:6]}"
        run = root / rel
        run.mkdir(parents=True)
        cfg = {"eval": {"samples": 16}, "labels": {"condition": condition, "seed": seed},
               "gate": (gate or {}).get(condition, {"min_ess": 0.3, "max_policy_lag": 8})}
        (run / "config.json").write_text(json.dumps({"config": cfg}))
        label = {"condition": condition, "seed": seed}
        ess1, ess2 = (ess or {}).get((condition, seed), (0.99, 0.97))
        rows = [{"step": 0, "eval/pass@1": before / 32, **label},
                {"step": 1, "num_groups": 4, "gate/train": 4 - quarantined, "gate/train_with_correction": 0,
                 "gate/replay": 0, "gate/quarantine": quarantined, "mismatch/token_ess_mean": ess1,
                 "policy_lag/mean": 1.0, **label},
                {"step": 2, "num_groups": 4, "gate/train": 4 - quarantined, "gate/train_with_correction": 0,
                 "gate/replay": 0, "gate/quarantine": quarantined, "mismatch/token_ess_mean": ess2,
                 "policy_lag/mean": 2.0, "eval/pass@1": after / 32, **label}]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        evals = []
        for step, correct in ((0, before), (2, after)):
            first = min(correct, 16)  # task 0 gets the first 16 correct samples, task 1 the rest
            for task, k in (("t0", first), ("t1", correct - first)):
                evals.append({"step": step, "task_id": task, "greedy_passed": k > 8,
                              "sampled_passed": [i < k for i in range(16)]})
        (run / "evals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
        (run / "summary.json").write_text(json.dumps({"minutes": minutes, "steps": 2, **label}))
        entries.append({"condition": condition, "seed": seed, "dir": rel, "status": "done"})
    (root / "campaign.json").write_text(json.dumps({
        "name": name, "conditions": [{"name": c, "overrides": {}} for c in conditions], "seeds": [],
        "seed_mode": "all", "stats": stats, "runs": entries}))
    (root / "manifest.json").write_text(json.dumps({"source": "a test's campaign", "machine": "the test",
                                                    "date": "2026-11-26", "code": "git test"}))


def _exact_p(d: list[float]) -> float:
    sums = [abs(sum(x if (k >> i) & 1 else -x for i, x in enumerate(d))) for k in range(2 ** len(d))]
    return sum(s >= abs(sum(d)) - 1e-12 for s in sums) / 2 ** len(d)


def _interval(d: list[float]) -> str:
    from scipy import stats as sps

    lo, hi = sps.ttest_1samp(d, 0).confidence_interval(0.95)
    return f"[{lo:+.3f}, {hi:+.3f}]".replace("-", "−")


def test_experiment_a2_blocks_give_each_conditions_gain_and_grpo_against_the_control(tmp_path, monkeypatch):
    render = renderer()
    monkeypatch.setattr(render, "ROOT", tmp_path)
    assert "Not run yet" in render.BLOCKS["exp-a2-provenance"]() and render.BLOCKS["exp-a2-gains"]() == ""
    grpo_after = [16, 18, 15, 17, 20, 16, 19, 18]     # from 8/32 before, every seed
    shuffled_after = [8, 9, 7, 8, 8, 7, 9, 8]
    runs = {("grpo", s): (8, a, 6.0, 0) for s, a in enumerate(grpo_after)}
    runs |= {("shuffled", s): (8, a, 6.5, 0) for s, a in enumerate(shuffled_after)}
    _write_campaign(tmp_path / "experiments/results/exp-a2", "exp-a2",
                    {"metrics": ["eval/pass@1@final"], "baseline": "shuffled", "equivalence_margin": 0.05}, runs)
    render.exp_a2.cache_clear()  # it was read above, before the campaign existed

    gains = render.BLOCKS["exp-a2-gains"]()
    grpo = [(a - 8) / 32 for a in grpo_after]
    shuffled = [(a - 8) / 32 for a in shuffled_after]
    versus = [(g - s) / 32 for g, s in zip(grpo_after, shuffled_after)]
    # grpo: all 8 gains positive, so p = 2/256; mean 75/256 = 0.293.
    assert _exact_p(grpo) == 2 / 256
    assert (f"| grpo: after vs before | `eval/pass@1@final` | 8 | +0.293 | {_interval(grpo)} |" in gains
            and "| 0.0078 (0.0078) |" in gains and "**CONFIRMED**" in gains)
    # The control: gains 0, ±1/32 summing to 0 (p = 1); its 90% t interval ±0.016 lies inside ±0.05.
    row = next(line for line in gains.splitlines() if line.startswith("| shuffled: after vs before"))
    assert f"| 8 | +0.000 | {_interval(shuffled)} |" in row and "| 1.0000 (1.0000) |" in row
    assert row.endswith("| **EQUIVALENT** |")
    row = next(line for line in gains.splitlines() if line.startswith("| grpo vs shuffled"))
    assert f"| {sum(versus) / 8:+.3f} | {_interval(versus)} |" in row and "**CONFIRMED**" in row
    seeds = render.BLOCKS["exp-a2-seeds"]()
    assert "| 4 | 0.250 → 0.625 (+0.375) | 0.250 → 0.250 (+0.000) |" in seeds
    prose = render.BLOCKS["exp-a2-prose"]()
    # The goal: the grpo interval's lower end (0.249 by hand: 9.375/32 − 2.365·0.0527/√8) ≥ 0.20.
    assert "rose in 8 of 8 seeds" in prose and "the goal is met" in prose
    assert "The shuffled-reward control shows no gain (equivalent to no change within the margin)." in prose
    assert "Runs took 6.0–6.5 min each" in prose
    assert "Machine: the test. Date: 2026-11-26." in render.BLOCKS["exp-a2-provenance"]()


def test_experiment_c_blocks_compare_each_threshold_setting_with_the_reference(tmp_path, monkeypatch):
    render = renderer()
    monkeypatch.setattr(render, "ROOT", tmp_path)
    # default trains (8 → 14..16 of 32); open is the same; strict quarantines 3 of 4 groups a step and
    # gains less (8 → 9..11): worse than the defaults in all 6 seeds.
    default_after, strict_after = [14, 15, 16, 14, 15, 16], [9, 10, 11, 9, 10, 10]
    runs = {("default", s): (8, a, 5.0 + s / 10, 0) for s, a in enumerate(default_after)}
    runs |= {("open", s): (8, a, 5.0 + s / 10, 0) for s, a in enumerate(default_after)}
    runs |= {("strict", s): (8, a, 4.0 + s / 10, 3) for s, a in enumerate(strict_after)}
    gate = {"default": {"min_ess": 0.3, "max_policy_lag": 8}, "open": {"min_ess": 0.0, "max_policy_lag": 1000},
            "strict": {"min_ess": 0.9, "max_policy_lag": 1}}
    _write_campaign(tmp_path / "experiments/results/exp-c", "exp-c",
                    {"metrics": ["eval/pass@1@final"], "baseline": "default", "equivalence_margin": 0.05}, runs, gate)

    table = render.BLOCKS["exp-c-pass"]().splitlines()
    strict = next(line for line in table if line.startswith("| strict |"))
    d = [(s - a) / 32 for s, a in zip(strict_after, default_after)]
    assert _exact_p(d) == 2 / 64  # every seed worse
    finals = [a / 32 for a in strict_after]
    assert f"| 0.9 | 1 | {sum(finals) / 6:.3f} {_interval(finals).replace('+', '')} |" in strict
    assert f"| {sum(d) / 6:+.3f} {_interval(d)} |".replace("-", "−") in strict
    # Holm across the 2 settings compared: open's p is 1 (no difference), strict's 2/64 → 2 · 2/64.
    assert "| 0.0312 (0.0625) |" in strict and strict.endswith("| **REFUTED** |")
    open_ = next(line for line in table if line.startswith("| open |"))
    assert "| 0.0 | 1000 |" in open_ and "**EQUIVALENT**" in open_ and "| **default** |" in table[2]
    gate_table = render.BLOCKS["exp-c-gate"]()
    strict_gate = next(line for line in gate_table.splitlines() if line.startswith("| strict |"))
    # 1 of 4 groups trained and 3 quarantined every step; 0.75 more quarantined than default;
    # minutes 4.0..4.5 vs 5.0..5.5: one minute less in every seed.
    # Token ESS 0.99 and 0.97 at the two steps: 0.980; lag 1 and 2: 1.50.
    assert strict_gate.startswith("| strict | 0.25 [0.25, 0.25] | 0.00 [0.00, 0.00] | 0.00 [0.00, 0.00] | "
                                  "0.75 [0.75, 0.75] | 0.980 [0.980, 0.980] | 1.50 [1.50, 1.50] | "
                                  "+0.75 [+0.75, +0.75] | 4.2 [")
    assert strict_gate.endswith("| −1.0 [−1.0, −1.0] |")
    prose = render.BLOCKS["exp-c-prose"]()
    assert "- **strict**: trains (CONFIRMED" in prose and "worse than default" in prose
    assert "- **open**: trains" in prose and "equivalent to default within ±0.05" in prose
    assert "not significant after Holm across the 2 settings" in prose
    assert "still converge: open; worse: strict; not decided by these seeds: none." in prose


# -- issue 17: experiment (d), router replay per rollout precision ---------------------------------


def test_experiment_r3_blocks_say_not_run_yet_without_results(tmp_path, monkeypatch):
    """Before the gradient result and the campaign are committed: each part says so and quotes no number."""
    render = renderer()
    monkeypatch.setattr(render, "ROOT", tmp_path)
    assert render.BLOCKS["exp-r3-gradients-provenance"]().startswith("Not run yet")
    assert render.BLOCKS["exp-r3-provenance"]().startswith("Not run yet")
    assert "experiments/results/exp-r3/campaign/" in render.BLOCKS["exp-r3-provenance"]()
    for name in ("gradients-offpolicy", "gradients-step", "gradients-tests", "gradients-verdict", "gradients-models", "pass",
                 "offpolicy", "ess-steps", "prose"):
        assert render.BLOCKS[f"exp-r3-{name}"]() == "", name


def test_experiment_r3_campaign_blocks_compare_replay_with_none_at_each_precision(tmp_path, monkeypatch):
    """fp8 and fp8-r3 over 8 seeds: final pass@1 the same but in two seeds (+1, −1 of 32: EQUIVALENT
    within ±0.05), token ESS higher with replay in every seed (CONFIRMED after Holm over 2 metrics)."""
    render = renderer()
    monkeypatch.setattr(render, "ROOT", tmp_path)
    after = [14, 15, 16, 14, 15, 16, 14, 15]
    replay_after = [14, 15, 16, 15, 15, 16, 14, 14]
    runs = {("fp8", s): (8, a, 3.0, 0) for s, a in enumerate(after)}
    runs |= {("fp8-r3", s): (8, a, 3.1, 0) for s, a in enumerate(replay_after)}
    ess = {("fp8-r3", s): (0.995 + s * 0.0005, 0.985) for s in range(8)}  # fp8: the default 0.99, 0.97
    _write_campaign(tmp_path / "experiments/results/exp-r3/campaign", "exp-r3",
                    {"metrics": ["eval/pass@1@final", "mismatch/token_ess_mean@auc"], "baseline": "fp8",
                     "equivalence_margin": {"eval/pass@1@final": 0.05}}, runs, ess=ess)

    assert "Machine: the test. Date: 2026-11-26." in render.BLOCKS["exp-r3-provenance"]()
    row = next(line for line in render.BLOCKS["exp-r3-pass"]().splitlines() if line.startswith("| fp8 |"))
    d = [(b - a) / 32 for a, b in zip(after, replay_after)]
    assert sum(d) == 0 and _exact_p(d) == 1.0
    finals = [a / 32 for a in replay_after]
    assert f"| {sum(finals) / 8:.3f} {_interval(finals).replace('+', '')} |" in row
    assert f"| +0.000 {_interval(d)} |" in row and "| 1.0000 (1.0000) |" in row
    assert row.endswith("| **EQUIVALENT** |")
    # Token ESS, area over steps 1..2 = the two steps' mean: Δ = (0.005 + 0.0005 s + 0.015) / 2 per seed.
    ess_d = [(0.005 + 0.0005 * s + 0.015) / 2 for s in range(8)]
    assert _exact_p(ess_d) == 2 / 256  # Holm over the 2 metrics: 2 · 2/256 = 0.0156 < 0.05
    offpolicy = render.BLOCKS["exp-r3-offpolicy"]().splitlines()
    replay_row = next(line for line in offpolicy if line.startswith("| fp8 | **yes** |"))
    lo, hi = _ci_raw(ess_d)
    assert f"| {sum(ess_d) / 8:+.6f} [{lo:+.6f}, {hi:+.6f}]; CONFIRMED (p 0.0156, Holm) |" in replay_row
    none_row = next(line for line in offpolicy if line.startswith("| fp8 | no |"))
    assert none_row.startswith("| fp8 | no | 0.980000 [0.980000, 0.980000] | – |")  # no rollout_is figure here
    steps = render.BLOCKS["exp-r3-ess-steps"]().splitlines()
    assert steps[0] == "| step | fp8 | fp8-r3 |"
    assert steps[2] == f"| 1 | 0.990000 | {0.995 + 0.0005 * 3.5:.6f} |" and steps[3] == "| 2 | 0.970000 | 0.985000 |"
    prose = render.BLOCKS["exp-r3-prose"]()
    assert "- **fp8**: replay does not change what training reaches (EQUIVALENT" in prose
    assert "it raises the token ESS the gate sees" in prose


def _ci_raw(d: list[float]) -> tuple[float, float]:
    from scipy import stats as sps

    return tuple(sps.ttest_1samp(d, 0).confidence_interval(0.95))


def _gradients_result(rel: dict, floor: list[float]) -> dict:
    """A gradients.json as exp_r3_gradients.py writes it, with the given per-replicate relative L2s
    ({(precision, 'off' | 'on'): [...]}) and the fp32 noise floor's."""
    def pairs(values):
        return [{"cosine": 1 - v**2 / 2, "relative_l2": v} for v in values]

    n = len(floor)
    precisions = {}
    for p in ("fp16", "bf16", "fp8"):
        precisions[p] = {
            "vs_fp32": {c: pairs(rel[p, c]) for c in ("off", "on")}, "on_vs_off": pairs([0.01] * n),
            "routing_alone": pairs([0.001] * n),
            "mismatch": {c: [{"mean_abs_delta": 0.004, "token_ess": 0.9995 if c == "off" else 0.9996,
                              "rollout_is_ess": 0.9995} for _ in range(n)] for c in ("off", "on")},
            "routing": {"off": [{"top1": 0.01, "topk_set": 0.008}] * n, "on": [{"top1": 0.0, "topk_set": 0.0}] * n}}
    return {"declared": {"margin_relative_l2": 0.1, "margin_cosine": 0.995, "alpha": 0.05},
            "settings": {"model": "models/tiny-start", "suite": "arithmetic", "replicates": n, "groups": 8,
                         "group_size": 8, "temperature": 1.0, "cap": 2.0, "threads": 1},
            "machine": {"platform": "the test", "cpus": 2}, "code": {"git_commit": "test"}, "date": "2026-11-27T03:00Z",
            "datums": [50] * n, "control_own_replay": {"per_replicate": pairs([0.0] * n)},
            "floor": {"fp32, no replay": pairs(floor)}, "precisions": precisions, "wall_s": 600.0}


def test_experiment_r3_gradient_blocks_recompute_the_declared_tests(tmp_path, monkeypatch):
    """fp8 with replay is closer to the fp32-rollout step in all 6 replicates (exact p = 2/64) and
    inside the 0.10 margin; without replay it straddles the margin (not shown equivalent)."""
    render = renderer()
    monkeypatch.setattr(render, "ROOT", tmp_path)
    off = [0.09, 0.12, 0.08, 0.11, 0.10, 0.13]
    on = [0.03, 0.05, 0.04, 0.02, 0.05, 0.04]
    rel = {(p, c): (off if c == "off" else on) if p == "fp8" else [0.04, 0.05, 0.03, 0.05, 0.04, 0.05]
           for p in ("fp16", "bf16", "fp8") for c in ("off", "on")}
    path = tmp_path / "experiments/results/exp-r3/gradients.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(_gradients_result(rel, [0.5, 0.55, 0.52, 0.48, 0.5, 0.51])))

    from scipy import stats as sps

    tests = render.BLOCKS["exp-r3-gradients-tests"]().splitlines()
    fp8_off = next(line for line in tests if line.startswith("| fp8 | no |"))
    fp8_on = next(line for line in tests if line.startswith("| fp8 | yes |"))
    # TOST of mean < 0.10 by hand: the upper one-sided t-test's p (the lower one is far smaller).
    for values, line, verdict in ((off, fp8_off, "not shown equivalent"), (on, fp8_on, "**EQUIVALENT**")):
        mean, se = sum(values) / 6, sps.sem(values)
        p = sps.t.cdf((mean - 0.1) / se, 5)
        lo, hi = sps.t.interval(0.90, 5, loc=mean, scale=se)
        assert f"| [{lo:.4f}, {hi:.4f}] | {p:.2g} | {verdict} |" in line, line
    d = [a - b for a, b in zip(on, off)]
    assert _exact_p(d) == 2 / 64
    assert f"| {_interval_4(d)} | 0.0312 |" in fp8_on
    verdict = render.BLOCKS["exp-r3-gradients-verdict"]()
    assert "- **fp8**: without replay 1.00% of the (policy token, layer) top-1 experts flip" in verdict
    assert "closer to it by the paired test (exact p = 0.0312)" in verdict
    assert "the noise floor is 0.51" in verdict and "not shown without replay, yes with." in verdict
    provenance = render.BLOCKS["exp-r3-gradients-provenance"]()
    assert "Machine: the test, 2 CPUs. Date: 2026-11-27T03:00Z." in provenance and "6 replicates × 8 tasks" in provenance
    # Across models: only tiny-start's result exists; tiny-moe's is named as not run yet.
    models = render.BLOCKS["exp-r3-gradients-models"]()
    fp8 = next(line for line in models.splitlines() if line.startswith("| `models/tiny-start` (T = 1.0, 8 × 8) | fp8 |"))
    assert fp8.startswith("| `models/tiny-start` (T = 1.0, 8 × 8) | fp8 | 0.0100 | 0.999500 → 0.999600 | "
                          f"{sum(off) / 6:.3f} | {sum(on) / 6:.3f} | {_interval_4(d)}, p 0.0312 | no / yes | 0.51 |")
    assert "`experiments/results/exp-r3/gradients-tiny-moe.json` is not committed (not run yet)" in models


def _interval_4(d: list[float]) -> str:
    lo, hi = _ci_raw(d)
    return f"{sum(d) / len(d):+.4f} [{lo:+.4f}, {hi:+.4f}]".replace("-", "−")


def test_learner_step_block_says_not_measured_then_renders_the_json(tmp_path, monkeypatch):
    """Without benchmarks/results/learner_step-cuda.json the block quotes no number; with one, its rows
    and ratios (written here, not by the benchmark) appear as the JSON gives them."""
    render = renderer()
    monkeypatch.setattr(render, "ROOT", tmp_path)
    assert render.BLOCKS["learner-step-cuda"]().startswith("Not measured yet")
    common = dict(shape="qwen3-1.7b", precision="bf16", batch=8, seq=2048, loss_tokens=14336, checkpointing=True)
    results = [dict(method="fsdp-1", error="Traceback ...\nout of memory: CUDA out of memory"),
               dict(common, method="naive", world_size=1, chunk=None, seconds=2.0, steps_per_s=0.5,
                    peak_extra_bytes=40 * 2**30),
               dict(common, method="chunked", world_size=1, chunk=2048, seconds=1.6, steps_per_s=0.625,
                    peak_extra_bytes=4 * 2**30, peak_extra_ratio_vs_naive=0.1, head_peak_extra_bytes=2**30,
                    head_peak_ratio_vs_naive=0.04),
               dict(common, method="fsdp-2", world_size=2, chunk=2048, seconds=0.9, steps_per_s=1.111,
                    peak_extra_bytes=3 * 2**30, step_rate_vs_fsdp_1=1.85, step_rate_vs_chunked=1.78),
               dict(common, method="fsdp-2@kept-prefetch", layout="kept-prefetch", world_size=2, chunk=2048,
                    seconds=0.85, steps_per_s=1.176, peak_extra_bytes=6 * 2**30, held_bytes=3 * 2**30,
                    step_rate_vs_fsdp_1=1.93, step_rate_vs_chunked=1.88),
]
    path = tmp_path / "benchmarks/results/learner_step-cuda.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"meta": {"machine": "h100-box", "date": "2026-11-27", "gpu": "NVIDIA H100"},
                                "results": results}))
    text = render.BLOCKS["learner-step-cuda"]()
    assert "`benchmarks/results/learner_step-cuda.json`" in text and "NVIDIA H100" in text and "2026-11-27" in text
    assert "| chunked | 1 | 2048 | 1.600 | 0.62 | 4.00 | 0.100× | – | 1.00 | 0.040× | – | – |" in text
    assert "| fsdp-2 | 2 | 2048 | 0.900 | 1.11 | 3.00 | – | – | – | – | 1.85× | 1.78× |" in text
    assert "| **naive** | 1 | – | 2.000 | 0.50 | 40.00 | – | – | – | – | – | – |" in text
    # The learner's layout is the row the verdict reads, bold in the table.
    assert "| **fsdp-2@kept-prefetch** | 2 | 2048 | 0.850 | 1.18 | 6.00 | – | 3.00 | – | – | 1.93× | 1.88× |" in text
    assert "(`kept-prefetch`), steps at 1.88× one GPU's rate (goal ≥ 1.8×): met" in text
    assert "error: out of memory" in text and "14,336 in the loss" in text
