"""Where the decode thread's CPU time goes at batch 32: inside `rollmarket serve-model` (HTTP
bursts through the official `openai` client) against the same `Batcher` fed from an event loop
in this process (no HTTP), each under cProfile (`serve-model --profile-decode`).

benchmarks/serve_throughput.py showed, on an H100, the server's decode steps at batch 32 several
times slower than the in-process batcher's on the same engine; this names the functions that
differ. Prints the top functions by own time for both and writes both tables to --out.

    python benchmarks/serve_profile.py --device cuda            # tiny-dense, 3 bursts of 32 × 64 tokens
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import pstats
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
MESSAGES = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]


def _top(path: str, limit: int) -> dict:
    stats = pstats.Stats(path)
    total = sum(v[2] for v in stats.stats.values())  # own time over every function
    rows = sorted(((v[2], v[3], v[1], f"{Path(f).name}:{line} {name}") for (f, line, name), v in stats.stats.items()),
                  reverse=True)[:limit]
    text = io.StringIO()
    pstats.Stats(path, stream=text).sort_stats("tottime").print_stats(limit)
    return dict(total_own_s=total, top=[dict(own_s=own, cum_s=cum, calls=calls, function=fn)
                                        for own, cum, calls, fn in rows], text=text.getvalue()[-6000:])


async def _bursts(url: str, name: str, batch: int, tokens: int, bursts: int) -> list[float]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    walls = []
    for _ in range(bursts):
        started = time.perf_counter()
        await asyncio.gather(*(client.chat.completions.create(
            model=name, messages=MESSAGES, max_tokens=tokens, temperature=1.0, seed=s,
            extra_body={"ignore_eos": True}) for s in range(batch)))
        walls.append(time.perf_counter() - started)
    await client.close()
    return walls


def server_profile(args, scratch: Path) -> dict:
    from serve_throughput import _start_server

    out = str(scratch / "server.prof")
    # The decode thread beside the event loop, as this benchmark has always compared it.
    proc, url = _start_server(args.model, args, scratch / "server.log", ("--profile-decode", out, "--no-engine-process"))
    try:
        name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        walls = asyncio.run(_bursts(url, name, args.batch, args.tokens, args.bursts))
        engine = httpx.get(url + "/v1/engine").json()
    finally:
        proc.send_signal(signal.SIGTERM)  # uvicorn's shutdown stops the batcher, which writes the profile
        proc.wait(timeout=60)
    return dict(walls_s=walls, engine=engine, **_top(out, args.limit))


def inprocess_profile(args, scratch: Path) -> dict:
    from rollmarket.engines import RolloutEngine, SamplingParams
    from rollmarket.serve.batcher import DONE, Batcher

    engine = RolloutEngine.from_path(args.model, args.precision, args.device)
    prompt = engine.encode_chat(MESSAGES)
    out = str(scratch / "inprocess.prof")
    batcher = Batcher(engine, max_seqs=args.batch, window_s=0.005, profile_path=out)
    batcher.start()

    async def burst() -> float:
        started = time.perf_counter()
        pendings = [batcher.submit(prompt, SamplingParams(max_tokens=args.tokens, seed=s, ignore_eos=True), 1,
                                   stream=False) for s in range(args.batch)]
        for pending in pendings:
            while (item := await pending.events.get()) is not DONE:
                assert not isinstance(item, Exception), item
        return time.perf_counter() - started

    async def all_bursts() -> list[float]:
        return [await burst() for _ in range(args.bursts)]

    try:
        walls = asyncio.run(all_bursts())
    finally:
        batcher.stop()
    return dict(walls_s=walls, steps=batcher.steps, step_seconds=batcher.step_seconds, **_top(out, args.limit))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-dense")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default=None, help="Default: fp32 on cpu, bf16 on cuda.")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--limit", type=int, default=25, help="Functions listed per profile.")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "serve_profile.json")
    args = parser.parse_args()
    args.precision = args.precision or ("bf16" if args.device.startswith("cuda") else "fp32")
    # What serve_throughput's server start reads: one batch size, its 5 ms window, torch's threads.
    args.batches, args.batch_window_ms, args.threads = [args.batch], 5.0, 0
    with tempfile.TemporaryDirectory(prefix="serve-profile-") as scratch:
        server = server_profile(args, Path(scratch))
        inproc = inprocess_profile(args, Path(scratch))
    for label, res in (("serve-model", server), ("in-process batcher", inproc)):
        print(f"==== {label}: bursts {[round(w, 3) for w in res['walls_s']]} s; own time {res['total_own_s']:.2f} s")
        print(res["text"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    from teacher_forcing import _meta

    args.out.write_text(json.dumps({"meta": _meta(args, "cuda" if args.device.startswith("cuda") else "cpu"),
                                    "server": server, "inprocess": inproc}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
