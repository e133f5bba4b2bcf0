"""The server's `Batcher` under sustained load with no HTTP: where does serve-model's slower decode
step come from?

`serve_sustained.py` showed serve-model's decode steps on tiny-moe (eager MoE) at 20–25 ms under a
closed loop of 32 streams, against ~9–14 ms for the same requests on a `DecodeSession` driven
directly, whether the server decodes in its HTTP process or in an engine process. This drives the
server's own `Batcher` (its decode thread, its join rule, its hand-over to an event loop) with the
same closed loop from an asyncio loop in this process — no HTTP, no sockets — in four conditions:

- ``plain``: the batcher alone;
- ``gc frozen``: after ``gc.freeze()``, as serve-model does at start;
- ``after fingerprint``: after ``engine.fingerprint()`` (serve-model's /v1/engine computes it);
- ``busy thread N%``: beside a Python thread that holds the interpreter for N% of every millisecond
  (the share of an event loop serving requests), which every torch call must win back.

    python benchmarks/serve_batcher.py --device cuda      # tiny-moe, 256 requests of 32–96 tokens
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from serve_sustained import add_inprocess_arguments, lengths  # noqa: E402
from serve_throughput import MESSAGES, _device_name  # noqa: E402

console = Console(width=max(Console().width, 120))


class BusyThread:
    """A Python thread that spins for ``share`` of every millisecond and sleeps the rest."""

    def __init__(self, share: float):
        self.share, self.stopping = share, False
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stopping:
            started = time.perf_counter()
            while time.perf_counter() - started < self.share * 1e-3:
                pass
            time.sleep((1 - self.share) * 1e-3)

    def __enter__(self) -> "BusyThread":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping = True
        self.thread.join()


def closed_loop(batcher, prompt: list[int], sizes: list[int], concurrency: int) -> tuple[float, int, float]:
    """Stream s sends requests s, s + concurrency, ... one after another: (wall s, steps, step s)."""
    from rollmarket.engines import SamplingParams
    from rollmarket.serve.batcher import DONE

    async def stream(queue: list[tuple[int, int]]) -> None:
        for seed, n in queue:
            pending = batcher.submit(prompt, SamplingParams(temperature=1.0, max_tokens=n, seed=seed,
                                                            ignore_eos=True), 1, stream=False)
            while (item := await pending.events.get()) is not DONE:
                assert not isinstance(item, Exception), item

    async def main() -> None:
        queues = [[(i, sizes[i]) for i in range(s, len(sizes), concurrency)] for s in range(concurrency)]
        await asyncio.gather(*(stream(q) for q in queues))

    steps, seconds, started = batcher.steps, batcher.step_seconds, time.perf_counter()
    asyncio.run(main())
    return time.perf_counter() - started, batcher.steps - steps, batcher.step_seconds - seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_inprocess_arguments(parser)
    parser.add_argument("--busy", default="0.1,0.3", help="Shares of the busy thread, comma-separated.")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.out = args.out or REPO / "benchmarks" / "results" / (
        "serve_batcher-cuda.json" if args.device.startswith("cuda") else "serve_batcher.json")
    import torch

    from rollmarket.engines import RolloutEngine
    from rollmarket.serve.batcher import Batcher

    if args.device == "cpu":
        torch.set_num_threads(1)
    engine = RolloutEngine.from_path(args.model, args.precision, args.device)
    prompt = engine.encode_chat(MESSAGES)
    sizes = lengths(args.requests, args.max_tokens)
    results = []

    def measure(label: str, busy: float | None = None) -> None:
        batcher = Batcher(engine, max_seqs=args.concurrency, window_s=0.005)
        batcher.start()
        try:
            closed_loop(batcher, prompt, sizes, args.concurrency)  # warm-up: every shape the loop meets
            if busy:
                with BusyThread(busy):
                    wall, steps, seconds = closed_loop(batcher, prompt, sizes, args.concurrency)
            else:
                wall, steps, seconds = closed_loop(batcher, prompt, sizes, args.concurrency)
        finally:
            batcher.stop()
        row = {"condition": label, "busy_share": busy, "tokens_per_s": sum(sizes) / wall, "wall_s": wall,
               "steps": steps, "step_ms": 1000 * seconds / steps}
        results.append(row)
        console.print(f"{label:18} {row['tokens_per_s']:8.0f} tok/s, step {row['step_ms']:.2f} ms")

    measure("plain")
    for share in [float(x) for x in args.busy.split(",") if x]:
        measure(f"busy thread {share:.0%}", share)
    gc.collect()
    gc.freeze()
    measure("gc frozen")
    engine.fingerprint()
    measure("after fingerprint")

    table = Table(title=f"{args.model.name}: the server's Batcher in-process, {args.concurrency} streams, "
                        f"{args.requests} requests, {args.precision} on {args.device}")
    for column in ("condition", "tokens/s", "step ms", "÷ plain"):
        table.add_column(column, justify="right")
    for row in results:
        table.add_row(row["condition"], f"{row['tokens_per_s']:.0f}", f"{row['step_ms']:.2f}",
                      f"{row['tokens_per_s'] / results[0]['tokens_per_s']:.2f}")
    console.print(table)
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.platform(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "device": args.device, "device_name": _device_name(args.device), "precision": args.precision,
            "model": args.model.name, "concurrency": args.concurrency, "requests": args.requests,
            "max_tokens": args.max_tokens, "command": " ".join(sys.argv)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
