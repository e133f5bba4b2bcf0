"""Copy what a campaign's statistics read into the repository, with the manifest docs/render.py quotes.

    python experiments/keep_campaign.py /tmp/exp/exp-b experiments/results/exp-b/campaign \
        --command "rollmarket campaign configs/exp-b-campaign.toml --out runs/exp-b --parallel 24" \
        --machine "32-core host of the lent machine, torch 2.13.0 CPU" [--note "..."]

Kept: campaign.json and each run's config.json, metrics.jsonl, evals.jsonl and summary.json (what
`rollmarket stats` and docs/render.py read). Left out, and said so in the manifest: checkpoints,
generations, the exchange database, worker logs.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
from datetime import datetime, timezone
from pathlib import Path

KEPT = ("config.json", "metrics.jsonl", "evals.jsonl", "summary.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("campaign", type=Path, help="the campaign directory `rollmarket campaign` wrote")
    parser.add_argument("target", type=Path, help="where in experiments/results/ to keep it (replaced)")
    parser.add_argument("--command", required=True, help="the command that ran it")
    parser.add_argument("--machine", default=f"{platform.platform()}, {__import__('os').cpu_count()} CPUs")
    parser.add_argument("--code", default=None, help="the git commit it ran (default: campaign.json's)")
    parser.add_argument("--note", default=None, help="e.g. why this is a smoke run and not evidence")
    args = parser.parse_args()
    meta = json.loads((args.campaign / "campaign.json").read_text())
    if args.target.exists():
        shutil.rmtree(args.target)
    args.target.mkdir(parents=True)
    shutil.copy2(args.campaign / "campaign.json", args.target / "campaign.json")
    stamps = []
    for run in meta["runs"]:
        if not run.get("dir"):
            continue
        source, dest = args.campaign / run["dir"], args.target / run["dir"]
        dest.mkdir(parents=True)
        for name in KEPT:
            if (source / name).exists():
                shutil.copy2(source / name, dest / name)
        stamps.append(Path(run["dir"]).name.split("-")[0])
    code = args.code or meta.get("code", {}).get("git_commit") or str(meta.get("code"))
    manifest = {
        "experiment": meta.get("name"), "command": args.command, "code": code, "machine": args.machine,
        "date": f"{datetime.now(timezone.utc):%Y-%m-%d} (run directories stamped {min(stamps) if stamps else '–'})",
        "source": "the campaign directory, as written: campaign.json and each run's " + ", ".join(KEPT),
        "missing": "checkpoints, generations.jsonl, exchange.db, workers/ and logs (no number in the docs reads them)",
    }
    if args.note:
        manifest["note"] = args.note
    (args.target / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"kept {len(stamps)} runs in {args.target}")


if __name__ == "__main__":
    main()
