"""The reference loop: agent RL end to end, in one process, in one file.

    python -m rollmarket.train.reference --steps 20 --seed 0

Each step samples agent runs of arithmetic tasks with the real agent loop (OpenAI chat API,
calculator tool, verifier), stitches each run into one training sequence, and takes one
policy-gradient step on them. The model that samples is the model that trains: one nn.Module,
served on a loopback port by `rollmarket serve-model`'s app and updated in place by AdamW, so every
step samples on-policy at the current weights. The full trainer adds scale (the exchange, remote
workers, checkpoints, gates), not new ideas. Shapes: G completions in a group, B sequences in the
batch, T token slots, V the vocabulary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from ..agents import (
    Agent,
    AgentSettings,
    ChatModel,
    LocalToolbox,
    Sampling,
    StitchError,
    stitch,
)
from ..agents.collect import run_grouped
from ..engines import RolloutEngine
from ..engines.loading import load_model
from ..localhost import ThreadedServer, free_port
from ..runs import code_version, new_run_dir, write_json
from ..serve import create_serve_app
from ..serve.settings import ServeSettings
from ..tasks.suites import load_suite
from ..verifiers import verify_trajectory
from .batch import pad_batch  # right-padding; slot t of a *_BT tensor scores token t+1
from .reward_stats import reward_tie_stats
from . import (
    LossConfig,
    TransformConfig,
    compute_advantages,
    policy_loss,
    token_advantages,
    token_entropy,
    token_logprobs,
    token_tis,
)
from .losses import Aggregation, LossKind
from .transforms import TransformMode


@dataclass
class Config:
    model: str = "models/tiny-moe"  # Hugging Face model directory, trained in fp32
    suite: str = "arithmetic"  # shipped task suite: train split for RL, heldout split for eval
    steps: int = 20  # optimizer steps (one per batch of groups)
    groups: int = 8  # tasks per step
    group_size: int = 4  # agent runs per task (G)
    max_tokens: int = 96  # tokens per model turn
    max_turns: int = 4  # model turns per agent run
    temperature: float = 1.0  # sampling temperature for training runs
    advantage_mode: str = "grpo"  # grpo | dr_grpo | rloo | maxrl (train/advantages.py)
    transform_mode: TransformMode = "none"  # none | gtpo (the planning-token modes need a planning mask)
    loss_kind: LossKind = "ppo_clip"  # ppo_clip (DAPO clip-higher) | cispo | reinforce
    aggregation: Aggregation = "token-mean"  # verl's names; seq-mean-token-sum-norm divides by max_tokens · max_turns
    tis_cap: float = 2.0  # token TIS cap on exp(logp_old - logp_behaviour); 0 turns it off
    lr: float = 1e-5  # AdamW learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # max global grad norm
    eval_every: int = 10  # evaluate every N steps (and after the last)
    eval_tasks: int = 25  # the first N heldout tasks, greedy
    seed: int = 0  # task order and sampling seeds
    runs_root: str = "runs"  # the run directory goes under here
    threads: int = 1  # torch CPU threads (1 is fastest on a busy shared CPU)


# ---------------------------------------------------------------------------------------------
# The sampler: the training model behind the OpenAI chat API on loopback.


@contextmanager
def serve_in_process(engine):
    """Serve `engine` with `rollmarket serve-model`'s app in a thread; yield its /v1 URL."""
    port = free_port()
    settings = ServeSettings(model_path=engine.info.path, precision="fp32", port=port, max_batch_seqs=64)
    server = ThreadedServer(create_serve_app(engine, settings), port, name="reference model server").start()
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.stop()




def evaluate(agent, tasks, max_tokens: int) -> float:
    """Share of `tasks` the policy solves at temperature 0."""
    greedy = Sampling(temperature=0.0, max_tokens=max_tokens, seed=0)
    runs = [group[0] for group in run_grouped(agent, tasks, 1, greedy, concurrency=max(1, len(tasks)))]
    return sum(bool(r.verification and r.verification.passed) for r in runs) / max(1, len(runs))


# ---------------------------------------------------------------------------------------------
# The learner: one teacher-forced forward over the stitched sequences, one loss, one step.


def train_step(model, optimizer, views, advantages_B, pad_id: int, cfg: Config) -> dict[str, float | None]:
    ids_BS, attn_BS, mask_BT, behaviour_BT = pad_batch(views, pad_id)
    model.train()
    logits_BSV = model(input_ids=ids_BS, attention_mask=attn_BS).logits.float()
    # The policy is the distribution the engine sampled from: logits / temperature (verl does the same).
    logits_BTV = logits_BSV[:, :-1] / cfg.temperature
    logprobs_BT = token_logprobs(logits_BTV, ids_BS[:, 1:])
    # One update per batch, so the "old" policy is this very forward with the gradient cut.
    old_logprobs_BT = logprobs_BT.detach()
    entropies_BT = token_entropy(logits_BTV)
    adv_BT, transform_metrics = token_advantages(advantages_B, entropies_BT, mask_BT,
                                                 TransformConfig(cfg.transform_mode))
    # Δ = logπ_old − logπ_behaviour: trainer vs engine on the same weights (numerics only here).
    delta_BT = (old_logprobs_BT - behaviour_BT) * mask_BT
    metrics: dict[str, float | None] = {
               "rollout_corr/mean_abs_delta": float(delta_BT.abs().sum() / mask_BT.sum().clamp(min=1)),
               "rollout_corr/max_abs_delta": float(delta_BT.abs().max())}
    is_weights_BT, loss_mask_BT = None, mask_BT
    if cfg.tis_cap > 0:
        corr = token_tis(delta_BT, mask_BT, cap=cfg.tis_cap)
        is_weights_BT, loss_mask_BT = corr.weights_BT, corr.mask_BT
        metrics.update(corr.metrics)
    loss, loss_metrics = policy_loss(logprobs_BT, old_logprobs_BT, adv_BT, loss_mask_BT,
                                     LossConfig(kind=cfg.loss_kind, aggregation=cfg.aggregation,
                                                norm_len=cfg.max_tokens * cfg.max_turns),
                                     is_weights_BT=is_weights_BT)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    model.eval()
    metrics.update(loss_metrics)
    metrics.update(transform_metrics)
    metrics.update({"loss": float(loss.detach()), "actor/grad_norm": float(grad_norm),
                    "actor/entropy": float((entropies_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1))})
    return metrics


# ---------------------------------------------------------------------------------------------
# The loop.

NO_UPDATE = ("loss", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/kl_ref", "actor/entropy",
             "actor/grad_norm", "exec_entropy_mean", "exec_entropy_var", "plan_entropy_mean", "plan_entropy_var",
             "plan_token_fraction", "rollout_corr/mean_abs_delta", "rollout_corr/max_abs_delta")
"""Update metrics: null on a step that trained on nothing (every group tied)."""


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def train(cfg: Config, *, quiet: bool = False) -> Path:
    """Run `cfg.steps` RL steps; return the run directory (config.json, metrics.jsonl, summary.json)."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    if cfg.temperature <= 0:
        raise ValueError("training samples need temperature > 0 (the policy is logits / temperature)")
    if cfg.transform_mode not in ("none", "gtpo"):
        raise ValueError("the reference loop runs no planning-token detector: transform_mode is none or gtpo "
                         "(rollmarket train has gtpo_hicra and gtpo_sepa with algorithm.planning_detector)")
    # A bad loss or aggregation name fails here, before a model is loaded.
    LossConfig(kind=cfg.loss_kind, aggregation=cfg.aggregation, norm_len=cfg.max_tokens * cfg.max_turns)
    run_dir = new_run_dir(cfg.runs_root)
    write_json(run_dir / "config.json", {"config": dataclasses.asdict(cfg), "code": code_version()})

    loaded = load_model(cfg.model, "fp32", "cpu")  # trainable: fp32 weights, eval mode until we train
    model = loaded.model
    engine = RolloutEngine(loaded)  # samples from the same nn.Module the optimizer updates
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    train_tasks = load_suite(cfg.suite, "train")
    random.Random(cfg.seed).shuffle(train_tasks)
    eval_tasks = load_suite(cfg.suite, "heldout")[:cfg.eval_tasks]
    say = (lambda *a: None) if quiet else print

    with serve_in_process(engine) as url:
        agent = Agent(ChatModel(url), LocalToolbox(), AgentSettings(max_steps=cfg.max_turns),
                      verify=verify_trajectory)
        eval_before = evaluate(agent, eval_tasks, cfg.max_tokens)
        say(f"eval before training: {eval_before:.3f} on {len(eval_tasks)} heldout tasks")
        seen = solved = 0
        eval_after = eval_before
        started = time.perf_counter()
        with (run_dir / "metrics.jsonl").open("w") as log:
            for step in range(1, cfg.steps + 1):
                t0 = time.perf_counter()
                first = (step - 1) * cfg.groups
                tasks = [train_tasks[(first + i) % len(train_tasks)] for i in range(cfg.groups)]

                # 1. Sample G agent runs per task. The server's batcher runs only while a request
                #    is open, so it never reads the weights while the optimizer writes them.
                #    All groups at once so the server batches them; each task's draw of the run
                #    seeds it (contracts/seeds.py).
                sampling = Sampling(temperature=cfg.temperature, max_tokens=cfg.max_tokens, seed=cfg.seed)
                groups = run_grouped(agent, tasks, cfg.group_size, sampling, concurrency=len(tasks) * cfg.group_size,
                                     draws=[first + i for i in range(len(tasks))])
                t_sample = time.perf_counter() - t0

                # 2. Score, then advantages within each group; runs that tie their group carry no signal.
                views, advantages, rewards, passed, lengths = [], [], [], [], []
                for runs in groups:
                    rewards_G = torch.tensor([r.reward for r in runs], dtype=torch.float32)
                    advantages_G = compute_advantages(rewards_G, cfg.advantage_mode)
                    rewards += rewards_G.tolist()
                    passed += [bool(r.verification and r.verification.passed) for r in runs]
                    for run, adv in zip(runs, advantages_G.tolist()):
                        lengths.append(run.num_response_tokens)
                        if adv == 0.0:
                            continue
                        try:
                            view = stitch(run.steps)  # ids the engine returned, never re-tokenized
                        except StitchError:
                            continue
                        if view.logprobs_T is None or not view.action_mask_T.any():
                            continue
                        views.append(view)
                        advantages.append(adv)

                # 3. One policy-gradient step on the informative runs; a step without one logs null
                #    for what did not happen.
                t1 = time.perf_counter()
                metrics: dict[str, float | None] = dict.fromkeys(NO_UPDATE)
                if views:
                    metrics = train_step(model, optimizer, views, torch.tensor(advantages), engine.pad_id, cfg)
                t_update = time.perf_counter() - t1

                seen += len(passed)
                solved += sum(passed)
                row = {
                    "step": step,
                    "correct_rate": sum(passed) / len(passed),
                    "running_correct_rate": solved / seen,
                    "mean_reward": sum(rewards) / len(rewards),
                    "num_datums": len(views),
                    **reward_tie_stats([[r.reward for r in runs] for runs in groups]),
                    "critic/rewards/mean": sum(rewards) / len(rewards),
                    "critic/advantages/mean": sum(advantages) / len(advantages) if advantages else None,
                    "response_length/mean": sum(lengths) / len(lengths),
                    **metrics,
                    "timing_s/sample": t_sample,
                    "timing_s/update": t_update,
                }
                if step % cfg.eval_every == 0 or step == cfg.steps:
                    row["eval/accuracy/mean"] = eval_after = evaluate(agent, eval_tasks, cfg.max_tokens)
                row["timing_s/step"] = time.perf_counter() - t0
                log.write(json.dumps(row) + "\n")
                log.flush()
                say(f"step {step:3d}  correct {row['correct_rate']:.3f}  running {row['running_correct_rate']:.3f}  "
                    f"datums {len(views):3d}  loss {_fmt(row['loss'], '+.4f')}  "
                    f"|Δ| {_fmt(row['rollout_corr/mean_abs_delta'], '.1e')}  "
                    f"{row['timing_s/step']:.1f}s"
                    + (f"  eval {row['eval/accuracy/mean']:.3f}" if "eval/accuracy/mean" in row else ""))
        minutes = (time.perf_counter() - started) / 60
    write_json(run_dir / "summary.json", {"eval_accuracy_before": eval_before, "eval_accuracy_after": eval_after,
                                          "eval_tasks": len(eval_tasks), "steps": cfg.steps,
                                          "steps_per_minute": cfg.steps / minutes if minutes else math.nan})
    say(f"eval {eval_before:.3f} -> {eval_after:.3f}; {run_dir}")
    return run_dir


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m rollmarket.train.reference", description=__doc__.split("\n")[0])
    for f in dataclasses.fields(Config):
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    return train(Config(**vars(parser.parse_args(argv))))


if __name__ == "__main__":
    main()
