"""A lagging worker (`local.workers` entry ``PRECISION@lagK``, `rollmarket worker --reload-lag K`).

The drift here is real: a worker that runs up to K versions behind the published policy leases at
the version it runs, so its groups are sampled by an older policy. The test replays the exchange's
own audit log (independently of the trainer's code) to know which versions were published and
active when each lease was issued and each group served, derives every group's lag from that, and
checks the exchange honoured the declared bound and the real gate decided each group by the lag.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner

from rollmarket.cli.main import main
from rollmarket.train.config import TrainConfigError, WorkerSpec, resolve, validate
from rollmarket.train.loop import Trainer

ROOT = Path(__file__).resolve().parent.parent
MODEL = str(ROOT / "models" / "tiny-moe")
LAG = 3
MAX_POLICY_LAG = 2


def _replay_audit(db: Path) -> tuple[list[dict], dict[str, int], dict[str, str]]:
    """(leases with the published/active versions when issued, active version when each group was
    first served, each decided group's status), from the audit log alone."""
    published = active = None
    leases, served, decided = [], {}, {}
    with sqlite3.connect(db) as conn:
        for kind, subject, data in conn.execute("SELECT kind, subject, data FROM audit ORDER BY seq"):
            data = json.loads(data)
            if kind == "policy.published":
                published = data["version"]
            elif kind == "policy.activated":
                active = data["version"]
            elif kind == "lease.issued":
                leases.append({**data, "published": published, "active": active})
            elif kind == "groups.served":
                for group_id in data["group_ids"]:
                    served.setdefault(group_id, active)
            elif kind == "group.decided":
                decided.setdefault(subject, data["status"])
    return leases, served, decided


def test_a_lagging_workers_groups_carry_their_lag_and_the_gate_decides_them_by_it(tmp_path):
    # Only the lag may decide here (ESS, clipping and router flips switched off), so that every
    # decision can be derived from the lag by hand: async caps replay_lag at max_staleness = 1, so
    # lag 0-1 train, 2 replay, ≥ 3 quarantine.
    cfg = resolve(None, [
        f"model.path={json.dumps(MODEL)}", "rollout.suite=arithmetic", "rollout.groups_per_step=2",
        "rollout.group_size=2", "rollout.temperature=2.0", "rollout.max_tokens=32", "agent.max_turns=2",
        "eval.tasks=0", "optim.lr=1e-4", "local.lease_ttl_s=30", "loop.steps=10", "loop.mode=async",
        "rollout.precisions=['bf16']", f"local.workers=['bf16','bf16@lag{LAG}']",
        f"gate.max_policy_lag={MAX_POLICY_LAG}", "gate.min_ess=0", "gate.replay_ess=0",
        "gate.max_clipped_fraction=1", "gate.max_router_flip=1", f"runs_root={json.dumps(str(tmp_path))}"])
    run_dir = Trainer(cfg, local=True).run()

    leases, served, decided = _replay_audit(run_dir / "exchange.db")
    laggard = [lease for lease in leases if "-lag3-" in lease["worker_id"]]
    prompt = [lease for lease in leases if "-lag3-" not in lease["worker_id"]]
    assert laggard and prompt
    # The exchange made the prompt worker reload every version before leasing, and let the laggard
    # run behind, but never more than the lag it declared.
    assert all(lease["policy_version"] == lease["published"] for lease in prompt)
    behind = [lease["published"] - lease["policy_version"] for lease in laggard]
    assert max(behind) > 0 and all(0 <= b <= LAG for b in behind)

    with sqlite3.connect(run_dir / "exchange.db") as conn:
        groups = {g: (w, v) for g, w, v in conn.execute("SELECT group_id, worker_id, policy_version FROM groups")}
    expected = {}
    for group_id, status in decided.items():
        lag = served[group_id] - groups[group_id][1]
        expected[group_id] = "quarantine" if lag > MAX_POLICY_LAG else "replay" if lag > 1 else "train"
    assert decided == expected
    by_worker = {}
    for group_id, status in decided.items():
        by_worker.setdefault("lag" if "-lag3-" in groups[group_id][0] else "prompt", set()).add(status)
    # Which lags the laggard's groups reach depends on how the two processes interleave (a group at
    # lag exactly 2 is not guaranteed in 10 steps), so only the mapping above is exact: here, that
    # the laggard's drift reached the gate at all.
    assert by_worker["lag"] - {"train"}
    assert by_worker["prompt"] <= {"train", "replay"}  # async: at most one version behind, plus the step's own

    # The run's own rows say the same: the step counts of replay and quarantine are the decisions'.
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["gate/replay"] for r in rows) == sum(s == "replay" for s in decided.values())
    assert sum(r["gate/quarantine"] for r in rows) == sum(s == "quarantine" for s in decided.values())


@pytest.mark.parametrize("entry, needle", [
    ("bf16@lagx", "not a whole number"), ("bf16@lag-1", "not a whole number"), ("bf16@lag", "not a whole number"),
    ("bf16@slow3", "unknown option"), ("@lag2", "names no precision"), ("fp9@lag2", "unknown precision"),
])
def test_a_bad_worker_entry_is_a_typed_error_and_makes_nothing(tmp_path, entry, needle):
    result = CliRunner().invoke(main, ["train", "--local", f"runs_root={json.dumps(str(tmp_path / 'runs'))}",
                                       f"model.path={json.dumps(MODEL)}", f"local.workers=['{entry}']",
                                       "rollout.precisions=['bf16']"])
    assert result.exit_code == 2 and needle in result.output, result.output
    assert not (tmp_path / "runs").exists()  # refused before a run directory was made
    with pytest.raises(TrainConfigError, match=needle):  # the library's error, as the campaign runner sees it
        validate(resolve(None, [f"model.path={json.dumps(MODEL)}", f"local.workers=['{entry}']",
                                "rollout.precisions=['bf16']"]), local=True)


def test_a_lagging_worker_in_sync_mode_is_refused(tmp_path):
    """Sync takes only groups of the trainer's own version: a lagging worker's would never be used."""
    cfg = resolve(None, [f"model.path={json.dumps(MODEL)}", "local.workers=['bf16','bf16@lag2']",
                         "rollout.precisions=['bf16']", "loop.mode=sync"])
    with pytest.raises(TrainConfigError, match="loop.mode is 'sync'"):
        validate(cfg, local=True)
    validate(cfg.model_copy(update={"loop": cfg.loop.model_copy(update={"mode": "async"})}), local=True)


def test_worker_entries_parse_and_the_worker_refuses_a_negative_lag():
    assert WorkerSpec.parse("bf16") == WorkerSpec("bf16", 0)
    assert WorkerSpec.parse("fp8@lag12") == WorkerSpec("fp8", 12)
    assert str(WorkerSpec("fp8", 12)) == "fp8@lag12" and str(WorkerSpec("bf16")) == "bf16"
    result = CliRunner().invoke(main, ["worker", "--model", MODEL, "--reload-lag", "-1"])
    assert result.exit_code == 2 and "--reload-lag" in result.output, result.output
