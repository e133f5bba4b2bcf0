"""`rollmarket stats` / `compare` (research/stats.py): every formula against a hand computation or an
independent one (full enumeration written here, scipy, published power tables, simulation), the
verdict rules, and the CLI on campaign directories written by hand in the shared layout."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from scipy import stats as sps

from rollmarket.cli.main import main
from rollmarket.research import stats as st
from rollmarket.research.stats import Metric, StatsSettings


# --------------------------------------------------------------------------------------------
# Fixtures: run and campaign directories in the layout `rollmarket train` / `campaign` write


def write_run(root: Path, condition: str, seed: int, correct_T: list[int], *, samples: int = 16, steps=(0, 20),
              start_correct_T: list[int] | None = None, extra: dict | None = None) -> Path:
    """A run directory: eval rows at `steps`; at the last step task t has correct_T[t] of `samples`
    sampled runs correct (at earlier steps start_correct_T, default all wrong). Metrics rows carry
    eval/pass@1 = the mean over tasks of c/samples, plus condition and seed, as a campaign run's do."""
    run = root / "runs" / f"{condition}__s{seed}" / f"20261126T000000Z-{seed:06x}"
    run.mkdir(parents=True)
    start = start_correct_T or [0] * len(correct_T)
    metrics, evals = [], []
    for step in steps:
        counts = correct_T if step == steps[-1] else start
        for t, c in enumerate(counts):
            evals.append({"step": step, "task_id": f"task-{t}", "greedy_passed": c > samples // 2,
                          "sampled_passed": [i < c for i in range(samples)],
                          "sampled_rewards": [float(i < c) for i in range(samples)]})
        row = {"step": step, "condition": condition, "seed": seed,
               "eval/pass@1": sum(c / samples for c in counts) / len(counts),
               "eval/accuracy/mean": sum(c > samples // 2 for c in counts) / len(counts)}
        row.update((extra or {}).get(step, {}))
        metrics.append(row)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    (run / "evals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    (run / "config.json").write_text(json.dumps({"config": {"seed": seed, "eval": {"samples": samples}}}))
    return run


def write_campaign(root: Path, runs: dict[tuple[str, int], Path], conditions: list[str], stats: dict) -> Path:
    seeds = sorted({seed for _, seed in runs})
    manifest = {"name": "fixture", "file": "", "seed_mode": "all", "seeds": seeds, "stats": stats,
                "conditions": [{"name": c, "overrides": {}} for c in conditions],
                "runs": [{"condition": c, "seed": s, "dir": str(p.relative_to(root))} for (c, s), p in runs.items()]}
    (root / "campaign.json").write_text(json.dumps(manifest))
    return root


def campaign(tmp_path: Path, seeds, base_T, cand_T, *, samples=16, stats=None, conditions=("grpo", "maxrl")):
    """Baseline condition with per-seed per-task correct counts base_T[seed], candidate cand_T[seed]."""
    runs = {}
    for i, seed in enumerate(seeds):
        runs[(conditions[0], seed)] = write_run(tmp_path, conditions[0], seed, base_T[i], samples=samples)
        runs[(conditions[1], seed)] = write_run(tmp_path, conditions[1], seed, cand_T[i], samples=samples)
    return write_campaign(tmp_path, runs, list(conditions), {"baseline": conditions[0]} | (stats or {}))


def counts(rng, seeds, tasks, lift):
    base = rng.integers(2, 10, size=(seeds, tasks))
    return base.tolist(), np.clip(base + lift, 0, 16).tolist()


# --------------------------------------------------------------------------------------------
# The formulas


def test_sign_flip_p_by_hand_and_by_full_enumeration():
    # d = (0.3, -0.1, 0.2): Σd = 0.4; the 8 signed sums are ±0.6, ±0.4, ±0.2, 0, 0, so 4 of 8 reach 0.4.
    assert st.sign_flip_test([0.3, -0.1, 0.2]).p == pytest.approx(0.5)
    three = st.sign_flip_test([0.1, 0.2, 0.3])
    assert three.p == pytest.approx(2 / 8) and three.floor == pytest.approx(0.25) and three.exact
    assert st.sign_flip_test([0.01] * 6).p == pytest.approx(2 / 64)
    rng = np.random.default_rng(3)
    for n in (5, 9, 12):
        d = rng.normal(0.3, 1.0, n).round(3)
        hits = sum(abs(sum(s * x for s, x in zip(signs, d))) >= abs(sum(d)) - 1e-12
                   for signs in itertools.product((1, -1), repeat=n))
        assert st.sign_flip_test(d).p == pytest.approx(hits / 2**n), n
    # beyond exact_max: Monte Carlo, (1 + hits) / (1 + draws), close to the exact value
    d = rng.normal(0.4, 1.0, 10)
    mc = st.sign_flip_test(d, exact_max=4, draws=40_000, seed=1)
    assert not mc.exact and mc.flips == 40_000
    assert mc.p == pytest.approx(st.sign_flip_test(d).p, abs=0.01)


def test_t_interval_and_cohens_dz_by_hand_and_against_scipy():
    lo, hi = st.t_interval([1.0, 2.0, 3.0], 0.95)   # mean 2, sd 1, t_{.975,2} = 4.302653
    assert (lo, hi) == (pytest.approx(2 - 4.302653 / math.sqrt(3), abs=1e-6),
                        pytest.approx(2 + 4.302653 / math.sqrt(3), abs=1e-6))
    d = [0.031, 0.052, -0.012, 0.044, 0.018, 0.061, 0.009]
    ci = sps.ttest_1samp(d, 0.0).confidence_interval(0.9)
    assert st.t_interval(d, 0.9) == (pytest.approx(ci.low), pytest.approx(ci.high))
    assert st.t_test_p(d) == pytest.approx(sps.ttest_1samp(d, 0.0).pvalue)
    dz, dz_lo, dz_hi = st.cohens_dz(d, 0.95)
    assert dz == pytest.approx(statistics.mean(d) / statistics.stdev(d))
    # the bounds are the effects whose noncentral t puts the observed t at the 97.5% / 2.5% point
    n, t_obs = len(d), dz * math.sqrt(len(d))
    assert sps.nct.cdf(t_obs, n - 1, dz_lo * math.sqrt(n)) == pytest.approx(0.975, abs=1e-6)
    assert sps.nct.cdf(t_obs, n - 1, dz_hi * math.sqrt(n)) == pytest.approx(0.025, abs=1e-6)
    # large n: close to the normal approximation d ± 1.96·sqrt(1/n + d²/2n)
    big = np.random.default_rng(0).normal(0.5, 1.0, 400)
    dz, dz_lo, dz_hi = st.cohens_dz(big)
    half = 1.96 * math.sqrt(1 / 400 + dz**2 / 800)
    assert dz_lo == pytest.approx(dz - half, abs=0.01) and dz_hi == pytest.approx(dz + half, abs=0.01)
    assert st.cohens_dz([0.2, 0.2, 0.2]) == (None, None, None)   # sd 0: no d_z


def test_tost_by_hand():
    d = [0.01, 0.03, -0.02, 0.02]
    mean, se = 0.01, statistics.stdev(d) / 2                     # n = 4
    eq = st.tost(d, 0.05, alpha=0.05)
    assert eq.p_lower == pytest.approx(sps.t.sf((mean + 0.05) / se, 3))
    assert eq.p_upper == pytest.approx(sps.t.cdf((mean - 0.05) / se, 3))
    assert eq.p == max(eq.p_lower, eq.p_upper)
    # equivalent at alpha exactly when the (1 - 2 alpha) interval lies inside ±margin
    half = sps.t.ppf(0.95, 3) * se
    assert eq.interval == (pytest.approx(mean - half), pytest.approx(mean + half))
    for margin in (0.02, 0.04, 0.05, 0.1):
        assert (st.tost(d, margin).p < 0.05) == (mean - half > -margin and mean + half < margin), margin


def test_holm_on_a_known_example():
    # sorted .005 .01 .03 .04 → ×4 ×3 ×2 ×1 = .02 .03 .06 .04 → running max .02 .03 .06 .06
    assert st.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert st.holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])     # .5×2 = 1, then the running max


def test_power_and_seeds_needed_match_published_tables_and_simulation():
    # G*Power, paired t, two-tailed, alpha .05, power .8: d_z 0.5 → 34 pairs (power .8078), 0.8 → 15
    assert st.seeds_needed(0.5) == 34 and st.paired_power(0.5, 34) == pytest.approx(0.8078, abs=1e-4)
    assert st.seeds_needed(0.8) == 15 and st.paired_power(0.8, 14) < 0.8
    assert st.paired_power(0.0, 10) == pytest.approx(0.05)
    mde = st.minimum_detectable_dz(8)
    assert st.paired_power(mde, 8) == pytest.approx(0.8, abs=1e-6)
    # simulation: 20000 experiments of 10 normal differences with d_z = 0.8, tested by scipy
    sims = np.random.default_rng(7).normal(0.8, 1.0, size=(20_000, 10))
    rejected = (sps.ttest_1samp(sims, 0.0, axis=1).pvalue < 0.05).mean()
    assert st.paired_power(0.8, 10) == pytest.approx(rejected, abs=0.015)
    assert st.seeds_for_exact_test(0.05) == 6 and st.seeds_for_exact_test(0.05, tests=2) == 7   # 2/2^n·m < α


def test_two_way_bootstrap_adds_seed_and_task_variance():
    # D[s, t] = a_s + b_t: the resampled mean is mean(a*) + mean(b*), whose bootstrap variance is
    # popvar(a)/S + popvar(b)/T; the 95% interval's half width is about 1.96 of its root.
    rng = np.random.default_rng(2)
    a, b = rng.normal(0, 0.05, 12), rng.normal(0, 0.2, 60)
    mean, lo, hi = st.two_way_bootstrap(a[:, None] + b[None, :], resamples=8000, confidence=0.95, seed=0)
    se = math.sqrt(a.var() / 12 + b.var() / 60)
    assert mean == pytest.approx(a.mean() + b.mean())
    assert (hi - lo) / 2 == pytest.approx(1.96 * se, rel=0.08)


def test_metric_values_final_step_and_auc(tmp_path):
    extra = {0: {"loss": 0.2}, 10: {"loss": 0.4}, 30: {"loss": 0.8}}
    run = st.load_run(write_run(tmp_path, "a", 1, [4, 8], steps=(0, 10, 30), extra=extra))
    assert st.metric_value(run, Metric.parse("loss@auc")).value == pytest.approx((10 * 0.3 + 20 * 0.6) / 30)
    assert st.metric_value(run, Metric.parse("loss@10")).value == 0.4
    final = st.metric_value(run, Metric.parse("eval/pass@1@final"))
    assert final.value == pytest.approx((4 + 8) / 32) and final.step == 30
    assert Metric.parse("loss@final:lower") == Metric("loss", "final", higher_is_better=False)
    assert Metric.parse("eval/pass@4@120").pass_at_k == 4
    per_task = st.per_task_values(run, Metric.parse("eval/pass@4@final"), 30)
    assert per_task["task-0"] == pytest.approx(1 - math.comb(12, 4) / math.comb(16, 4))


# --------------------------------------------------------------------------------------------
# Verdicts


def report(path, **kw):
    return st.campaign_report(st.load_campaign(path), **kw).comparisons[0].metrics


def test_three_seeds_are_inconclusive_however_large_the_effect(tmp_path):
    base, cand = counts(np.random.default_rng(0), 3, 8, 6)
    [m] = report(campaign(tmp_path, [1, 2, 3], base, cand))
    assert m.mean_difference == pytest.approx(6 / 16) and m.sign_flip["p"] == pytest.approx(0.25)
    assert m.verdict == "INCONCLUSIVE" and "2/2^3 = 0.25" in m.reason and "≥ 6 seeds" in m.reason


def test_confirmed_refuted_and_evidence(tmp_path):
    base, cand = counts(np.random.default_rng(1), 8, 10, 2)
    cand[3][0] -= 2          # one seed gains less: differences not all equal
    [m] = report(campaign(tmp_path / "up", range(1, 9), base, cand))
    d = (np.array(cand) - np.array(base)).mean(axis=1) / 16
    assert m.differences == pytest.approx(d.tolist()) and m.sign_flip["p"] == pytest.approx(2 / 256)
    assert m.verdict == "CONFIRMED" and m.samples_per_task == 16
    assert m.evidence["n_seeds"] == 8 and m.evidence["p"] == pytest.approx(2 / 256)
    assert m.evidence["interval"] == pytest.approx(list(sps.ttest_1samp(d, 0).confidence_interval(0.95)))
    assert m.two_way_bootstrap["tasks"] == 10 and m.two_way_bootstrap["mean"] == pytest.approx(d.mean())
    [m] = report(campaign(tmp_path / "down", range(1, 9), cand, base))
    assert m.verdict == "REFUTED" and "worse" in m.reason
    # lower is better: the same drop now confirms
    [m] = report(campaign(tmp_path / "low", range(1, 9), cand, base), metrics=["eval/pass@1@final:lower"])
    assert m.verdict == "CONFIRMED"


def test_equivalent_needs_a_margin_and_16_samples(tmp_path):
    rng = np.random.default_rng(4)
    base = rng.integers(4, 12, size=(8, 12))
    cand = base.copy()
    for s in range(8):     # ± one sample on one task: tiny differences of both signs
        cand[s, s] += 1 if s % 2 else -1
    [m] = report(campaign(tmp_path / "eq", range(8), base.tolist(), cand.tolist(),
                          stats={"equivalence_margin": 0.02}))
    assert m.verdict == "EQUIVALENT" and m.equivalence["p"] < 0.05 and "TOST" in m.reason
    [m] = report(campaign(tmp_path / "nomargin", range(8), base.tolist(), cand.tolist()))
    assert m.verdict == "INCONCLUSIVE" and "no equivalence_margin" in m.reason
    four = (base // 4).tolist(), (cand // 4 + 1).tolist()
    [m] = report(campaign(tmp_path / "few", range(8), *four, samples=4))
    assert m.samples_per_task == 4 and m.verdict == "INCONCLUSIVE" and "eval.samples = 16" in m.reason


def test_holm_across_metrics_and_unfinished_runs(tmp_path):
    base, cand = counts(np.random.default_rng(5), 6, 6, 3)
    path = campaign(tmp_path, range(6), base, cand)
    [m] = report(path)                        # one metric: 2/64 < 0.05
    assert m.verdict == "CONFIRMED"
    metrics = report(path, metrics=["eval/pass@1@final", "eval/accuracy/mean@final"])
    assert all(m.verdict == "INCONCLUSIVE" and "×2 under Holm" in m.reason for m in metrics)
    # a run that stopped early is read at another step: no verdict on it
    short = write_run(tmp_path / "x", "maxrl", 9, cand[0], steps=(0, 10))
    runs = [st.load_run(p) for p in sorted((tmp_path / "runs").glob("*/*"))]
    base_runs = [r for r in runs if r.condition == "grpo"] + [st.load_run(write_run(tmp_path / "y", "grpo", 9, base[0]))]
    cand_runs = [r for r in runs if r.condition == "maxrl"] + [st.load_run(short)]
    [m] = st.compare(base_runs, cand_runs, [Metric.parse(st.DEFAULT_METRIC)]).metrics
    assert m.verdict == "INCONCLUSIVE" and "different steps" in m.reason


def test_bad_input_raises_typed_errors(tmp_path):
    base, cand = counts(np.random.default_rng(6), 4, 4, 2)
    path = campaign(tmp_path, range(4), base, cand)
    camp = st.load_campaign(path)
    grpo, maxrl = camp.runs["grpo"], camp.runs["maxrl"]
    metric = [Metric.parse(st.DEFAULT_METRIC)]
    with pytest.raises(st.UnpairedSeeds, match=r"only grpo: \[0\]"):
        st.compare(grpo, maxrl[1:], metric, baseline_name="grpo", candidate_name="maxrl")
    assert len(st.compare(grpo, maxrl[1:], metric, StatsSettings(paired_only=True)).metrics[0].seeds) == 3
    with pytest.raises(st.UnpairedSeeds, match="twice"):
        st.compare(grpo + grpo[:1], maxrl, metric)
    with pytest.raises(st.TooFewSeeds):
        st.compare(grpo[:1], maxrl[:1], metric)
    with pytest.raises(st.MissingMetric, match="no value of eval/pass@2") as missing:
        st.compare(grpo, maxrl, [Metric.parse("eval/pass@2@final")])
    assert "eval/pass@1" in missing.value.fix
    with pytest.raises(st.MissingMetric, match="at step 7"):
        st.compare(grpo, maxrl, [Metric.parse("eval/pass@1@7")])
    with pytest.raises(st.UnknownCondition, match="'grpoo'"):
        st.campaign_report(camp, baseline="grpoo")
    with pytest.raises(st.BadMetricSpec):
        Metric.parse("eval/pass@1@last")
    with pytest.raises(st.BadSettings, match="no setting 'equivalance_margin'") as typo:
        StatsSettings.from_table({"equivalance_margin": 1})
    assert "'equivalence_margin'" in typo.value.fix
    with pytest.raises(st.NotARunDir):
        st.load_campaign(tmp_path / "runs")


# --------------------------------------------------------------------------------------------
# The CLI


def test_stats_cli_writes_json_and_markdown_and_compare_pairs_runs(tmp_path):
    base, cand = counts(np.random.default_rng(8), 6, 8, 2)
    cand[0][0] += 1
    path = campaign(tmp_path, range(6), base, cand, stats={"metrics": ["eval/pass@1@final"], "alpha": 0.05,
                                                           "equivalence_margin": 0.05})
    md = tmp_path / "stats.md"
    runner = CliRunner()
    done = runner.invoke(main, ["stats", str(path), "--json", "--markdown", str(md)])
    assert done.exit_code == 0, done.output
    printed = json.loads(done.stdout)
    saved = json.loads((path / "stats.json").read_text())
    assert printed == saved and saved["baseline"] == "grpo" and saved["kind"] == "campaign"
    [m] = saved["comparisons"][0]["metrics"]
    d = (np.array(cand) - np.array(base)).mean(axis=1) / 16
    assert m["mean_difference"] == pytest.approx(d.mean()) and m["sign_flip"]["p"] == pytest.approx(2 / 64)
    assert m["verdict"] == "CONFIRMED" and m["evidence"]["samples_per_task"] == 16
    assert "| maxrl | `eval/pass@1@final` | 6 |" in md.read_text() and "**CONFIRMED**" in md.read_text()
    table = runner.invoke(main, ["stats", str(path)], env={"COLUMNS": "250"})
    assert table.exit_code == 0 and "CONFIRMED maxrl vs grpo" in table.output
    # compare: the same runs through globs, paired by the rows' seed labels
    out = tmp_path / "cmp.json"
    runs = sorted(str(p) for p in (path / "runs").glob("maxrl__s*"))
    done = runner.invoke(main, ["compare", *runs, "--vs", str(path / "runs" / "grpo__s*"), "--out", str(out),
                                "--metric", "eval/pass@1@final", "--json"])
    assert done.exit_code == 0, done.output
    again = json.loads(out.read_text())["comparisons"][0]
    assert again["candidate"] == "maxrl" and again["metrics"][0]["sign_flip"] == m["sign_flip"]
    bad = runner.invoke(main, ["stats", str(path), "--baseline", "nope"])
    assert bad.exit_code == 2 and "error: " in bad.stderr and "no condition 'nope'" in bad.stderr
    bad = runner.invoke(main, ["compare", runs[0], "--vs", str(path / "runs" / "grpo__s0")])
    assert bad.exit_code == 1 and "1 paired seed" in bad.stderr


def test_the_worked_example_in_the_docs_matches_the_library():
    """docs/statistics.md's worked example: its numbers recomputed from its own table."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "statistics.md").read_text()
    rows = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in doc.splitlines()
            if line.startswith(("grpo ", "maxrl "))}
    d = np.array(rows["maxrl"]) - np.array(rows["grpo"])
    assert len(d) == 8
    flip = st.sign_flip_test(d)
    assert f"p = {round(flip.p * 256)}/256 = {flip.p:.4f}" in doc
    lo, hi = st.t_interval(d)
    assert f"[{lo:.4f}, {hi:.4f}]" in doc
    dz, dz_lo, dz_hi = st.cohens_dz(d)
    assert f"d_z = {d.mean():.3f}/{d.std(ddof=1):.4f} = **{dz:.2f} [{dz_lo:.2f}, {dz_hi:.2f}]**" in doc
    mde = st.minimum_detectable_dz(8)
    assert f"d_z {mde:.3f}, i.e. **{mde * d.std(ddof=1):.4f}**" in doc
    assert f"**{st.seeds_needed(0.01 / d.std(ddof=1))} seeds**" in doc
    three = st.sign_flip_test(d[:3])
    assert three.p == 0.25 and f"p = {st.t_test_p(d[:3]):.3f}" in doc


def test_margins_per_metric_identical_runs_and_seed_labels_from_the_config(tmp_path):
    base, _ = counts(np.random.default_rng(9), 7, 5, 0)     # 7 seeds: 2·2/2^7 < 0.05 for two metrics
    path = campaign(tmp_path, range(7), base, base, stats={"equivalence_margin": {"eval/pass@1@final": 0.01}})
    same, acc = report(path, metrics=["eval/pass@1@final", "eval/accuracy/mean@final"])
    # identical runs: every flip reaches |Σ 0| = 0, so p = 1; TOST with sd 0 is its limit, p = 0
    assert same.sign_flip["p"] == 1.0 and same.cohens_dz is None and same.verdict == "EQUIVALENT"
    assert acc.equivalence is None and acc.verdict == "INCONCLUSIVE"   # no margin for this metric
    with pytest.raises(st.BadSettings):
        StatsSettings(target_effect="big")
    # outside a campaign: no seed label in the rows, so the config's seeds pair the runs
    run = write_run(tmp_path / "plain", "a", 5, [3, 4])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (run / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if k != "seed"}) + "\n"
                                               for r in rows))
    (run / "config.json").write_text(json.dumps({"config": {"seed": 7, "rollout": {"seed": 7}}}))
    assert st.load_run(run).seed == 7
    (run / "config.json").write_text(json.dumps({"config": {"seed": 7, "rollout": {"seed": 2}}}))
    assert st.load_run(run).seed == "seed=7,rollout.seed=2"


def test_stats_never_loads_torch(tmp_path):
    """Statistics are math over files: `rollmarket stats` must not pay for (or need) torch."""
    import subprocess
    import sys

    base, cand = counts(np.random.default_rng(10), 3, 3, 1)
    path = campaign(tmp_path, range(3), base, cand)
    code = ("import sys; from click.testing import CliRunner; from rollmarket.cli.main import main; "
            f"r = CliRunner().invoke(main, ['stats', {str(path)!r}, '--json']); "
            "assert r.exit_code == 0, r.output; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_before_after_pairs_each_run_with_its_own_step_zero(tmp_path):
    # One condition, 6 seeds: each run starts at start_T (step 0) and ends at end_T (step 20).
    rng = np.random.default_rng(11)
    start = rng.integers(2, 8, size=(6, 5))
    end = np.clip(start + rng.integers(1, 4, size=(6, 5)), 0, 16)
    runs = {("grpo", s): write_run(tmp_path, "grpo", s, end[s].tolist(), start_correct_T=start[s].tolist())
            for s in range(6)}
    path = write_campaign(tmp_path, runs, ["grpo"], {})
    done = CliRunner().invoke(main, ["stats", str(path), "--before-after", "--json"])
    assert done.exit_code == 0, done.output
    saved = json.loads((path / "stats-before-after.json").read_text())
    assert saved["kind"] == "before_after" and not (path / "stats.json").exists()
    [m] = saved["comparisons"][0]["metrics"]
    d = (end - start).mean(axis=1) / 16          # every seed gains: all six differences positive
    assert m["differences"] == pytest.approx(d.tolist())
    assert m["steps"] == {"baseline": [0] * 6, "candidate": [20] * 6}
    assert m["sign_flip"]["p"] == pytest.approx(2 / 64) and m["verdict"] == "CONFIRMED"
    assert m["two_way_bootstrap"]["tasks"] == 5 and m["two_way_bootstrap"]["mean"] == pytest.approx(d.mean())
    # A plain comparison needs two conditions; before/after works on one.
    bad = CliRunner().invoke(main, ["stats", str(path)])
    assert bad.exit_code == 2 and "one condition" in bad.stderr
