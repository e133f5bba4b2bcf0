"""The rollout × trainer mismatch matrix on the GPU, for a Qwen3-MoE layer shape with random weights.

One random-weight Qwen3-MoE model (Qwen3-30B-A3B's layer shape, fewer layers) at several precision
profiles. Each rollout profile samples the same seeded prompts with ``RolloutEngine`` (KV-cache
decoding, logprobs and routed experts per token); each trainer profile teacher-forces those very
token ids with ``TrainerEngine`` (one prefill, the fused lm-head statistics on CUDA, routed experts
of the same forward steps). Per (rollout, trainer) cell, over all response tokens:

    token ESS, sequence ESS, mean |Δlogp|, max |Δlogp|, k3    rollmarket.observatory.dense
    router flip rate      share of (token, MoE layer) whose top-1 expert differs
    top-k overlap         mean |A ∩ B| / k over (token, layer)
    token disagreement    share of tokens whose top-k expert set differs at any layer

Random weights route almost uniformly and give near-uniform next-token distributions, so the
numbers measure the precision profiles' numerics on real shapes, not what a trained model's
confident distributions and peaked routers would show (those need trained weights).

    python benchmarks/moe_matrix_gpu.py --out /tmp/moe_matrix-cuda.json       # on one GPU
    python benchmarks/moe_matrix_gpu.py --device cpu --layers 2 --experts 8 --top-k 2 \\
        --hidden 64 --moe-intermediate 32 --heads 4 --kv-heads 2 --head-dim 16 --vocab 1000 \\
        --n 4 --tokens 16                                                      # a CPU smoke test
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from rollmarket.engines import RolloutEngine, SamplingParams, TrainerEngine
from rollmarket.engines.loading import LoadedModel, ModelInfo
from rollmarket.engines.precision import apply_precision, parse_precision
from rollmarket.engines.routing import moe_routers

ROOT = Path(__file__).resolve().parents[1]

# Settings: Qwen3-30B-A3B's layer (hidden 2048, 32 query / 4 key-value heads of 128, 128 experts of
# 768, top-8, vocabulary 151,936) with 8 of its 48 layers: 5.6B parameters, 22 GB at fp32.
DEFAULTS = dict(layers=8, hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8,
                moe_intermediate=768, vocab=151936, n=32, prompt=32, tokens=256, seed=0,
                rollouts="bf16,fp8", trainers="bf16,fp32")


def build_fp32(args, device: str) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        moe_intermediate_size=args.moe_intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
        decoder_sparse_step=1, tie_word_embeddings=False,
        max_position_embeddings=max(4096, args.prompt + args.tokens))
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(config)
    return model.float().eval()


def at_precision(base: torch.nn.Module, precision: str, device: str, keep_base: bool) -> LoadedModel:
    """A LoadedModel of ``base``'s weights at a profile: a copy, or ``base`` itself converted."""
    profile = parse_precision(precision)
    model = copy.deepcopy(base) if keep_base else base
    apply_precision(model, profile).eval()
    config = model.config
    routers = moe_routers(model)
    info = ModelInfo(path="", name="random-qwen3-moe", architecture="Qwen3MoeForCausalLM",
                     vocab_size=config.vocab_size, num_layers=config.num_hidden_layers,
                     num_moe_layers=len(routers), num_experts=config.num_experts,
                     top_k=config.num_experts_per_tok, checkpoint_digest="", tokenizer_hash="",
                     model_config_hash="", eos_token_ids=(0,),
                     max_context_tokens=config.max_position_embeddings)
    # No tokenizer exists for random weights: the engines need only a pad id (no stop strings).
    return LoadedModel(model=model, tokenizer=SimpleNamespace(pad_token_id=0), info=info,
                       precision=profile, device=torch.device(device))


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def router_stats(rollout_NLK: np.ndarray, trainer_NLK: np.ndarray) -> dict:
    k = rollout_NLK.shape[-1]
    flips_NL = rollout_NLK[..., 0] != trainer_NLK[..., 0]
    shared_NL = (rollout_NLK[..., :, None] == trainer_NLK[..., None, :]).any(-1).sum(-1)
    return {"router_flip_rate": float(flips_NL.mean()),
            "per_layer_flip_rate": [float(x) for x in flips_NL.mean(0)],
            "topk_overlap": float((shared_NL / k).mean()),
            "token_expert_disagreement_rate": float((shared_NL < k).any(-1).mean())}


def dense_stats(rollout_lps: list[np.ndarray], trainer_lps: list[np.ndarray]) -> dict:
    from rollmarket.observatory.dense import dense_summary, dense_summary_many

    pooled = dense_summary_many(rollout_lps, trainer_lps)
    per_sequence = [dense_summary(r, t).token_ess for r, t in zip(rollout_lps, trainer_lps)]
    return {"token_ess": pooled.token_ess, "sequence_ess": pooled.sequence_ess,
            "token_ess_per_sequence_mean": float(np.mean(per_sequence)),
            "mean_delta": pooled.mean_delta, "mean_abs_delta": pooled.mean_abs_delta,
            "max_abs_delta": pooled.max_abs_delta, "kl_k3": pooled.kl_k3,
            "mean_prob_diff": pooled.mean_prob_diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in DEFAULTS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "moe_matrix-cuda.json")
    args = parser.parse_args()
    device = args.device
    rollouts, trainers = args.rollouts.split(","), args.trainers.split(",")

    started = time.perf_counter()
    base = build_fp32(args, device)
    n_params = sum(p.numel() for p in base.parameters())
    print(f"built {n_params / 1e9:.2f}B parameters in {time.perf_counter() - started:.1f} s; "
          f"experts implementation {getattr(base.config, '_experts_implementation', None)}", flush=True)
    profiles = list(dict.fromkeys(rollouts + trainers))
    # fp32 last, so the other profiles are copied from it before it is handed over.
    profiles.sort(key=lambda p: p == "fp32")
    loaded = {p: at_precision(base, p, device, keep_base=(p != profiles[-1])) for p in profiles}
    del base

    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(3, args.vocab, size=args.prompt).tolist() for _ in range(args.n)]
    params = SamplingParams(temperature=1.0, max_tokens=args.tokens, seed=args.seed, ignore_eos=True)

    generations, timings = {}, {}
    for profile in rollouts:
        engine = RolloutEngine(loaded[profile])
        sync(device)
        t0 = time.perf_counter()
        generations[profile] = engine.generate(prompts, params)
        sync(device)
        timings[f"rollout_{profile}_s"] = time.perf_counter() - t0
        print(f"rollout {profile}: {args.n} × {args.tokens} tokens in "
              f"{timings[f'rollout_{profile}_s']:.1f} s", flush=True)

    cells = []
    for t_profile in trainers:
        trainer = TrainerEngine(loaded[t_profile])
        for r_profile in rollouts:
            gens = generations[r_profile]
            pairs = [(g.prompt_token_ids_P, g.token_ids_T) for g in gens]
            sync(device)
            t0 = time.perf_counter()
            try:
                scored = trainer.score_batch(pairs)
            except Exception as exc:  # a cell that fails (out of memory, say) is data, not a crash
                cells.append({"rollout": r_profile, "trainer": t_profile, "error": repr(exc)[:500]})
                print(f"{r_profile} → {t_profile}: {exc!r}", flush=True)
                continue
            sync(device)
            seconds = time.perf_counter() - t0
            cell = {"rollout": r_profile, "trainer": t_profile, "sequences": len(gens),
                    "tokens": int(sum(g.token_ids_T.size for g in gens)), "trainer_s": seconds,
                    "trainer_entropy_mean": float(np.mean(np.concatenate([s.entropies_T for s in scored])))}
            cell.update(dense_stats([g.logprobs_T for g in gens], [s.logprobs_T for s in scored]))
            cell.update(router_stats(np.concatenate([g.routed_experts_TLK for g in gens]),
                                     np.concatenate([s.routed_experts_TLK for s in scored])))
            cells.append(cell)
            print(json.dumps({k: v for k, v in cell.items() if k != "per_layer_flip_rate"}), flush=True)

    print(f"\n{'rollout':>7} {'trainer':>7} {'seqs':>5} {'tokens':>7} {'token ESS':>10} {'seq ESS':>8} "
          f"{'mean|Δ|':>9} {'max|Δ|':>8} {'flip rate':>9} {'top-k overlap':>13} {'tok disagree':>12}")
    for c in cells:
        if "error" in c:
            print(f"{c['rollout']:>7} {c['trainer']:>7} error: {c['error'][:100]}")
            continue
        print(f"{c['rollout']:>7} {c['trainer']:>7} {c['sequences']:>5} {c['tokens']:>7} "
              f"{c['token_ess']:>10.6f} {c['sequence_ess']:>8.4f} {c['mean_abs_delta']:>9.2e} "
              f"{c['max_abs_delta']:>8.3f} {c['router_flip_rate']:>9.4f} {c['topk_overlap']:>13.4f} "
              f"{c['token_expert_disagreement_rate']:>12.4f}")

    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else None,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "parameters": n_params, "settings": vars(args) | {"out": str(args.out)},
            "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "ignore_eos": True},
            "weights": "random (transformers init, seed above)", **timings}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "cells": cells}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
