"""The learner's training step: the chunked lm-head with its backward against the naive full logits,
and FSDP2 data parallelism on 1 vs N GPUs.

One GRPO step on a batch (ppo_clip, token-mean, per-sequence advantages ±1, π_old a little off the
policy, AdamW, gradient clipping), three ways:

    naive     the learner's former path: model(ids).logits.float()[:, :-1] / τ, log-softmax and
              gather for the logprobs, −Σ p·log p for the entropies: [batch, tokens, vocab] float32
              tensors exist and autograd keeps one for the backward
    chunked   the Learner's path (train/head.py ``policy_token_stats``): the body, then
              train/head.py's ChunkedHead on the response slots, forward and backward by chunks
    fsdp-N    chunked, with the model sharded by FSDP2 over N processes (one per GPU, NCCL; gloo on
              the CPU) as train/sharded.py does for the Learner; each rank takes 1/N of the batch's
              rows and the update is the whole batch's; run for N = 1 and --world-size

Weights are random ones of the shape (benchmarks/teacher_forcing.py builds them) at the device's
precision (bf16 on CUDA: parameters, gradients and AdamW's moments all bf16), with activation
checkpointing of the decoder layers on both paths (--no-checkpointing turns it off), so the body's
activations are small and alike on both and the step's peak is mostly the head's.

Each method runs in its own process. Peak memory is above what is held before a step (weights,
optimizer moments, inputs): torch.cuda.max_memory_allocated on CUDA, VmHWM on the CPU. Time is the
best of --repeats steps after a warm-up step (median in the JSON); FSDP time is rank 0's, between
barriers.

    python benchmarks/learner_step.py                                  # CPU: tiny-dense, 2 gloo ranks
    python benchmarks/learner_step.py --device cuda --world-size 2     # Qwen3-1.7B shape, 16k tokens
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from teacher_forcing import SHAPES, _build, _memory_reader, _meta

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SHAPE = {"cpu": "tiny-dense", "cuda": "qwen3-1.7b"}
DEFAULT_PRECISION = {"cpu": "fp32", "cuda": "bf16"}
TEMPERATURE = 0.8
"""Not 1, so the division by τ is in both paths as in a run that samples at τ."""
LAYOUTS = {
    "default": {},
    "root-kept": dict(reshard_root=False),
    "kept": dict(reshard_root=False, reshard_layers=False),
    "prefetch": dict(prefetch=1),
    "root-kept-prefetch": dict(reshard_root=False, prefetch=1),
    "kept-prefetch": "the learner's",
}
"""FSDP2 layouts an ``fsdp-N@<layout>`` row may name (engines.fsdp.ShardLayout's fields;
``kept-prefetch`` is engines.fsdp.KEPT_PREFETCH, the learner's own); a plain ``fsdp-N`` row is the
default layout."""


# ----------------------------------------------------------------------------- one step


def _inputs(shape: dict, vocab: int, device):
    """A GRPO batch: B sequences of `seq` tokens, loss on the response (after `prompt` tokens)."""
    import numpy as np
    import torch

    B, S, P = shape["tokens"] // shape["seq"], shape["seq"], shape["prompt"]
    rng = np.random.default_rng(0)
    ids_BS = torch.from_numpy(rng.integers(3, vocab, size=(B, S))).to(device)
    mask_BT = torch.zeros(B, S - 1, device=device)
    mask_BT[:, P - 1:] = 1.0
    advantages_B = torch.tensor([1.0 if b % 2 == 0 else -1.0 for b in range(B)], device=device)
    return ids_BS, torch.ones_like(ids_BS), mask_BT, advantages_B


def _stats_fn(method: str, model, chunk: int):
    """(ids, attention, mask_BT) → [B, T] logprobs (with grad) and entropies, the method's way."""
    import torch

    from rollmarket.train.head import policy_token_stats
    from rollmarket.train.losses import token_logprobs
    from rollmarket.train.sharded import TOKEN_STATS_METHOD
    from rollmarket.train.transforms import token_entropy

    def naive(ids_BS, attention_BS, mask_BT):
        logits_BTV = model(input_ids=ids_BS, attention_mask=attention_BS).logits.float()[:, :-1] / TEMPERATURE
        logprobs_BT = token_logprobs(logits_BTV, ids_BS[:, 1:])
        return logprobs_BT, token_entropy(logits_BTV)

    stats = getattr(model, TOKEN_STATS_METHOD, None) or (lambda *a: policy_token_stats(model, *a))

    def chunked(ids_BS, attention_BS, mask_BT):
        at_N = mask_BT.flatten().nonzero().squeeze(-1)
        logprobs_N, entropies_N = stats(ids_BS, attention_BS, at_N, TEMPERATURE, chunk)
        zeros = torch.zeros(mask_BT.numel(), device=mask_BT.device)
        return (zeros.index_put((at_N,), logprobs_N).view_as(mask_BT),
                zeros.index_put((at_N,), entropies_N.detach()).view_as(mask_BT))

    return naive if method == "naive" else chunked


def _stepper(method: str, model, ids_BS, attention_BS, mask_BT, advantages_B, chunk: int):
    """A function taking one optimizer step on the batch, and the π_old it starts from."""
    import torch

    from rollmarket.train.losses import LossConfig, policy_loss
    from rollmarket.train.sharded import full_value, global_loss_scale

    stats = _stats_fn(method, model, chunk)
    with torch.no_grad():
        old_BT = _stats_fn("chunked", model, chunk)(ids_BS, attention_BS, mask_BT)[0]
        old_BT += 0.05 * torch.randn_like(old_BT)  # a little off-policy, so the clip can bind
    adv_BT = advantages_B[:, None].expand_as(mask_BT)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    config = LossConfig()

    def step() -> float:
        logprobs_BT, _ = stats(ids_BS, attention_BS, mask_BT)
        loss, _ = policy_loss(logprobs_BT, old_BT, adv_BT, mask_BT, config)
        optimizer.zero_grad(set_to_none=True)
        (loss * global_loss_scale(float(mask_BT.sum()), mask_BT.device)).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return float(full_value(norm))

    return step


def _measure(step, device: str, repeats: int, barrier=lambda: None) -> dict:
    import torch

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        barrier()

    start_mem, peak_mem = _memory_reader(device)
    sync()
    started = time.perf_counter()
    grad_norm = step()  # warm-up: AdamW's moments exist from here on, as in a run
    sync()
    first = time.perf_counter() - started
    base = start_mem()
    step()
    peak = peak_mem()
    times = []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - started)
    seconds = min(times)
    return dict(first_step_s=first, seconds=seconds, seconds_median=statistics.median(times),
                steps_per_s=1 / seconds, peak_extra_bytes=peak - base, held_bytes=base,
                peak_total_bytes=peak, grad_norm=grad_norm)


def _head_only(method: str, model, mask_BT, device: str, chunk: int, repeats: int) -> dict:
    """The lm-head, the statistics and their backward alone, from random hidden states: each path
    on the slots it scores in the step (naive: every slot; chunked: the loss's)."""
    import torch

    from rollmarket.train.head import body_and_head, head_token_stats
    from rollmarket.train.losses import token_logprobs
    from rollmarket.train.transforms import token_entropy

    _, head = body_and_head(model)
    N = mask_BT.numel() if method == "naive" else int(mask_BT.sum())
    hidden_NH = torch.randn(N, head.weight.shape[1], dtype=head.weight.dtype, device=device, requires_grad=True)
    targets_N = torch.randint(0, head.weight.shape[0], (N,), device=device)

    def run() -> None:
        if method == "naive":
            logits_1NV = head(hidden_NH).float()[None] / TEMPERATURE
            logprobs_N, _ = token_logprobs(logits_1NV, targets_N[None])[0], token_entropy(logits_1NV)
            del logits_1NV
        else:
            logprobs_N, _ = head_token_stats(hidden_NH, head, targets_N, temperature=TEMPERATURE, chunk=chunk)
        logprobs_N.sum().backward()
        hidden_NH.grad = head.weight.grad = None

    measured = _measure(run, device, repeats)
    return {"head_seconds": measured["seconds"], "head_peak_extra_bytes": measured["peak_extra_bytes"]}


def _prepare(name: str, precision: str, device: str, tokens: int, checkpointing: bool):
    shape = dict(SHAPES[name], tokens=tokens or SHAPES[name]["tokens"])
    loaded = _build(shape, precision, device)
    model = loaded.model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return shape, loaded, model


def child(name: str, method: str, args) -> dict:
    """naive or chunked, in one process on one device."""
    import torch

    from rollmarket.train.head import CHUNK

    if args.device == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    shape, loaded, model = _prepare(name, args.precision, args.device, args.tokens, not args.no_checkpointing)
    ids_BS, attention_BS, mask_BT, advantages_B = _inputs(shape, loaded.info.vocab_size, args.device)
    chunk = args.chunk or CHUNK
    result = dict(shape=name, method=method, device=args.device, precision=args.precision,
                  batch=ids_BS.shape[0], seq=ids_BS.shape[1], tokens=ids_BS.numel(),
                  loss_tokens=int(mask_BT.sum()), vocab=loaded.info.vocab_size, world_size=1,
                  chunk=None if method == "naive" else chunk, checkpointing=not args.no_checkpointing)
    try:
        step = _stepper(method, model, ids_BS, attention_BS, mask_BT, advantages_B, chunk)
        result.update(_measure(step, args.device, args.repeats))
    except torch.OutOfMemoryError as exc:
        result["error"] = f"out of memory in the step: {str(exc).splitlines()[0]}"
    step = None  # frees AdamW's moments; the head alone is measured on the weights only
    model.zero_grad(set_to_none=True)
    try:
        result.update(_head_only(method, model, mask_BT, args.device, chunk, args.repeats))
    except torch.OutOfMemoryError as exc:
        result["head_error"] = f"out of memory in the head: {str(exc).splitlines()[0]}"
    return result


def _fsdp_rank(rank: int, world_size: int, port: int, name: str, args, out: str, layout: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rollmarket.engines.fsdp import KEPT_PREFETCH, ShardLayout
    from rollmarket.train.head import CHUNK, policy_token_stats
    from rollmarket.train.sharded import shard_policy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    cuda = args.device.startswith("cuda")
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    # A rank out of memory leaves its peer in a collective: the timeout ends the run instead of hanging.
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=args.timeout_s / 2),
                            **({"device_id": torch.device(device)} if cuda else {}))
    try:
        shape, loaded, model = _prepare(name, args.precision, device, args.tokens, not args.no_checkpointing)
        shard_policy(model, init_device_mesh("cuda" if cuda else "cpu", (world_size,)), policy_token_stats,
                     layout=KEPT_PREFETCH if layout == "kept-prefetch" else ShardLayout(**LAYOUTS[layout]))
        ids_BS, attention_BS, mask_BT, advantages_B = _inputs(shape, loaded.info.vocab_size, device)
        rows = slice(rank * len(ids_BS) // world_size, (rank + 1) * len(ids_BS) // world_size)
        chunk = args.chunk or CHUNK
        step = _stepper("chunked", model, ids_BS[rows], attention_BS[rows], mask_BT[rows], advantages_B[rows], chunk)
        result = dict(shape=name, method=f"fsdp-{world_size}" + ("" if layout == "default" else f"@{layout}"),
                      layout=layout, device=args.device, precision=args.precision,
                      batch=ids_BS.shape[0], seq=ids_BS.shape[1], tokens=ids_BS.numel(),
                      loss_tokens=int(mask_BT.sum()), vocab=loaded.info.vocab_size, world_size=world_size,
                      chunk=chunk, checkpointing=not args.no_checkpointing)
        try:
            result.update(_measure(step, device, args.repeats, barrier=dist.barrier))
        except torch.OutOfMemoryError as exc:
            result["error"] = f"out of memory: {str(exc).splitlines()[0]}"
        if rank == 0:
            Path(out).write_text(json.dumps(result))
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    os._exit(0)  # skip gloo's C++ teardown at exit (see engines/fsdp.py::_worker)


def fsdp_child(name: str, method: str, args) -> dict:
    import tempfile

    import torch

    from rollmarket.localhost import free_port

    with tempfile.TemporaryDirectory(prefix="learner-step-") as scratch:
        out = str(Path(scratch) / "rank0.json")
        ranks, _, layout = method.removeprefix("fsdp-").partition("@")
        torch.multiprocessing.spawn(_fsdp_rank, nprocs=int(ranks), join=True,
                                    args=(int(ranks), free_port(), name, args, out, layout or "default"))
        return json.loads(Path(out).read_text())


# ----------------------------------------------------------------------------- parent side


def _run_child(name: str, method: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", name, method, "--precision", args.precision,
           "--device", args.device, "--tokens", str(args.tokens), "--repeats", str(args.repeats),
           "--chunk", str(args.chunk), "--timeout-s", str(args.timeout_s)] + (
               ["--no-checkpointing"] if args.no_checkpointing else [])
    # Fewer false out-of-memory errors from fragmentation, on both paths alike.
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", **os.environ}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        return dict(shape=name, method=method, error=f"no result within {args.timeout_s:.0f} s")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return dict(shape=name, method=method, error=(proc.stderr or proc.stdout)[-2000:])
    return json.loads(lines[-1])


def compare(rows: dict[str, dict]) -> None:
    """Ratios, in place: chunked against naive (the step and the head alone, each where both were
    measured), fsdp-N's step rate against fsdp-1's and against chunked's (one GPU, no FSDP)."""
    naive, fsdp1, chunked = rows.get("naive", {}), rows.get("fsdp-1", {}), rows.get("chunked", {})
    for key, row in rows.items():
        if key.startswith("fsdp-"):
            if row is not fsdp1 and "steps_per_s" in row and "steps_per_s" in fsdp1:
                row["step_rate_vs_fsdp_1"] = row["steps_per_s"] / fsdp1["steps_per_s"]
            if "steps_per_s" in row and "steps_per_s" in chunked:  # one GPU without FSDP
                row["step_rate_vs_chunked"] = row["steps_per_s"] / chunked["steps_per_s"]
            continue
        if row is naive:
            continue
        if "seconds" in row and "seconds" in naive:
            row["peak_extra_ratio_vs_naive"] = row["peak_extra_bytes"] / naive["peak_extra_bytes"]
            row["peak_total_ratio_vs_naive"] = row["peak_total_bytes"] / naive["peak_total_bytes"]
            row["speedup_vs_naive"] = naive["seconds"] / row["seconds"]
        if "head_seconds" in row and "head_seconds" in naive:
            row["head_peak_ratio_vs_naive"] = row["head_peak_extra_bytes"] / naive["head_peak_extra_bytes"]
            row["head_speedup_vs_naive"] = naive["head_seconds"] / row["head_seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda.")
    parser.add_argument("--shape", default=None, help=f"From {', '.join(SHAPES)}. Default: "
                        f"{DEFAULT_SHAPE['cpu']} on cpu, {DEFAULT_SHAPE['cuda']} on cuda.")
    parser.add_argument("--precision", default=None, help="Default: fp32 on cpu, bf16 on cuda.")
    parser.add_argument("--tokens", type=int, default=0, help="Tokens per batch; 0 = the shape's.")
    parser.add_argument("--chunk", type=int, default=0, help="Positions per lm-head chunk; 0 = the learner's.")
    parser.add_argument("--repeats", type=int, default=3, help="Timed steps per method (best of).")
    parser.add_argument("--world-size", type=int, default=2, help="FSDP ranks of the fsdp-N row (0: no FSDP rows).")
    parser.add_argument("--methods", default="naive,chunked", help="Comma-separated single-process methods.")
    parser.add_argument("--layouts", default="default",
                        help=f"FSDP layouts of the fsdp-N rows, comma-separated, from {', '.join(LAYOUTS)}.")
    parser.add_argument("--no-checkpointing", action="store_true", help="Keep every layer's activations.")
    parser.add_argument("--timeout-s", type=float, default=240.0,
                        help="Longest wait for one method's process; its row then says so and the others still run.")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON output. Default: benchmarks/results/learner_step-<device>.json.")
    parser.add_argument("--child", nargs=2, metavar=("SHAPE", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    args.precision = args.precision or DEFAULT_PRECISION[kind]
    name = args.shape or DEFAULT_SHAPE[kind]
    if name not in SHAPES:
        parser.error(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")

    if args.child:
        shape, method = args.child
        res = fsdp_child(shape, method, args) if method.startswith("fsdp-") else child(
            shape, method, args)
        print(json.dumps(res))
        return

    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 150))
    methods = [m for m in args.methods.split(",") if m]
    if any(m not in ("naive", "chunked") for m in methods):
        parser.error(f"unknown method in {methods}; choose from naive, chunked")
    layouts = [x for x in args.layouts.split(",") if x]
    if any(x not in LAYOUTS for x in layouts):
        parser.error(f"unknown layout in {layouts}; choose from {', '.join(LAYOUTS)}")
    if args.world_size:
        methods += ["fsdp-1"]
        if args.world_size > 1:
            methods += [f"fsdp-{args.world_size}" + ("" if x == "default" else f"@{x}") for x in layouts]
    rows = {}
    for method in methods:
        console.log(f"{name} / {method} on {args.device} at {args.precision}")
        rows[method] = _run_child(name, method, args)
    compare(rows)

    table = Table(title=f"Learner step on {args.device} at {args.precision}, shape {name}")
    for col in ("method", "ranks", "chunk", "batch×seq", "step s", "steps/s", "held GiB", "peak extra GiB",
                "peak extra vs naive", "peak total vs naive", "speed vs naive", "head GiB",
                "head peak vs naive", "head speed vs naive", "rate vs fsdp-1", "rate vs chunked"):
        table.add_column(col, justify="left" if col == "method" else "right")

    def x(value, digits=2) -> str:
        return "" if value is None else f"{value:.{digits}f}x"

    def gib(key: str) -> str:
        return "" if key not in row else f"{row[key] / 2**30:.2f}"

    for method, row in rows.items():
        if "seconds" in row:
            step = [f"{row['seconds']:.3f}", f"{row['steps_per_s']:.2f}", gib("held_bytes"), gib("peak_extra_bytes"),
                    x(row.get("peak_extra_ratio_vs_naive"), 3), x(row.get("peak_total_ratio_vs_naive"), 3),
                    x(row.get("speedup_vs_naive"))]
        else:
            step = ["error: " + row.get("error", "")[-80:], "", "", "", "", "", ""]
        table.add_row(method, str(row.get("world_size", "")), str(row.get("chunk") or ""),
                      f"{row['batch']}×{row['seq']}" if "batch" in row else "", *step,
                      gib("head_peak_extra_bytes") or row.get("head_error", "")[-40:],
                      x(row.get("head_peak_ratio_vs_naive"), 3), x(row.get("head_speedup_vs_naive")),
                      x(row.get("step_rate_vs_fsdp_1")), x(row.get("step_rate_vs_chunked")))
    console.print(table)
    out = args.out or ROOT / "benchmarks" / "results" / f"learner_step-{kind}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": _meta(args, kind), "results": list(rows.values())}, indent=2) + "\n")
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
