"""Where a decode step's time goes: the GPU's kernels against the step's wall time.

The model server's decode step (``DecodeSession.step``: sample a token for every running row,
then one forward of the model over them with the KV cache) is timed, then run once more under
``torch.profiler``: the sum of its GPU kernels' times and how many kernels it launched. A step
whose wall time is many times its kernel time is bound by the host, not by the GPU, and a CUDA
graph of the step (one launch, fixed shapes) could take it down to about the kernel time. This is
the measurement behind issue 18's open server goal (docs/benchmarks.md, "Where a decode step's
time goes").

Every session is run twice in one process: the first pass meets each KV-cache length for the first
time in the process, the second meets the same lengths again. The first run on the device (an
earlier version, one pass) found steps of 70–130 ms where serve_throughput's warmed-up split had
5–46 ms, for 0.4–4 ms of kernels: a cost per new shape is the suspect, and the two passes
measure it.

    python benchmarks/decode_profile.py --device cuda          # tiny-dense and the Qwen3-0.6B shape
    python benchmarks/decode_profile.py                        # tiny-dense on the CPU (no kernels: wall only)

Each pass of each (model, batch) runs ``--warm`` steps, then ``--steps`` timed steps (median
wall); the last session then runs ``--steps`` profiled steps. Rows start from one shared prompt
with their own seeds and ``ignore_eos``, as in benchmarks/serve_throughput.py.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from _result import write_result

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
console = Console()
MESSAGES = [{"role": "user", "content": "Count from one to ten in words, then say done."}]
SDPA_NAMES = ("math", "efficient", "cudnn")
"""The attention kernels that take a mask (the decode's padded batch has one); flash does not."""


def profile_steps(session, steps: int, device: str) -> dict:
    """The GPU kernels of ``steps`` decode steps: their summed time and count, per step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if not device.startswith("cuda"):
        return {"kernel_ms": None, "kernels_per_step": None}
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            session.step()
        torch.cuda.synchronize()
    total_us, launches = 0.0, 0
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        if us > 0:
            total_us += us
            launches += event.count
    return {"kernel_ms": total_us / 1e3 / steps, "kernels_per_step": launches / steps}


def measure(model: Path, name: str, args) -> list[dict]:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    SDPA_BACKENDS = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                     "cudnn": SDPBackend.CUDNN_ATTENTION}

    from rollmarket.engines import RolloutEngine
    from rollmarket.engines.loading import load_model

    loaded = load_model(model, args.precision, args.device)
    engines = {kv: RolloutEngine(loaded, kv="padded" if kv == "padded" else "slots", graphs=kv == "graphs")
               for kv in args.kv}
    prompt = next(iter(engines.values())).encode_chat(MESSAGES)
    rows = []

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def timed_steps(session, count: int) -> list[float]:
        walls = []
        for _ in range(count):
            sync()
            started = time.perf_counter()
            session.step()
            sync()
            walls.append(1000 * (time.perf_counter() - started))
        return walls

    for kv, engine in engines.items():
        for sdpa in args.sdpa:
            # SDPA's choice of attention kernel for the decode's masked attention, or one pinned.
            pinned = contextlib.nullcontext() if sdpa == "default" else sdpa_kernel([SDPA_BACKENDS[sdpa]])
            with pinned:
                for batch in args.batches:
                    rows += measure_case(engine, prompt, name, kv, sdpa, batch, args, timed_steps)
    del engines, loaded
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows


def measure_case(engine, prompt: list[int], name: str, kv: str, sdpa: str, batch: int, args, timed_steps) -> list[dict]:
    from rollmarket.engines import SamplingParams

    total = args.warm + 2 * args.steps + 1
    params = [SamplingParams(temperature=1.0, max_tokens=total, seed=s, ignore_eos=True) for s in range(batch)]
    # The same session twice: the first pass meets every cache length for the first time in this
    # process (with this kernel choice), the second meets them again (whatever the host sets up
    # per new shape, it has then done). Graphs are captured during the warm steps.
    passes = []
    try:
        for _ in range(2):
            session = engine.session()
            session.add([prompt] * batch, params)
            warm = timed_steps(session, args.warm)
            passes.append((warm, timed_steps(session, args.steps)))
    except RuntimeError as exc:  # a pinned kernel that cannot take a masked decode
        console.print(f"  {name} {kv} batch {batch:>3} sdpa {sdpa}: {str(exc)[:120]}")
        return [{"model": name, "kv": kv, "batch": batch, "sdpa": sdpa, "error": str(exc)[:300]}]
    (warm, walls), (warm_again, walls_again) = passes
    row = {"model": name, "kv": kv, "batch": batch, "sdpa": sdpa, "steps": args.steps, "warm": args.warm,
           "wall_ms": statistics.median(walls), "wall_ms_runs": walls, "warm_ms_runs": warm,
           "wall_ms_again": statistics.median(walls_again), "wall_ms_runs_again": walls_again,
           "warm_ms_runs_again": warm_again, **profile_steps(session, args.steps, args.device)}
    console.print(f"  {name} {kv} batch {batch:>3} sdpa {sdpa}: {row['wall_ms']:.2f} ms a step, "
                  f"{row['wall_ms_again']:.2f} ms the second time"
                  + (f", {row['kernel_ms']:.2f} ms of kernels ({row['kernels_per_step']:.0f} launches)"
                     if row["kernel_ms"] else ""))
    return [row]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default=None, help="Default: bf16 on CUDA, fp32 on the CPU.")
    parser.add_argument("--models", default="tiny-dense", help="Shipped models (comma-separated).")
    parser.add_argument("--shapes", default=None,
                        help="Random-weight Qwen3 shapes (default on CUDA: qwen3-0.6b; none on the CPU).")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--warm", type=int, default=8, help="Steps of each pass before the timed ones.")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU (see serve_throughput).")
    parser.add_argument("--sdpa", default="default",
                        help="Attention kernels to pin for the decode, comma-separated: default (SDPA's own "
                             f"choice), {', '.join(SDPA_NAMES)}.")
    parser.add_argument("--kv", default="padded,slots",
                        help="Decode KV caches, comma-separated: padded (DynamicCache), slots (eager), graphs "
                             "(slots replayed as CUDA graphs).")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    args.precision = args.precision or ("bf16" if cuda else "fp32")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.sdpa = [s for s in args.sdpa.split(",") if s]
    args.kv = [k for k in args.kv.split(",") if k]
    if set(args.kv) - {"padded", "slots", "graphs"}:
        parser.error(f"unknown --kv {sorted(set(args.kv) - {'padded', 'slots', 'graphs'})}: use padded, slots, graphs")
    unknown = set(args.sdpa) - {"default", *SDPA_NAMES}
    if unknown:
        parser.error(f"unknown --sdpa {sorted(unknown)}: use default or {', '.join(SDPA_NAMES)}")
    shapes = [s for s in (args.shapes if args.shapes is not None else ("qwen3-0.6b" if cuda else "")).split(",") if s]
    args.out = args.out or REPO / "benchmarks" / "results" / f"decode_profile{'-cuda' if cuda else ''}.json"

    import torch

    if not cuda:
        torch.set_num_threads(args.threads)
    from serve_throughput import materialise

    rows = []
    for name in [m for m in args.models.split(",") if m]:
        rows += measure(REPO / "models" / name, name, args)
    with tempfile.TemporaryDirectory() as folder:
        for shape in shapes:
            rows += measure(materialise(shape, args, Path(folder)), shape, args)

    table = Table(title=f"One decode step on {args.device} at {args.precision}: wall against kernels")
    for column in ("model", "kv", "attention", "batch", "wall ms", "again", "kernel ms", "launches", "again ÷ kernels"):
        table.add_column(column, justify="left" if column in ("model", "kv", "attention") else "right")
    for r in rows:
        if "error" in r:
            table.add_row(r["model"], r["kv"], r["sdpa"], str(r["batch"]), "failed", r["error"][:40], "", "", "")
            continue
        table.add_row(r["model"], r["kv"], r["sdpa"], str(r["batch"]), f"{r['wall_ms']:.2f}", f"{r['wall_ms_again']:.2f}",
                      f"{r['kernel_ms']:.2f}" if r["kernel_ms"] else "-",
                      f"{r['kernels_per_step']:.0f}" if r["kernels_per_step"] else "-",
                      f"{r['wall_ms_again'] / r['kernel_ms']:.1f}x" if r["kernel_ms"] else "-")
    console.print(table)
    machine = {"torch": f"torch {torch.__version__}"}
    if cuda:
        machine["gpu"] = torch.cuda.get_device_name()
    write_result(args.out, "decode_profile", args, rows, machine=machine)
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
