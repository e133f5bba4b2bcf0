"""`rollmarket campaign`: conditions × seeds from one TOML file, resumable after kill -9.

The real campaign test runs a tiny 2-condition × 2-seed campaign (three steps, two groups of two,
two held-out tasks) as a `rollmarket campaign` process, kills it with SIGKILL once one run has
finished and another is part-way, checks that its runs died with it, resumes it (`--resume DIR`),
and judges from the files: finished runs untouched, the part-way run continued in its own run
directory (`--resume`, its earlier rows kept, every step once), the others finished; every metrics
row labelled with its condition and seed; with seed_mode = "sampling", every seed's jobs carry the
same tasks in the same order and the sampling seeds the trainer's documented rule gives for that
seed (sha256 of "<sampling seed>:<step>:<job index>"), and the samples differ.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import wait_until

from rollmarket.research.campaign import CampaignError, load_campaign, parse_campaign

ROOT = Path(__file__).resolve().parent.parent
MODEL = str(ROOT / "models" / "tiny-moe")

TINY = textwrap.dedent(f"""\
    [model]
    path = {json.dumps(MODEL)}
    [rollout]
    suite = "arithmetic"
    groups_per_step = 2
    group_size = 2
    temperature = 2.0
    max_tokens = 32
    precisions = ["bf16"]
    [agent]
    max_turns = 2
    [loop]
    steps = 3
    fetch_timeout_s = 300
    [eval]
    tasks = 2
    samples = 2
    max_turns = 2
    [local]
    workers = ["bf16"]
    """)

CAMPAIGN = TINY + textwrap.dedent("""
    [campaign]
    name = "tiny"
    seeds = [1, 2]
    seed_mode = "sampling"

    [[campaign.conditions]]
    name = "grpo"
    algorithm.advantage = "grpo"

    [[campaign.conditions]]
    name = "rloo"
    algorithm.advantage = "rloo"
    optim.lr = 1e-4

    [stats]
    metrics = ["eval/pass@1@final"]
    baseline = "grpo"
    """)


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


# -- refused before anything is made ------------------------------------------------------------------

BAD = {
    "not TOML": (CAMPAIGN.replace("[campaign]", "[campaign"), "not valid TOML"),
    "no campaign table": (TINY, r"no \[campaign\] table"),
    "unknown campaign key": (CAMPAIGN.replace("seed_mode =", "seed_mod ="), "did you mean campaign.seed_mode"),
    "unknown seed mode": (CAMPAIGN.replace('"sampling"', '"tasks"'), "campaign.seed_mode"),
    "no seeds": (CAMPAIGN.replace("seeds = [1, 2]", "seeds = []"), "campaign.seeds"),
    "repeated seeds": (CAMPAIGN.replace("seeds = [1, 2]", "seeds = [1, 1]"), "seeds repeat"),
    "duplicate condition": (CAMPAIGN.replace('name = "rloo"', 'name = "grpo"'), "two conditions are named 'grpo'"),
    "condition without a name": (CAMPAIGN.replace('name = "rloo"\n', ""), "needs a name"),
    "unknown key in a condition": (CAMPAIGN.replace("optim.lr =", "optim.lrr ="),
                                   "condition rloo: unknown key optim.lrr .*did you mean optim.lr"),
    "bad value in a condition": (CAMPAIGN.replace("optim.lr = 1e-4", "loop.steps = 0"), "condition rloo: bad value for loop.steps"),
    "unknown key in the train sections": (CAMPAIGN.replace("[eval]\ntasks", "[eval]\ntask"),
                                          "unknown key eval.task.*did you mean eval.tasks"),
    "a seed key the campaign sets": (CAMPAIGN.replace('optim.lr = 1e-4', 'rollout.sampling_seed = 3'),
                                     "condition rloo sets rollout.sampling_seed"),
    "a model that is not there": (CAMPAIGN.replace(MODEL, "/nonexistent/model"), "model.path"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_campaign_is_refused_with_a_typed_error(case):
    text, needle = BAD[case]
    with pytest.raises(CampaignError, match=needle):
        parse_campaign(text, source="c.toml")


def test_an_unknown_override_is_refused_by_the_command_before_anything_is_made(tmp_path):
    """Through the CLI (a process of its own): one line naming the closest key, exit 2, no directory."""
    path = tmp_path / "c.toml"
    path.write_text(CAMPAIGN)
    out = tmp_path / "out"
    with pytest.raises(CampaignError, match="did you mean loop.steps"):
        load_campaign(path, ["loop.stepz=2"])
    done = subprocess.run([sys.executable, "-m", "rollmarket", "campaign", str(path), "loop.stepz=2", "--out",
                           str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "did you mean loop.steps" in lines[0], done.stderr
    assert not out.exists()


def test_seed_modes_set_the_seeds_they_name():
    """all: task order, sampling and torch seeds follow the campaign seed; sampling: only the sampling seed
    (the task order and the torch seed stay the file's), so the replicates train on the same tasks."""
    everything = parse_campaign(CAMPAIGN.replace('"sampling"', '"all"'), source="c.toml")
    sampling = parse_campaign(CAMPAIGN.replace("[rollout]\n", "[rollout]\nseed = 7\n"), source="c.toml")
    for run in everything.runs:
        c = run.config
        assert (c.rollout.seed, c.rollout.sampling, c.seed) == (run.seed, run.seed, run.seed)
        assert (c.labels.condition, c.labels.seed) == (run.condition, run.seed)
    for run in sampling.runs:
        c = run.config
        assert (c.rollout.seed, c.rollout.sampling_seed, c.seed) == (7, run.seed, 0)
    rloo = [r.config for r in sampling.runs if r.condition == "rloo"]
    assert [c.optim.lr for c in rloo] == [1e-4, 1e-4] and [c.algorithm.advantage for c in rloo] == ["rloo"] * 2
    assert {r.config.optim.lr for r in sampling.runs if r.condition == "grpo"} == {5e-5}  # the default


def test_command_line_overrides_apply_to_every_run_after_the_conditions():
    plan = parse_campaign(CAMPAIGN, source="c.toml", overrides=["optim.lr=3e-4", "loop.steps=2"])
    assert {(r.config.optim.lr, r.config.loop.steps) for r in plan.runs} == {(3e-4, 2)}


# -- a real campaign, killed and resumed --------------------------------------------------------------

def _processes_mentioning(text: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(int(proc.name))
    return found


def _run_dirs(out: Path) -> dict[str, Path]:
    return {p.parent.parent.name: p.parent for p in (out / "runs").glob("*/*/config.json")}


def _part_way(out: Path):
    """(finished run keys, part-way run keys) once one run has finished and another has a step row."""
    runs = _run_dirs(out)
    done = [k for k, d in runs.items() if (d / "summary.json").exists()]
    part = [k for k, d in runs.items() if not (d / "summary.json").exists()
            and any(r["step"] >= 1 for r in jsonl(d / "metrics.jsonl"))]
    return (done, part) if done and part else None


@pytest.mark.timeout(1200)  # its own waits outlast the suite's 300 s on a loaded box
def test_a_campaign_killed_with_sigkill_resumes(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(CAMPAIGN)
    out = tmp_path / "campaign"
    command = [sys.executable, "-m", "rollmarket", "campaign", str(path), "--out", str(out), "--parallel", "2"]
    log = open(tmp_path / "first.log", "w")
    first = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        done, part = wait_until("one run finished and another part-way", lambda: _part_way(out), timeout=600,
                                every=0.1, tick=lambda: first.poll() is None or pytest.fail(
                                    f"the campaign ended first: {(tmp_path / 'first.log').read_text()[-3000:]}"))
        finished_before = {k: (_run_dirs(out)[k] / "summary.json").read_bytes() for k in done}
        rows_before = {k: jsonl(_run_dirs(out)[k] / "metrics.jsonl") for k in part}
        first.send_signal(signal.SIGKILL)
        first.wait()
    finally:
        if first.poll() is None:
            first.kill()
        log.close()
    # Its runs die with it (PR_SET_PDEATHSIG): nothing may keep writing beside the resumed runs.
    wait_until("the killed campaign's runs to die", lambda: not _processes_mentioning(str(out)), timeout=60)
    runs_before = _run_dirs(out)

    # The campaign's file and overrides come back from its campaign.json.
    again = subprocess.run([sys.executable, "-m", "rollmarket", "campaign", "--resume", str(out)],
                           capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]

    manifest = json.loads((out / "campaign.json").read_text())
    assert manifest["name"] == "tiny" and manifest["seeds"] == [1, 2] and manifest["seed_mode"] == "sampling"
    assert manifest["file"] == CAMPAIGN and manifest["stats"] == {"metrics": ["eval/pass@1@final"], "baseline": "grpo"}
    assert manifest["conditions"] == [{"name": "grpo", "overrides": {"algorithm.advantage": "grpo"}},
                                      {"name": "rloo", "overrides": {"algorithm.advantage": "rloo", "optim.lr": 1e-4}}]
    assert [(r["condition"], r["seed"], r["status"]) for r in manifest["runs"]] == [
        ("grpo", 1, "done"), ("grpo", 2, "done"), ("rloo", 1, "done"), ("rloo", 2, "done")]
    runs = _run_dirs(out)
    for entry in manifest["runs"]:
        key = f"{entry['condition']}__s{entry['seed']}"
        assert out / entry["dir"] == runs[key]
        assert len(list((out / "runs" / key).glob("*/config.json"))) == 1, "one run directory per run"
        metrics = jsonl(runs[key] / "metrics.jsonl")
        assert [r["step"] for r in metrics] == [0, 1, 2, 3], (key, [r["step"] for r in metrics])
        assert {(r["condition"], r["seed"]) for r in metrics} == {(entry["condition"], entry["seed"])}
        summary = json.loads((runs[key] / "summary.json").read_text())
        assert (summary["condition"], summary["seed"]) == (entry["condition"], entry["seed"])
    for key, text in finished_before.items():  # skipped, not run again
        assert (runs[key] / "summary.json").read_bytes() == text
        assert "--resume" not in (runs[key].parent / "train.log").read_text()
    for key, rows in rows_before.items():  # continued where it stopped, in the same run directory
        assert runs[key] == runs_before[key]
        assert jsonl(runs[key] / "metrics.jsonl")[:len(rows)] == rows
        assert f"--resume {runs[key]}" in (runs[key].parent / "train.log").read_text()

    # seed_mode = "sampling": the same tasks in the same order, the sampling seeds of each seed.
    for condition in ("grpo", "rloo"):
        jobs, samples = {}, {}
        for seed in (1, 2):
            run_dir = runs[f"{condition}__s{seed}"]
            with sqlite3.connect(f"file:{run_dir / 'exchange.db'}?mode=ro", uri=True) as conn:
                bodies = [json.loads(b) for (b,) in conn.execute("SELECT body FROM jobs")]
            jobs[seed] = sorted((int(b["job_id"].split("-s")[-1].split("-")[0]), int(b["job_id"].rsplit("-", 1)[1]),
                                 b["task"]["task_id"], b["sampling_config"]["seed"]) for b in bodies)
            assert [(step, i) for step, i, _, _ in jobs[seed]] == [(s, i) for s in (1, 2, 3) for i in (0, 1)]
            for step, i, task_id, sampling_seed in jobs[seed]:
                # The seed rule of docs/contracts.md "Seeds": the job's draw is its index in the run.
                draw = (step - 1) * 2 + i
                digest = hashlib.sha256(f"task:{seed}:{task_id}:{draw}".encode()).digest()
                assert sampling_seed == int.from_bytes(digest[:4], "big") % 2**31
            samples[seed] = {(g["step"], g["task_id"], g["sample_index"]): g["response"]
                             for g in jsonl(run_dir / "generations.jsonl")}
        assert [j[2] for j in jobs[1]] == [j[2] for j in jobs[2]], "same tasks in the same order"
        assert samples[1].keys() == samples[2].keys()
        assert any(samples[1][k] != samples[2][k] for k in samples[1]), "new samples"


def test_a_rerun_refuses_another_campaign_changed_settings_and_a_second_process(tmp_path):
    """The directory of a campaign takes only that campaign again; nothing is started or changed."""
    import fcntl

    from rollmarket.research.campaign import CampaignRunner

    plan = parse_campaign(CAMPAIGN, source="c.toml")
    out = tmp_path / "campaign"
    (out / "runs" / "grpo__s1" / "20261126T000000Z-abcdef").mkdir(parents=True)
    (out / "campaign.json").write_text(json.dumps(plan.manifest()))
    saved = plan.runs[0].config.model_dump(mode="json")
    saved["optim"]["lr"] = 0.5
    (out / "runs" / "grpo__s1" / "20261126T000000Z-abcdef" / "config.json").write_text(json.dumps({"config": saved}))
    before = sorted(str(p) for p in out.rglob("*"))

    with pytest.raises(CampaignError, match="other settings .*optim.lr"):
        CampaignRunner(plan, out).run()
    renamed = parse_campaign(CAMPAIGN.replace('name = "tiny"', 'name = "other"'), source="c.toml")
    with pytest.raises(CampaignError, match="holds another campaign"):
        CampaignRunner(renamed, out).run()
    with pytest.raises(CampaignError, match="not a campaign directory"):
        CampaignRunner(plan, tmp_path).run()  # not empty, and no campaign.json
    assert sorted(str(p) for p in out.rglob("*")) == before

    saved["optim"]["lr"] = plan.runs[0].config.optim.lr  # now it matches: only the lock stands in the way
    (out / "runs" / "grpo__s1" / "20261126T000000Z-abcdef" / "config.json").write_text(json.dumps({"config": saved}))
    with open(out / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(CampaignError, match="another process is running"):
            CampaignRunner(plan, out).run()
    assert not (out / "runs" / "grpo__s1" / "train.log").exists()


def test_a_failed_run_fails_the_campaign_and_not_the_other_runs(tmp_path, monkeypatch):
    """A run that dies (here its own fail point: SIGKILL at its first fetch) is marked failed, the other
    run goes on to the end, and the campaign ends with CampaignFailed naming the run and its log."""
    from rollmarket.research.campaign import CampaignFailed, CampaignRunner

    text = CAMPAIGN.replace("steps = 3", "steps = 1").replace("tasks = 2", "tasks = 0")
    text = text.replace("seeds = [1, 2]", "seeds = [1]")
    plan = parse_campaign(text, source="c.toml", overrides=["loop.fetch_timeout_s=300"])
    out = tmp_path / "campaign"
    # Children inherit the environment: the fail point is armed for the rloo run only.
    monkeypatch.setenv("ROLLMARKET_FAILPOINTS", "before_fetch@1")
    runner = CampaignRunner(plan, out, parallel=2)
    original = runner._start

    def start(run, status):
        if run.condition == "grpo":
            monkeypatch.delenv("ROLLMARKET_FAILPOINTS")
            try:
                return original(run, status)
            finally:
                monkeypatch.setenv("ROLLMARKET_FAILPOINTS", "before_fetch@1")
        return original(run, status)

    runner._start = start
    with pytest.raises(CampaignFailed, match=r"1 of 2 runs failed: rloo__s1 \(exit -9, log .*train.log\)"):
        runner.run()
    manifest = json.loads((out / "campaign.json").read_text())
    assert [(r["condition"], r["status"]) for r in manifest["runs"]] == [("grpo", "done"), ("rloo", "failed")]
    assert (out / manifest["runs"][0]["dir"] / "summary.json").exists()
