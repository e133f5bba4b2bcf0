"""The whole build of the shipped models: tasks -> corpus -> tokenizer -> train dense and MoE ->
evaluate on held-out tasks -> `models/<name>/` with `build_report.json`.

    rollmarket models build            # the shipped build (dense, then the MoE upcycled from it)
    rollmarket models build --quick    # a seconds-long smoke build
"""

from __future__ import annotations

import copy
import json
import platform
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import tokenizers
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from .. import __version__
from ..tasks import FAMILIES, generate_split, load_world
from .configs import MODEL_NAMES, make_config
from .corpus import encode, tokenizer_texts
from .evaluate import evaluate, sampled_pass_at_k
from .export import write_model_dir
from .headroom import mixed_demonstrations
from .tokenizer import IM_END, PAD, special_ids, train_tokenizer
from .train import TrainConfig, train
from .upcycle import upcycle

# on_event(kind, fields): kinds are "stage" {text}, "train_start" {model, steps}, "step" {model, step, loss},
# "eval_start" {model, n}, "episode" {model, correct}, "done" {model, report}.
EventSink = Callable[[str, dict[str, Any]], None]


@dataclass
class BuildConfig:
    out: Path = Path("models")  # where models/<name>/ are written
    seed: int = 0  # seeds model init and batch order
    only: tuple[str, ...] = MODEL_NAMES  # which models to build
    steps: int = 4000  # optimizer steps of tiny-dense
    lr: float = 6e-3  # peak LR of tiny-dense
    moe_steps: int = 2000  # optimizer steps of tiny-moe (after upcycling)
    moe_lr: float = 3e-3  # peak LR of tiny-moe
    upcycle: bool = True  # start tiny-moe from tiny-dense (see upcycle.py); False trains it from scratch
    batch_size: int = 16
    max_minutes: float = 30.0  # wall-time cap per model's training
    vocab_size: int = 1536
    train_per_family: dict[str, int] = field(
        default_factory=lambda: {"calculator": 2000, "lookup": 4000, "chain": 5000, "plain": 2000})
    eval_per_family: int = 50  # held-out tasks per family
    threads: int = 1
    # tiny-start: tiny-moe fine-tuned on mixed-quality demonstrations (headroom.py).
    start_steps: int = 400
    start_lr: float = 5e-4
    tool_share: float = 0.65  # share of demonstrations that use the tools (the rest guess)
    start_copies: int = 2  # demonstrations per task, each by an independently drawn demonstrator
    start_per_family: dict[str, int] = field(
        default_factory=lambda: {"calculator": 2000, "lookup": 1500, "chain": 1500, "plain": 1000})
    headroom_family: str = "calculator"  # the family (the `arithmetic` suite) whose sampled pass@k is reported
    headroom_tasks: int = 64
    headroom_samples: int = 8

    @classmethod
    def quick(cls, **overrides: Any) -> BuildConfig:
        """A smoke build: tiny data, a few steps, a handful of held-out tasks."""
        base = dict(steps=4, moe_steps=4, start_steps=4, batch_size=4, vocab_size=512, eval_per_family=1,
                    train_per_family={f: 20 for f in FAMILIES}, start_per_family={f: 10 for f in FAMILIES},
                    headroom_tasks=2, headroom_samples=2)
        return cls(**{**base, **overrides})


def build(config: BuildConfig, on_event: EventSink | None = None) -> dict[str, dict]:
    """Run the build; return each model's report (also written to `<out>/<name>/build_report.json`)."""
    emit = on_event or (lambda kind, fields: None)
    world = load_world()
    emit("stage", {"text": "generating tasks"})
    heldout = generate_split("heldout", config.eval_per_family, world)
    dense_dir, moe_dir = config.out / "tiny-dense", config.out / "tiny-moe"
    gold_models = [name for name in config.only if name != "tiny-start"]
    # Gold trajectories train tiny-dense and tiny-moe and the tokenizer; tiny-start alone needs none.
    train_tasks = (generate_split("train", config.train_per_family, world, exclude_prompts={t.prompt for t in heldout})
                   if gold_models else [])
    dense = moe = None
    if "tiny-start" in config.only and "tiny-moe" not in config.only:
        # tiny-start is fine-tuned from tiny-moe: take the one already built, with its tokenizer.
        tokenizer, moe = _load_built(moe_dir, "fine-tuning tiny-start", emit)
    elif config.upcycle and "tiny-moe" in config.only and "tiny-dense" not in config.only:
        # Upcycling needs the dense model and its tokenizer: take the ones already built.
        tokenizer, dense = _load_built(dense_dir, "upcycling tiny-moe", emit)
    else:
        emit("stage", {"text": f"training the tokenizer on {len(train_tasks)} trajectories"})
        tokenizer = train_tokenizer(tokenizer_texts(train_tasks, world), config.vocab_size)
    ids = special_ids(tokenizer)
    examples = [encode(t, tokenizer) for t in train_tasks]

    reports: dict[str, dict] = {}
    for name in config.only:
        random.seed(config.seed)
        torch.manual_seed(config.seed)
        model_config = make_config(name, len(tokenizer), ids[PAD], ids[IM_END])
        is_moe = name == "tiny-moe"
        init = "random"
        model_examples, headroom = examples, None
        if name == "tiny-start":
            model = copy.deepcopy(moe)
            init = "tiny-moe, fine-tuned on mixed-quality demonstrations"
            model_examples, headroom = _start_examples(config, world, heldout, tokenizer), {}
            emit("stage", {"text": f"sampled pass@k of tiny-moe on held-out {config.headroom_family} (before)"})
            headroom["parent"] = _headroom(model, tokenizer, world, config)
        elif is_moe and config.upcycle:
            model = upcycle(dense, model_config, seed=config.seed)
            init = "upcycled from tiny-dense"
        else:
            model = AutoModelForCausalLM.from_config(model_config)
        steps, lr = {"tiny-dense": (config.steps, config.lr), "tiny-moe": (config.moe_steps, config.moe_lr),
                     "tiny-start": (config.start_steps, config.start_lr)}[name]
        train_config = TrainConfig(steps=steps, batch_size=config.batch_size, lr=lr,
                                   seed=config.seed, max_minutes=config.max_minutes, threads=config.threads)
        emit("train_start", {"model": name, "steps": steps})
        result = train(model, model_examples, train_config, ids[PAD],
                       on_step=lambda step, loss, name=name: emit("step", {"model": name, "step": step, "loss": loss}))
        emit("eval_start", {"model": name, "n": len(heldout)})
        t0 = time.monotonic()
        scores = evaluate(model, tokenizer, heldout, world,
                          on_task=lambda e, name=name: emit("episode", {"model": name, "correct": e.correct}))
        eval_s = time.monotonic() - t0
        if headroom is not None:
            emit("stage", {"text": f"sampled pass@k of tiny-start on held-out {config.headroom_family}"})
            headroom["model"] = _headroom(model, tokenizer, world, config)
        out_dir = config.out / name
        report = {
            "model": name,
            "architecture": model_config.architectures[0],
            "parameters": sum(p.numel() for p in model.parameters()),
            "config": json.loads(model_config.to_json_string(use_diff=False)),
            "seed": config.seed,
            "init": init,
            "train": {**asdict(train_config), "steps_done": result.steps_done, "wall_s": round(result.wall_s, 1),
                      "stopped_by_time": result.stopped_by_time, "shared_prefix_tokens": result.prefix_len},
            "loss": result.summary(),
            "data": {**_data_report(model_examples), "heldout_tasks": len(heldout), "vocab_size": len(tokenizer),
                     "world_seed": world.seed},
            "eval": {"families": scores["families"], "overall": scores["overall"], "n": scores["n"],
                     "wall_s": round(eval_s, 1), "max_turns": 4, "decoding": "greedy"},
            "versions": {"rollmarket": __version__, "torch": torch.__version__,
                         "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                         "python": platform.python_version()},
            "machine": {"cpu_threads": config.threads, "platform": platform.platform()},
        }
        if headroom is not None:
            report["headroom"] = {"family": config.headroom_family, "split": "heldout", **headroom,
                                  "tool_share": config.tool_share, "copies": config.start_copies,
                                  "demonstrations": len(model_examples)}
        write_model_dir(model, tokenizer, out_dir)
        report["safetensors_bytes"] = (out_dir / "model.safetensors").stat().st_size
        (out_dir / "build_report.json").write_text(json.dumps(report, indent=2) + "\n")
        reports[name] = report
        if name == "tiny-dense":
            dense = model
        if name == "tiny-moe":
            moe = model
        emit("done", {"model": name, "report": report})
    return reports


def _data_report(examples: list) -> dict:
    """What a model trained on: sequences per family, tokens, and the assistant tokens the loss sees."""
    return {"train_tasks": dict(Counter(e.family for e in examples)),
            "train_tokens": sum(len(e.input_ids_T) for e in examples),
            "train_assistant_tokens": sum(sum(e.loss_mask_T) for e in examples)}


def _load_built(path: Path, purpose: str, emit: EventSink):
    """(tokenizer, float32 model) of a model this build made earlier, for `purpose`."""
    if not (path / "model.safetensors").exists():
        raise FileNotFoundError(f"{purpose} needs a built {path}; build it first")
    emit("stage", {"text": f"loading {path} for {purpose}"})
    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _start_examples(config: BuildConfig, world, heldout, tokenizer) -> list:
    """tiny-start's fine-tuning data: mixed-quality demonstrations of train tasks (no held-out prompt)."""
    tasks = generate_split("train", config.start_per_family, world, exclude_prompts={t.prompt for t in heldout})
    demos = mixed_demonstrations(tasks, world, tool_share=config.tool_share, copies=config.start_copies,
                                 seed=config.seed)
    return [encode(t, tokenizer) for t in demos]


def _headroom(model, tokenizer, world, config: BuildConfig) -> dict:
    """Sampled pass@k at temperature 1 on the first `headroom_tasks` held-out tasks of the family."""
    tasks = generate_split("heldout", {config.headroom_family: config.headroom_tasks}, world,
                           families=(config.headroom_family,))
    return sampled_pass_at_k(model, tokenizer, tasks, world, samples=config.headroom_samples, seed=config.seed)
