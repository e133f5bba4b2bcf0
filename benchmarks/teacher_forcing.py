"""Teacher forcing: the trainer engine (chunked lm-head) against the naive full-logits path.

For one batch of (prompt, response) pairs, two ways to get every response token's logprob:

    engine   TrainerEngine.score_batch: model body once, then lm-head + log-softmax over 1024
             positions at a time (also returns entropies and routed experts)
    naive    model(ids).logits.float().log_softmax(-1), then gather the targets: the whole
             [tokens x vocab] float32 matrix, and its log-softmax, exist at once

Each (shape, method) runs in its own child process so peak memory is its own: on CUDA,
torch.cuda.max_memory_allocated above what the weights and inputs hold; on the CPU, the kernel's
peak resident set (VmHWM, reset through /proc/self/clear_refs) above the resident set before the
call (tracemalloc does not see torch's allocations). Time is the best of --repeats runs after a
warm-up (the median is in the JSON too). The two methods' logprobs are compared (max |Δ|) as a check that both compute the same
thing. Shapes with a path use those weights; the others are random-weight Qwen3 models of that
shape, built in the child (only torch, transformers and rollmarket are needed).

    python benchmarks/teacher_forcing.py                       # CPU: tiny models + a big-vocab shape
    python benchmarks/teacher_forcing.py --device cuda         # Qwen3-0.6B and 1.7B shapes, bf16, 16k tokens
    python benchmarks/teacher_forcing.py --device cuda --shapes qwen3-1.7b --tokens 32768
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QWEN3_VOCAB = 151936

# Shapes: a model (a path, or a Qwen3 config for random weights) and a batch (total tokens,
# tokens per sequence, prompt tokens per sequence). Qwen3 configs follow the published ones.
SHAPES: dict[str, dict] = {
    "tiny-dense": dict(path="models/tiny-dense", tokens=2048, seq=512, prompt=64),
    "tiny-moe": dict(path="models/tiny-moe", tokens=2048, seq=512, prompt=64),
    "bigvocab": dict(config=dict(vocab_size=QWEN3_VOCAB, hidden_size=512, intermediate_size=1536,
                                 num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                                 head_dim=64),
                     tokens=4096, seq=512, prompt=64),
    "qwen3-0.6b": dict(config=dict(vocab_size=QWEN3_VOCAB, hidden_size=1024, intermediate_size=3072,
                                   num_hidden_layers=28, num_attention_heads=16,
                                   num_key_value_heads=8, head_dim=128),
                       tokens=16384, seq=2048, prompt=256),
    "qwen3-1.7b": dict(config=dict(vocab_size=QWEN3_VOCAB, hidden_size=2048, intermediate_size=6144,
                                   num_hidden_layers=28, num_attention_heads=16,
                                   num_key_value_heads=8, head_dim=128),
                       tokens=16384, seq=2048, prompt=256),
    "qwen3-4b": dict(config=dict(vocab_size=QWEN3_VOCAB, hidden_size=2560, intermediate_size=9728,
                                 num_hidden_layers=36, num_attention_heads=32,
                                 num_key_value_heads=8, head_dim=128),
                     tokens=16384, seq=2048, prompt=256),
}
DEFAULT_SHAPES = {"cpu": "tiny-dense,tiny-moe,bigvocab", "cuda": "qwen3-0.6b,qwen3-1.7b,qwen3-4b"}
DEFAULT_PRECISION = {"cpu": "fp32", "cuda": "bf16"}
METHODS = ("engine", "naive")
SAMPLE = 512  # logprobs each child returns for the cross-check


# ----------------------------------------------------------------------------- child side


def _build(shape: dict, precision: str, device: str):
    import torch

    from rollmarket.engines.loading import LoadedModel, ModelInfo, load_model
    from rollmarket.engines.precision import apply_precision, parse_precision

    if "path" in shape:
        return load_model(ROOT / shape["path"], precision, device)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    profile = parse_precision(precision)
    config = Qwen3Config(**shape["config"], tie_word_embeddings=True,
                         max_position_embeddings=max(4096, shape["seq"]))
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    apply_precision(model, profile).eval()
    info = ModelInfo(path="", name="random", architecture="Qwen3ForCausalLM",
                     vocab_size=config.vocab_size, num_layers=config.num_hidden_layers,
                     num_moe_layers=0, num_experts=0, top_k=0, checkpoint_digest="",
                     tokenizer_hash="", model_config_hash="", eos_token_ids=(0,),
                     max_context_tokens=config.max_position_embeddings)
    return LoadedModel(model=model, tokenizer=None, info=info, precision=profile,
                       device=torch.device(device))


def _memory_reader(device: str):
    """(start, peak_above_start): a pair of callables around the measured call."""
    import torch

    if device.startswith("cuda"):
        def start() -> int:
            torch.cuda.synchronize()
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated()

        def peak() -> int:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        return start, peak

    def status(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no {field} in /proc/self/status")

    def start_cpu() -> int:
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return status("VmRSS")

    return start_cpu, lambda: status("VmHWM")


def child(name: str, method: str, precision: str, device: str, tokens: int, repeats: int) -> dict:
    import numpy as np
    import torch

    from rollmarket.engines import TrainerEngine

    shape = dict(SHAPES[name], tokens=tokens or SHAPES[name]["tokens"])
    if device == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    loaded = _build(shape, precision, device)
    model, vocab = loaded.model, loaded.info.vocab_size
    B, S, P = shape["tokens"] // shape["seq"], shape["seq"], shape["prompt"]
    rng = np.random.default_rng(0)
    ids_BS = rng.integers(3, vocab, size=(B, S))
    pairs = [(row[:P], row[P:]) for row in ids_BS]
    ids_dev_BS = torch.from_numpy(ids_BS).to(device)
    engine = TrainerEngine(loaded)

    @torch.no_grad()
    def run_engine() -> np.ndarray:
        return engine.score_batch(pairs)[0].logprobs_T

    @torch.no_grad()
    def run_naive() -> np.ndarray:
        logp_BSV = model(input_ids=ids_dev_BS).logits.float().log_softmax(-1)
        targets_BT = ids_dev_BS[:, P:]
        logprobs_BT = logp_BSV[:, P - 1:-1].gather(-1, targets_BT[..., None]).squeeze(-1)
        return logprobs_BT[0].cpu().numpy()

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    run = run_engine if method == "engine" else run_naive
    start_mem, peak_mem = _memory_reader(device)
    result = dict(shape=name, method=method, device=device, precision=precision, batch=B, seq=S,
                  prompt=P, tokens=B * S, scored_tokens=B * (S - P), vocab=vocab)
    try:
        sample = run()[:SAMPLE]
        base = start_mem()
        run()
        peak = peak_mem()
        times = []
        for _ in range(repeats):
            sync()
            started = time.perf_counter()
            run()
            sync()
            times.append(time.perf_counter() - started)
    except torch.OutOfMemoryError as exc:
        return dict(result, error=f"out of memory: {str(exc).splitlines()[0]}")
    # Best of the repeats: on a shared machine the minimum is the run least disturbed by others.
    seconds = min(times)
    return dict(result, seconds=seconds, seconds_median=statistics.median(times),
                tokens_per_s=B * S / seconds, peak_extra_bytes=peak - base,
                peak_total_bytes=peak, logprobs_sample=[float(x) for x in sample])


# ----------------------------------------------------------------------------- parent side


def _run_child(name: str, method: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", name, method, "--precision", args.precision,
           "--device", args.device, "--tokens", str(args.tokens), "--repeats", str(args.repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return dict(shape=name, method=method, error=(proc.stderr or proc.stdout)[-2000:])
    return json.loads(lines[-1])


def _gb(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (one GPU).")
    parser.add_argument("--shapes", default=None,
                        help=f"Comma-separated, from {', '.join(SHAPES)}. Default: "
                             f"{DEFAULT_SHAPES['cpu']} on cpu, {DEFAULT_SHAPES['cuda']} on cuda.")
    parser.add_argument("--precision", default=None,
                        help="fp32, bf16, fp16 or fp8. Default: fp32 on cpu, bf16 on cuda.")
    parser.add_argument("--tokens", type=int, default=0,
                        help="Tokens per batch (prompt + response, all sequences); 0 = the shape's.")
    parser.add_argument("--repeats", type=int, default=5, help="Timed runs per case (best of).")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON output. Default: benchmarks/results/teacher_forcing-<device>.json.")
    parser.add_argument("--child", nargs=2, metavar=("SHAPE", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    args.precision = args.precision or DEFAULT_PRECISION[kind]

    if args.child:
        print(json.dumps(child(*args.child, args.precision, args.device, args.tokens, args.repeats)))
        return

    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 140))
    names = (args.shapes or DEFAULT_SHAPES[kind]).split(",")
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        parser.error(f"unknown shape(s) {unknown}; choose from {', '.join(SHAPES)}")
    results = []
    for name in names:
        rows = {}
        for method in METHODS:
            console.log(f"{name} / {method} on {args.device} at {args.precision}")
            rows[method] = _run_child(name, method, args)
        engine, naive = rows["engine"], rows["naive"]
        if "error" not in engine and "error" not in naive:
            import numpy as np

            engine["max_abs_diff_vs_naive"] = float(np.max(np.abs(
                np.asarray(engine["logprobs_sample"]) - np.asarray(naive["logprobs_sample"]))))
            engine["speedup_vs_naive"] = engine["tokens_per_s"] / naive["tokens_per_s"]
            engine["peak_extra_ratio_vs_naive"] = engine["peak_extra_bytes"] / naive["peak_extra_bytes"]
        for row in rows.values():
            row.pop("logprobs_sample", None)
            results.append(row)

    table = Table(title=f"Teacher forcing on {args.device} at {args.precision}")
    for col in ("shape", "method", "batch×seq", "vocab", "tokens/s", "peak extra GiB",
                "peak total GiB", "engine/naive speed", "engine/naive peak", "max |Δ|"):
        table.add_column(col, justify="left" if col in ("shape", "method") else "right")
    for row in results:
        if "error" in row:
            table.add_row(row["shape"], row["method"], "", "", "error: " + row["error"][-60:])
            continue
        engine = row["method"] == "engine"
        table.add_row(
            row["shape"], row["method"], f"{row['batch']}×{row['seq']}", str(row["vocab"]),
            f"{row['tokens_per_s']:,.0f}", _gb(row["peak_extra_bytes"]), _gb(row["peak_total_bytes"]),
            f"{row['speedup_vs_naive']:.2f}x" if engine and "speedup_vs_naive" in row else "",
            f"{row['peak_extra_ratio_vs_naive']:.3f}x" if engine and "peak_extra_ratio_vs_naive" in row else "",
            f"{row['max_abs_diff_vs_naive']:.1e}" if engine and "max_abs_diff_vs_naive" in row else "")
    console.print(table)

    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "command": " ".join(sys.argv), "device": args.device, "precision": args.precision}
    if kind == "cuda":
        import torch

        meta["gpu"] = torch.cuda.get_device_name(0)
    meta["torch"] = __import__("torch").__version__
    meta["transformers"] = __import__("transformers").__version__
    out = args.out or ROOT / "benchmarks" / "results" / f"teacher_forcing-{kind}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
