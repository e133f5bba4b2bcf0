"""A dry run of a train config or a campaign file: what would run and what it would cost.

Nothing is started or written. Counts are exact (runs, steps, groups, trajectories, evaluations);
tokens are upper bounds (every model turn at `rollout.max_tokens`, every run at its turn limit);
the time is estimated from measured token rates:

- generation: tokens / the rollout engine's decode rate at the batch it runs (a group's
  `group_size` runs share decode steps; an evaluation runs up to 32 tasks at once);
- training: each generated token is teacher-forced once (the gate's π_old) and goes through
  one forward and backward pass of the update: about 4 forward passes, at the trainer's
  forward rate;
- a fixed start-up per run (interpreter, torch, model loads, the local exchange).

The rates come from `benchmarks/results/serve_throughput.json` (decode, batch 1 and 32, the
shipped tiny models, 1 torch thread, the 2-core box at load ~5, interpolated log-linearly in the
batch) and `benchmarks/results/teacher_forcing-cpu.json` (forward tokens/s), or, with
`measure=True`, from a short real decode and forward of the configured model on this machine.
Models without a measured rate get no time estimate. Runs of a campaign share the machine's
cores: `parallel` runs at once, each on about one core.
"""

from __future__ import annotations

import json
import math
import os
import time
import tomllib
from pathlib import Path
from typing import Any

from .campaign import CampaignError, flatten, parse_campaign

ROOT = Path(__file__).resolve().parents[3]
BENCHMARKS = ROOT / "benchmarks" / "results"
STARTUP_S = 15.0
"""Start-up of one `rollmarket train --local` run (torch import, the trainer's and a worker's model
loads, the in-process exchange) on the 2-core box: ~10–20 s in tests/test_campaign.py's runs."""
FORWARDS_PER_TRAINED_TOKEN = 4.0
"""Teacher forcing (1 forward) plus the update's forward and backward (~3 forwards)."""
EVAL_CONCURRENCY = 32
"""evaluate_policy runs up to 32 held-out tasks at once (train/evaluate.py)."""


def _rate_at(batch: int, rates: dict[int, float]) -> float:
    """Tokens/s at `batch`, log-linear between the measured batches (clamped at their ends)."""
    points = sorted(rates.items())
    if batch <= points[0][0]:
        return points[0][1]
    if batch >= points[-1][0]:
        return points[-1][1]
    for (b0, r0), (b1, r1) in zip(points, points[1:]):
        if b0 <= batch <= b1:
            t = (math.log(batch) - math.log(b0)) / (math.log(b1) - math.log(b0))
            return math.exp(math.log(r0) + t * (math.log(r1) - math.log(r0)))
    return points[-1][1]


def benchmark_rates(model_path: str) -> dict | None:
    """The measured rates of a shipped model (by its directory's name), or None."""
    name = Path(model_path).name
    try:
        serve = json.loads((BENCHMARKS / "serve_throughput.json").read_text())
        forward = json.loads((BENCHMARKS / "teacher_forcing-cpu.json").read_text())
    except (OSError, ValueError):
        return None
    decode = {r["batch"]: r["tokens_per_s"] for r in serve["results"] if r["model"] == name and r["path"] == "engine"}
    fwd = [r["tokens_per_s"] for r in forward["results"] if r["shape"] == name and r["method"] == "engine"]
    if not decode or not fwd:
        return None
    return {"source": "benchmarks/results/serve_throughput.json, teacher_forcing-cpu.json",
            "decode_tokens_per_s": decode, "forward_tokens_per_s": fwd[0]}


def measure_rates(model_path: str, precision: str, batch: int, tokens: int = 24) -> dict:
    """Decode rate at batch 1 and `batch`, and the forward rate, of the model on this machine (one thread)."""
    import torch

    from ..engines.loading import load_model
    from ..engines.rollout import RolloutEngine
    from ..engines.sampling import SamplingParams

    torch.set_num_threads(1)
    engine = RolloutEngine(load_model(model_path, precision))
    prompt = engine.encode_chat([{"role": "user", "content": "Count from one to fifty."}])
    params = SamplingParams(temperature=1.0, max_tokens=tokens, seed=0, ignore_eos=True)
    engine.generate([prompt], params)  # warm-up
    decode = {}
    for b in sorted({1, max(1, batch)}):
        t0 = time.perf_counter()
        engine.generate([prompt] * b, params)
        decode[b] = b * tokens / (time.perf_counter() - t0)
    trainer = load_model(model_path, "fp32")
    ids = torch.tensor([prompt + [engine.pad_id] * tokens] * max(1, batch))
    with torch.no_grad():
        trainer.model(input_ids=ids)  # warm-up
        t0 = time.perf_counter()
        trainer.model(input_ids=ids)
    forward = ids.numel() / (time.perf_counter() - t0)
    return {"source": f"measured now ({tokens} tokens, 1 thread)", "decode_tokens_per_s": decode,
            "forward_tokens_per_s": forward}


def _evaluations(cfg) -> int:
    """Held-out evaluations of a run: before training, every `eval.every` steps, after the last."""
    if cfg.eval.tasks == 0:
        return 0
    steps = cfg.loop.steps
    return 1 + sum(1 for k in range(1, steps + 1) if (cfg.eval.every and k % cfg.eval.every == 0) or k == steps)


def run_cost(cfg) -> dict:
    """Counts and token upper bounds of one training run."""
    r, steps = cfg.rollout, cfg.loop.steps
    trajectories = steps * r.groups_per_step * r.group_size
    evaluations = _evaluations(cfg)
    eval_runs = evaluations * cfg.eval.tasks * (1 + cfg.eval.samples)
    return {
        "steps": steps, "groups_per_step": r.groups_per_step, "group_size": r.group_size,
        "groups": steps * r.groups_per_step,
        "trajectories": trajectories,
        "tokens_max": trajectories * r.max_tokens * cfg.agent.max_turns,
        "evaluations": evaluations, "eval_tasks": cfg.eval.tasks, "eval_runs": eval_runs,
        "eval_tokens_max": eval_runs * r.max_tokens * cfg.eval.max_turns,
    }


def run_seconds(cfg, cost: dict, rates: dict) -> dict:
    """Seconds of one run's token work (its token upper bounds) at `rates`, plus start-up."""
    decode = {int(k): float(v) for k, v in rates["decode_tokens_per_s"].items()}
    gen = cost["tokens_max"] / _rate_at(cfg.rollout.group_size, decode)
    train = cost["tokens_max"] * FORWARDS_PER_TRAINED_TOKEN / rates["forward_tokens_per_s"]
    evaluation = cost["eval_tokens_max"] / _rate_at(min(EVAL_CONCURRENCY, max(1, cfg.eval.tasks)), decode)
    return {"generation_s": gen, "training_s": train, "evaluation_s": evaluation, "startup_s": STARTUP_S,
            "total_s": gen + train + evaluation + STARTUP_S}


def _differences(config, default) -> dict[str, Any]:
    ours, base = flatten(config.model_dump(mode="json")), flatten(default.model_dump(mode="json"))
    return {k: v for k, v in ours.items() if base.get(k) != v}


def explain(path: Path | str, overrides: list[str] = (), *, measure: bool = False,
            parallel: int | None = None) -> dict:
    """The dry run of a train config or campaign file (see the module's docstring), as data.

    Raises CampaignError or TrainConfigError for a bad file or override, like the commands that run it."""
    from ..train.config import TrainConfig, resolve, validate

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise CampaignError(f"cannot read {path}: {exc.strerror}") from None
    try:
        is_campaign = "campaign" in tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise CampaignError(f"{path} is not valid TOML: {exc}") from None
    if is_campaign:
        plan = parse_campaign(text, source=str(path), overrides=list(overrides))
        runs = [(r.condition, r.seed, r.config) for r in plan.runs]
        kind, name, seed_mode = "campaign", plan.name, plan.seed_mode
        parallel = parallel or plan.parallel or os.cpu_count() or 1
    else:
        cfg = resolve(path, list(overrides))
        validate(cfg, local=True)
        runs, kind, name, seed_mode = [(None, cfg.seed, cfg)], "train", Path(path).stem, None
        parallel = 1
    default = TrainConfig()
    per_run = [_differences(cfg, default) for _, _, cfg in runs]
    seed_keys = {"rollout.seed", "rollout.sampling_seed", "seed", "labels.condition", "labels.seed", "runs_root"}
    common = {k: v for k, v in per_run[0].items() if k not in seed_keys and all(d.get(k) == v for d in per_run)}
    conditions: dict[str, dict] = {}
    for (condition, _, _), diff in zip(runs, per_run):
        if condition is not None:
            conditions.setdefault(condition, {k: v for k, v in diff.items() if k not in common and k not in seed_keys})

    cfg0 = runs[0][2]
    rates = (measure_rates(cfg0.model.path, cfg0.rollout.precisions[0], cfg0.rollout.group_size) if measure
             else benchmark_rates(cfg0.model.path))
    costs = [run_cost(cfg) for _, _, cfg in runs]
    seconds = [run_seconds(cfg, cost, rates) for (_, _, cfg), cost in zip(runs, costs)] if rates else None
    totals = {key: sum(c[key] for c in costs) for key in ("groups", "trajectories", "tokens_max", "eval_runs",
                                                         "eval_tokens_max")}
    estimate = None
    if seconds:
        cores = os.cpu_count() or 1
        # `parallel` runs at once, each on about one core; past the cores they share them.
        waves = math.ceil(len(runs) / parallel)
        slowdown = max(1.0, min(parallel, len(runs)) / cores)
        estimate = {"per_run_s": max(s["total_s"] for s in seconds), "waves": waves, "parallel": parallel,
                    "cores": cores, "wall_s": max(s["total_s"] for s in seconds) * waves * slowdown,
                    "rates": rates, "parts_s": seconds[0]}
    return {
        "kind": kind, "name": name, "file": str(path), "overrides": list(overrides), "seed_mode": seed_mode,
        "runs": [{"condition": c, "seed": s, **cost} for (c, s, _), cost in zip(runs, costs)],
        "settings": {"common": common, "conditions": conditions},
        "totals": {"runs": len(runs), **totals}, "estimate": estimate,
    }
