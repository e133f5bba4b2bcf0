"""Pack a finished campaign directory as a committable raw result: experiments/results/<name>/.

    python experiments/pack_campaign.py runs/exp-a2 experiments/results/exp-a2 \
        --question "Does a short CPU run raise held-out sampled pass@1, and is it the reward?" \
        --command "rollmarket campaign configs/exp-a-campaign.toml --out runs/exp-a2 --parallel 16"

Copies what docs/render.py and `rollmarket stats` read — campaign.json and each run's config.json,
metrics.jsonl, evals.jsonl and summary.json — and writes manifest.json (the command, this machine,
the date the runs started, the code, what was not kept). Run it on the machine that ran the
campaign, so that the manifest names that machine. Refuses a destination that exists (a result is
replaced on purpose, by removing it first) and a campaign with runs that did not finish.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
from importlib import metadata
from pathlib import Path

KEPT = ("config.json", "metrics.jsonl", "evals.jsonl", "summary.json")
MISSING = ("checkpoints, generations.jsonl, exchange.db, workers/ and logs were left on the machine that ran "
           "the campaign (too large, and no number in the docs reads them)")


def machine() -> str:
    """One line naming this machine: cores, platform, torch and transformers versions."""
    versions = []
    for package in ("torch", "transformers"):
        try:
            versions.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            pass
    return f"{os.cpu_count()} x86_64 cores ({platform.platform()}), CPU path, " + ", ".join(versions)


def pack(source: Path, dest: Path, *, question: str, command: str, note: str = "") -> dict:
    """Copy the campaign's raw files from `source` to `dest` and write dest/manifest.json; returns it."""
    manifest_file = source / "campaign.json"
    if not manifest_file.is_file():
        raise SystemExit(f"error: {source} is not a campaign directory (no campaign.json)")
    if dest.exists():
        raise SystemExit(f"error: {dest} exists; remove it first to replace that result")
    campaign = json.loads(manifest_file.read_text())
    unfinished = [f"{r['condition']}__s{r['seed']} ({r['status']})" for r in campaign["runs"] if r["status"] != "done"]
    if unfinished:
        raise SystemExit(f"error: runs not finished: {', '.join(unfinished)} — resume the campaign first")
    dest.mkdir(parents=True)
    shutil.copy2(manifest_file, dest / "campaign.json")
    for stats in ("stats.json", "stats-before-after.json"):
        if (source / stats).is_file():
            shutil.copy2(source / stats, dest / stats)
    stamps = []
    for run in campaign["runs"]:
        run_dir = source / run["dir"]
        (dest / run["dir"]).mkdir(parents=True)
        stamps.append(run_dir.name[:16])
        for name in KEPT:
            shutil.copy2(run_dir / name, dest / run["dir"] / name)
    code = campaign.get("code") or {}
    manifest = {
        "experiment": dest.name,
        "question": question,
        "command": command,
        "config": campaign.get("source"),
        "overrides": campaign.get("overrides") or [],
        "code": f"git {code.get('git_commit')} (rollmarket {code.get('rollmarket')})",
        "machine": machine() + (f"; {note}" if note else ""),
        "date": f"{min(stamps)[:4]}-{min(stamps)[4:6]}-{min(stamps)[6:8]} (run directories stamped "
                f"{min(stamps)}–{max(stamps)})",
        "source": "the campaign directory, as written: campaign.json and each run's " + ", ".join(KEPT),
        "missing": MISSING,
    }
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="the campaign directory `rollmarket campaign` wrote")
    parser.add_argument("dest", type=Path, help="where the raw result goes, e.g. experiments/results/exp-a2")
    parser.add_argument("--question", required=True)
    parser.add_argument("--command", required=True, help="the command that ran the campaign, as run")
    parser.add_argument("--note", default="", help="anything else about the machine (e.g. what ran beside it)")
    args = parser.parse_args(argv)
    print(json.dumps(pack(args.source, args.dest, question=args.question, command=args.command, note=args.note),
                     indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
