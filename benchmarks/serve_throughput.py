"""Model-server decode throughput: tokens/s at batch 1 and batch 32, over HTTP and in-process.

For each model a real `rollmarket serve-model` process is started on loopback and sent bursts of
concurrent chat requests through the official `openai` client (AsyncOpenAI): every request has
the same prompt, its own seed, ``ignore_eos`` and the same ``max_tokens``, so all sequences are
equally long and tokens/s = completion tokens / wall time of the burst. The server's batcher
should run a burst of 32 as one engine batch; the "engine batches" column says how many it took.

The same bursts then run on the engine directly (``RolloutEngine.generate``, no HTTP, no
batcher), with the server stopped, to show what the HTTP layer costs.

On CPU both run with one torch thread by default (``--threads``): on a shared machine torch's
intra-op thread pool collapses under contention (30x slower at 2 threads on 2 busy cores), which
would measure the neighbours rather than the server.

    python benchmarks/serve_throughput.py                              # tiny-moe and tiny-dense, CPU
    python benchmarks/serve_throughput.py --device cuda --model /ckpt/Qwen3-30B-A3B --max-tokens 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from rollmarket.localhost import free_port

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODELS = [REPO / "models" / "tiny-moe", REPO / "models" / "tiny-dense"]
MESSAGES = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]
console = Console(width=max(Console().width, 150))


def _start_server(model: Path, args, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "rollmarket", "serve-model", str(model), "--precision", args.precision,
           "--device", args.device, "--port", str(port), "--max-batch-seqs", str(max(args.batches)),
           "--batch-window-ms", str(args.batch_window_ms)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    proc = subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:  # the model server answers GET /health
        if proc.poll() is not None:
            raise RuntimeError(f"serve-model exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"serve-model at {url} did not come up:\n{log.read_text()[-4000:]}")


async def _burst(client, name: str, batch: int, max_tokens: int) -> tuple[float, int, list[float]]:
    """``batch`` concurrent requests; (wall seconds, completion tokens, per-request seconds)."""
    async def one(seed: int) -> tuple[int, float]:
        started = time.perf_counter()
        resp = await client.chat.completions.create(
            model=name, messages=MESSAGES, max_tokens=max_tokens, temperature=1.0, seed=seed,
            extra_body={"ignore_eos": True})
        assert resp.usage.completion_tokens == max_tokens, resp.usage
        return resp.usage.completion_tokens, time.perf_counter() - started

    started = time.perf_counter()
    done = await asyncio.gather(*(one(seed) for seed in range(batch)))
    return time.perf_counter() - started, sum(t for t, _ in done), [s for _, s in done]


def bench_server(model: Path, args, log: Path) -> list[dict]:
    from openai import AsyncOpenAI

    proc, url = _start_server(model, args, log)
    rows = []
    try:
        name = model.name

        async def run() -> None:
            client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
            stats = httpx.AsyncClient(base_url=url, timeout=60)
            for batch in args.batches:
                await _burst(client, name, batch, min(8, args.max_tokens))  # warm-up
                rates, latencies, engine_batches = [], [], []
                for _ in range(args.repeats):
                    before = (await stats.get("/v1/engine")).json()["batches"]
                    wall, tokens, per_request = await _burst(client, name, batch, args.max_tokens)
                    engine_batches.append((await stats.get("/v1/engine")).json()["batches"] - before)
                    rates.append(tokens / wall)
                    latencies += per_request
                rows.append({"model": name, "path": "http", "batch": batch, "max_tokens": args.max_tokens,
                             "tokens_per_s": statistics.median(rates), "tokens_per_s_runs": rates,
                             "request_p50_s": statistics.median(latencies), "engine_batches": engine_batches})
                console.print(f"  http   batch {batch:>3}: {statistics.median(rates):9.1f} tokens/s "
                              f"(engine batches per burst: {engine_batches})")
            await client.close()
            await stats.aclose()

        asyncio.run(run())
    finally:
        proc.terminate()
        proc.wait(30)
    return rows


def bench_engine(model: Path, args) -> list[dict]:
    from rollmarket.engines import RolloutEngine, SamplingParams

    engine = RolloutEngine.from_path(model, args.precision, args.device)
    prompt = engine.encode_chat(MESSAGES)
    rows = []
    for batch in args.batches:
        params = [SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=s, ignore_eos=True)
                  for s in range(batch)]
        warm_up = SamplingParams(max_tokens=min(8, args.max_tokens), ignore_eos=True)
        engine.generate([prompt] * batch, [warm_up] * batch)
        rates = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            generations = engine.generate([prompt] * batch, params)
            wall = time.perf_counter() - started
            rates.append(sum(g.token_ids_T.size for g in generations) / wall)
        rows.append({"model": model.name, "path": "engine", "batch": batch, "max_tokens": args.max_tokens,
                     "tokens_per_s": statistics.median(rates), "tokens_per_s_runs": rates,
                     "request_p50_s": None, "engine_batches": [1] * args.repeats})
        console.print(f"  engine batch {batch:>3}: {statistics.median(rates):9.1f} tokens/s")
    del engine
    return rows


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, action="append", default=None,
                        help="Model directory (repeatable); default models/tiny-moe and models/tiny-dense.")
    parser.add_argument("--device", default="cpu", help="Torch device for server and engine: cpu, cuda, cuda:1.")
    parser.add_argument("--precision", default="bf16", help="Precision profile: fp32, bf16, fp16 or fp8.")
    parser.add_argument("--batches", default="1,32", help="Comma-separated concurrent request counts.")
    parser.add_argument("--max-tokens", type=int, default=64, help="Completion tokens per request.")
    parser.add_argument("--repeats", type=int, default=3, help="Measured bursts per case (the median is kept).")
    parser.add_argument("--batch-window-ms", type=float, default=5.0, help="The server's batching window.")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads for server and engine; default 1 on cpu, torch's own on cuda.")
    parser.add_argument("--no-engine", action="store_true", help="Skip the in-process engine comparison.")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "serve_throughput.json",
                        help="Where to write the results as JSON.")
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    models = [m.resolve() for m in (args.model or DEFAULT_MODELS)]
    if args.threads is None:
        args.threads = 1 if args.device == "cpu" else 0
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            console.print(f"[bold]{model.name}[/] at {args.precision} on {args.device}")
            results += bench_server(model, args, Path(tmp) / f"{model.name}.log")
            if not args.no_engine:
                results += bench_engine(model, args)

    table = Table(title=f"serve-model decode throughput: {args.max_tokens} tokens per request, "
                        f"{args.precision} on {args.device}")
    for column in ("model", "path", "batch", "tokens/s", f"vs batch {args.batches[0]}", "http / engine",
                   "request p50 s", "engine batches"):
        table.add_column(column, justify="right")
    for row in results:
        base = next(r for r in results if (r["model"], r["path"], r["batch"]) ==
                    (row["model"], row["path"], args.batches[0]))
        engine = next((r for r in results if (r["model"], r["path"], r["batch"]) ==
                       (row["model"], "engine", row["batch"])), None)
        row["ratio_vs_first_batch"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["http_over_engine"] = row["tokens_per_s"] / engine["tokens_per_s"] if engine else None
        table.add_row(
            row["model"], row["path"], str(row["batch"]), f"{row['tokens_per_s']:.1f}",
            f"{row['ratio_vs_first_batch']:.2f}x",
            f"{row['http_over_engine']:.2f}" if row["path"] == "http" and engine else "-",
            f"{row['request_p50_s']:.3f}" if row["request_p50_s"] is not None else "-",
            ",".join(map(str, row["engine_batches"])))
    console.print(table)

    import torch

    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.platform(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "device": args.device, "device_name": _device_name(args.device), "precision": args.precision,
            "threads": args.threads or None, "batch_window_ms": args.batch_window_ms, "max_tokens": args.max_tokens, "batches": args.batches, "models": [str(m) for m in models],
            "command": " ".join(sys.argv)}
    console.print(meta)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
