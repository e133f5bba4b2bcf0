"""The batched sampler's cost per decode step: inverse-CDF (now) against hash-noise Gumbel-max (before).

One ``RowBatch.draw`` over [batch, vocab] float32 logits (default 32 × 151,936, Qwen3's vocabulary),
every row at temperature 1 (the plain case) and, separately, with top-p 0.95 (which adds a sort).
``gumbel`` is the sampler of main before this change, kept here as the baseline: a 32-bit hash of
(sequence key, step, token id) for every vocabulary entry, turned into Gumbel noise, then argmax,
with top-p by a full sort of each row.
``inverse-cdf`` is ``RowBatch.draw`` now: one counter-based uniform per row (host) and a binary
search in the row's cumulative probabilities; top-p orders only the 1,024 largest logits when
they hold top_p of the row's mass. Both are pure functions of (key, step), so neither
depends on batch neighbours. The median of ``--repeats`` timed draws is kept.

    python benchmarks/sampler_cpu.py                   # CPU, one torch thread (shared machine)
    python benchmarks/sampler_cpu.py --device cuda     # the same on a GPU (synchronised timers)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from rollmarket.engines import sampling
from rollmarket.engines.sampling import Drawn, RowBatch, SamplingParams, sequence_key

REPO = Path(__file__).resolve().parents[1]
_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x.mul_(0x7FEB352D).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 15)
    x.mul_(0x2C1B3C6D).bitwise_and_(_M32)
    return x.bitwise_xor_(x >> 16)


def gumbel_draw(rows: RowBatch, logits_BV: torch.Tensor, steps) -> Drawn:
    """The baseline: main's ``RowBatch.draw`` before this change (hash noise per vocab entry),
    for the sampled (non-greedy, processed-logprob) rows this benchmark uses."""
    device = logits_BV.device
    keys_B = torch.tensor(rows.keys, dtype=torch.int64, device=device)
    steps_B = torch.tensor(list(steps), dtype=torch.int64, device=device)
    processed_BV = torch.log_softmax(rows.processed(logits_BV), dim=-1)
    row_B = _mix32((keys_B & _M32) ^ _mix32((keys_B >> 32) ^ _mix32(steps_B & _M32)))
    ids_V = _mix32(torch.arange(logits_BV.shape[-1], device=device, dtype=torch.int64) ^ 0x5BD1E995)
    bits_BV = _mix32(row_B[:, None] ^ ids_V[None, :]).bitwise_right_shift_(9)
    noise_BV = bits_BV.float().add_(0.5).mul_(1.0 / (1 << 23)).log_().neg_().log_().neg_()
    token_B = torch.argmax(processed_BV + noise_BV, dim=-1)
    packed = torch.cat([token_B[:, None].double(), processed_BV.gather(1, token_B[:, None]).double()], 1)
    return Drawn(packed.cpu().tolist(), rows)


def sorted_gumbel_draw(rows: RowBatch, logits_BV: torch.Tensor, steps) -> Drawn:
    """``gumbel_draw`` with top-p by a full sort of every row, as before this change."""
    kept, sampling._TOP_P_CANDIDATES = sampling._TOP_P_CANDIDATES, logits_BV.shape[-1]
    try:
        return gumbel_draw(rows, logits_BV, steps)
    finally:
        sampling._TOP_P_CANDIDATES = kept


SAMPLERS: dict[str, Callable] = {"gumbel": sorted_gumbel_draw, "inverse-cdf": RowBatch.draw}
CASES = {"temperature 1": (SamplingParams(), 3.0), "top-p 0.95": (SamplingParams(top_p=0.95), 3.0),
         "top-p 0.95, peaked": (SamplingParams(top_p=0.95), 8.0)}
"""Each case: its settings and the scale of its N(0, 1) logits. At scale 3 the 1,024 largest
logits of a 151,936-entry row hold 65-76% of its mass, so top-p sorts the whole row; at scale 8
(closer to a trained model's peaked next-token distribution) they hold top_p and only they are
ordered."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="Torch device: cpu, cuda.")
    parser.add_argument("--batch", type=int, default=32, help="Rows per draw.")
    parser.add_argument("--vocab", type=int, default=151_936, help="Vocabulary size.")
    parser.add_argument("--repeats", type=int, default=15, help="Timed draws per case (the median is kept).")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's own).")
    parser.add_argument("--out", type=Path, default=None,
                        help="Raw results JSON; default benchmarks/results/sampler_cpu.json "
                             "(sampler_cpu-cuda.json on cuda).")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    out = args.out or REPO / "benchmarks" / "results" / ("sampler_cpu-cuda.json" if cuda else "sampler_cpu.json")
    console = Console(width=max(Console().width, 120))

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    normal_BV = torch.randn(args.batch, args.vocab, generator=torch.Generator().manual_seed(0)).to(args.device)
    keys = [sequence_key(0, b) for b in range(args.batch)]
    results = []
    for case, (params, scale) in CASES.items():
        logits_BV = normal_BV * scale
        rows = RowBatch.from_params([params] * args.batch, keys, args.vocab, args.device)
        for name, draw in SAMPLERS.items():
            draw(rows, logits_BV, [0] * args.batch)  # warm-up
            times = []
            for step in range(args.repeats):
                sync()
                started = time.perf_counter()
                draw(rows, logits_BV, [step] * args.batch)
                sync()
                times.append(time.perf_counter() - started)
            results.append({"case": case, "sampler": name, "batch": args.batch, "vocab": args.vocab,
                            "draw_ms": 1000 * statistics.median(times), "draw_ms_runs": [1000 * t for t in times]})

    table = Table(title=f"one draw of {args.batch} rows × {args.vocab:,} vocab on {args.device} (median ms)")
    for column in ("case", "sampler", "draw ms", "speed-up vs gumbel"):
        table.add_column(column, justify="right")
    for row in results:
        base = next(r for r in results if r["case"] == row["case"] and r["sampler"] == "gumbel")
        row["speedup_vs_gumbel"] = base["draw_ms"] / row["draw_ms"]
        table.add_row(row["case"], row["sampler"], f"{row['draw_ms']:.2f}", f"{row['speedup_vs_gumbel']:.2f}x")
    console.print(table)
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.platform(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "device": args.device,
            "device_name": torch.cuda.get_device_name() if cuda else (platform.processor() or platform.machine()),
            "threads": args.threads or None, "repeats": args.repeats}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
