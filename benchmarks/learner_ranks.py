"""The trainer loop's learner over 1 and N ranks (``trainer.learner_ranks``, train/ranks.py): what a
run pays per phase, and whether N ranks write the checkpoint one rank writes.

Each row is one process that opens the loop's learner exactly as `rollmarket train` does
(``ranks.learner_ranks``: rank 0 here, ranks 1…N−1 spawned, NCCL with one GPU per rank on CUDA, gloo
on the CPU) and runs, on one seeded batch: π_old scoring of every sequence (``score``, twice: the
first call includes the compile of the single-process engine's CUDA body; FSDP scores eager), ``--steps``
optimizer steps (``step``: the rows dealt over the ranks) and a checkpoint (``save``: weights and
AdamW state gathered to rank 0, which writes them). Times are rank 0's wall clock per call (each
call ends in a host copy, so the device work is done); the step time is the best of the steps after
the first, the median beside it. The N-rank checkpoint is then compared with the 1-rank one: the
largest |Δ| over the weights, and the share of elements within 1e-5.

The model is float32 master weights (the Learner's), random ones of the shape
(benchmarks/teacher_forcing.py's SHAPES; tiny-dense is the shipped model), with activation
checkpointing.

    python benchmarks/learner_ranks.py                                   # CPU: tiny-dense, 2 gloo ranks
    python benchmarks/learner_ranks.py --device cuda --ranks 2           # 2 GPUs: Qwen3-0.6B shape, NCCL
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from teacher_forcing import SHAPES, _meta

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SHAPE = {"cpu": "tiny-dense", "cuda": "qwen3-0.6b"}
DEFAULT_TOKENS = {"cpu": 2048, "cuda": 8192}
SEQ = {"cpu": 256, "cuda": 1024}
TOKENIZER_FROM = ROOT / "models" / "tiny-dense"
"""Random-weight shapes borrow this tokenizer: the learner needs one (the pad id), the ids are random."""


def model_dir(name: str, scratch: Path) -> Path:
    """The shape's model directory: the shipped one, or random float32 weights of the shape saved there."""
    shape = SHAPES[name]
    if "path" in shape:
        return ROOT / shape["path"]
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    target = scratch / name
    config = Qwen3Config(**shape["config"], tie_word_embeddings=True, max_position_embeddings=4096,
                         eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(target)
    for item in TOKENIZER_FROM.glob("tokenizer*"):
        shutil.copy2(item, target / item.name)
    return target


def batch(vocab: int, tokens: int, seq: int):
    """(pairs, advantages): tokens // seq sequences of `seq` tokens, an eighth of each the prompt."""
    import numpy as np

    rng = np.random.default_rng(0)
    prompt = seq // 8
    pairs = [(rng.integers(3, vocab, prompt), rng.integers(3, vocab, seq - prompt)) for _ in range(tokens // seq)]
    return pairs, [1.0 if i % 2 == 0 else -1.0 for i in range(len(pairs))]


def child(args) -> dict:
    """One row: open the learner over --ranks, score, step, save; rank 0's times."""
    import numpy as np

    from rollmarket.train.batch import Datum
    from rollmarket.train.config import resolve
    from rollmarket.train.ranks import learner_ranks

    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    config = resolve(None, [f"model.path={json.dumps(args.model)}", f"model.device={json.dumps(args.device)}",
                            f"trainer.learner_ranks={args.ranks}", "trainer.activation_checkpointing=true",
                            "optim.lr=1e-5", f"model.threads={max(1, (os.cpu_count() or 1) // args.ranks)}"])
    result = dict(ranks=args.ranks, device=args.device, model=args.shape, tokens=args.tokens, seq=SEQ[kind])
    started = time.perf_counter()
    with learner_ranks(config) as learner:
        result["open_s"] = time.perf_counter() - started
        pairs, advantages = batch(learner.loaded.info.vocab_size, args.tokens, SEQ[kind])
        for key in ("first_score_s", "score_s"):  # the first call includes any compile (1 rank on CUDA)
            t0 = time.perf_counter()
            scored = learner.score(pairs, temperature=1.0)
            result[key] = time.perf_counter() - t0
        rng = np.random.default_rng(1)
        data = [Datum(p, r, s.logprobs_T + rng.normal(0, 0.05, len(r)).astype(np.float32),
                      np.ones(len(r), np.float32), advantage=a, old_logprobs_T=s.logprobs_T)
                for (p, r), s, a in zip(pairs, scored, advantages)]
        steps, norms = [], []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            metrics = learner.step(data, temperature=1.0)
            steps.append(time.perf_counter() - t0)
            norms.append(metrics["actor/grad_norm"])
        t0 = time.perf_counter()
        learner.save(Path(args.checkpoint), version=args.steps, extra_state={"step": args.steps})
        result["save_s"] = time.perf_counter() - t0
    timed = steps[1:] or steps
    result.update(first_step_s=steps[0], step_s=min(timed), step_s_median=statistics.median(timed),
                  grad_norms=norms, sequences=len(pairs), total_s=time.perf_counter() - started)
    return result


def compare_checkpoints(got: Path, want: Path) -> dict:
    """The largest |Δ| over the weights of two checkpoints, and the share of elements within 1e-5."""
    from safetensors.torch import load_file

    a, b = load_file(got / "model.safetensors"), load_file(want / "model.safetensors")
    if a.keys() != b.keys():
        return {"same_names": False}
    worst, close, total = 0.0, 0, 0
    for name, tensor in b.items():
        delta = (a[name].double() - tensor.double()).abs()
        worst = max(worst, float(delta.max()))
        close += int((delta <= 1e-5).sum())
        total += delta.numel()
    files = lambda root: sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())  # noqa: E731
    return {"same_names": True, "same_files": files(got) == files(want), "max_abs_weight_diff": worst,
            "share_within_1e-5": close / total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (rank i on cuda:i).")
    parser.add_argument("--ranks", type=int, default=2, help="Ranks of the second row (the first has 1).")
    parser.add_argument("--shape", default=None, help=f"From {', '.join(SHAPES)}. Default: "
                        f"{DEFAULT_SHAPE['cpu']} on cpu, {DEFAULT_SHAPE['cuda']} on cuda.")
    parser.add_argument("--tokens", type=int, default=0, help="Tokens per batch; 0: 2048 on cpu, 8192 on cuda.")
    parser.add_argument("--steps", type=int, default=3, help="Optimizer steps per row.")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="Longest wait for one row's process.")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON output. Default: benchmarks/results/learner_ranks-<device>.json.")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    args.shape = args.shape or DEFAULT_SHAPE[kind]
    args.tokens = args.tokens or DEFAULT_TOKENS[kind]
    if args.shape not in SHAPES:
        parser.error(f"unknown shape {args.shape!r}; choose from {', '.join(SHAPES)}")
    if args.child:
        print(json.dumps(child(args)))
        return

    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 120))
    rows = []
    with tempfile.TemporaryDirectory(prefix="learner-ranks-") as scratch:
        model = model_dir(args.shape, Path(scratch))
        for ranks in (1, args.ranks):
            console.log(f"{args.shape}: learner over {ranks} rank(s) on {args.device}")
            checkpoint = Path(scratch) / f"ranks{ranks}" / "v0001"
            cmd = [sys.executable, __file__, "--child", "--device", args.device, "--ranks", str(ranks),
                   "--shape", args.shape, "--tokens", str(args.tokens), "--steps", str(args.steps),
                   "--model", str(model), "--checkpoint", str(checkpoint)]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
                lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
                row = json.loads(lines[-1]) if proc.returncode == 0 and lines else dict(
                    ranks=ranks, error=(proc.stderr or proc.stdout)[-2000:])
            except subprocess.TimeoutExpired:
                row = dict(ranks=ranks, error=f"no result within {args.timeout_s:.0f} s")
            if "error" not in row and ranks != 1 and "error" not in rows[0]:
                row.update(compare_checkpoints(checkpoint, Path(scratch) / "ranks1" / "v0001"))
                row["step_rate_vs_1_rank"] = rows[0]["step_s"] / row["step_s"]
            rows.append(row)

    table = Table(title=f"Learner ranks on {args.device}, shape {args.shape}, {args.tokens} tokens a step")
    for col in ("ranks", "open s", "score s", "first step s", "step s", "save s", "step rate vs 1 rank",
                "max |Δw| vs 1 rank", "within 1e-5"):
        table.add_column(col, justify="right")
    for row in rows:
        if "error" in row:
            table.add_row(str(row["ranks"]), "error: " + row["error"][-100:], *[""] * 7)
            continue
        table.add_row(str(row["ranks"]), f"{row['open_s']:.1f}", f"{row['score_s']:.3f}", f"{row['first_step_s']:.3f}",
                      f"{row['step_s']:.3f}", f"{row['save_s']:.2f}",
                      f"{row['step_rate_vs_1_rank']:.2f}x" if "step_rate_vs_1_rank" in row else "",
                      f"{row['max_abs_weight_diff']:.1e}" if "max_abs_weight_diff" in row else "",
                      f"{row['share_within_1e-5']:.4f}" if "share_within_1e-5" in row else "")
    console.print(table)
    out = args.out or ROOT / "benchmarks" / "results" / f"learner_ranks-{kind}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = _meta(argparse.Namespace(device=args.device, precision="fp32"), kind)
    out.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
