"""Model-server throughput under sustained load: HTTP against the engine alone, both kept full.

`serve_throughput.py` sends bursts: 32 equal requests at once, then nothing until all 32 answer.
Every request's HTTP work (the client's and the server's) then runs while the GPU idles: before
the burst's prefill or after its last step. Rollout workers do not wait for each other like that:
each sends its next request when its last one answers, so a server's batch stays full and the
requests' HTTP work overlaps the decode of the others. This benchmark measures that.

A closed loop of ``--concurrency`` streams (32) works through ``--requests`` chat requests whose
lengths (``ignore_eos``) are drawn once, seeded, uniformly from [max_tokens/2, 3·max_tokens/2], so
sequences end at different steps and new ones join a running batch:

- ``http``: a real `rollmarket serve-model` on loopback; the streams are split over ``--clients``
  processes, each an official ``openai`` AsyncOpenAI client (a stream sends its next request when
  its last one answers).
- ``engine``: the same requests in this process on one ``DecodeSession`` (no HTTP, no batcher):
  when a row finishes its stream's next request is ready at once, and ready requests join by
  the server's own rule (``serve.batcher.join_now``: a busy batch takes joiners in groups).

tokens/s = completion tokens of all requests / wall time from the first request sent to the last
answer; the ratio ``http / engine`` is what HTTP serving costs. Both run ``--repeats`` times after
one warm-up run each (which also captures the CUDA graphs of every batch size a run passes
through); the median is kept.

    python benchmarks/serve_sustained.py                    # tiny-moe and tiny-dense on the CPU
    python benchmarks/serve_sustained.py --device cuda      # + the Qwen3-0.6B shape
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import random
import sys
import tempfile
import time
from collections import deque
from datetime import datetime, timezone
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from serve_profile import _top  # noqa: E402
from serve_throughput import (MESSAGES, _device_name, _start_server, add_server_arguments,  # noqa: E402
                              materialise, models_and_shapes)

PROFILE_LINES = 30
"""Functions kept per profile (``--profile``), by own time."""

console = Console(width=max(Console().width, 150))


def lengths(requests: int, max_tokens: int, seed: int = 0) -> list[int]:
    """Each request's completion length: uniform in [max_tokens/2, 3·max_tokens/2], seeded."""
    rng = random.Random(seed)
    return [rng.randint(max(1, max_tokens // 2), 3 * max_tokens // 2) for _ in range(requests)]


_CHILD: dict = {}


def _child_start(url: str) -> None:
    from openai import AsyncOpenAI

    _CHILD["loop"] = asyncio.new_event_loop()
    _CHILD["client"] = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)


async def _streams(client, name: str, queues: list[list[tuple[int, int]]]) -> tuple[int, float]:
    """Each queue is one stream's (seed, length) requests, sent one after another; (completion
    tokens, CPU seconds of this process meanwhile)."""
    async def stream(queue: list[tuple[int, int]]) -> int:
        tokens = 0
        for seed, length in queue:
            resp = await client.chat.completions.create(
                model=name, messages=MESSAGES, max_tokens=length, temperature=1.0, seed=seed,
                extra_body={"ignore_eos": True})
            assert resp.usage.completion_tokens == length, resp.usage
            tokens += length
        return tokens

    cpu = time.process_time()
    done = await asyncio.gather(*(stream(q) for q in queues))
    return sum(done), time.process_time() - cpu


def _child_run(name: str, queues: list[list[tuple[int, int]]]) -> tuple[int, float]:
    try:
        return _CHILD["loop"].run_until_complete(_streams(_CHILD["client"], name, queues))
    except Exception as exc:  # the openai client's errors do not pickle back to the parent
        raise RuntimeError(f"a client stream failed: {exc!r}") from None


def _queues(sizes: list[int], concurrency: int) -> list[list[tuple[int, int]]]:
    """Request i goes to stream i mod concurrency (its seed is i)."""
    return [[(i, sizes[i]) for i in range(s, len(sizes), concurrency)] for s in range(concurrency)]


SERVERS = {"thread": ("http", ("--no-engine-process",)), "process": ("http-process", ("--engine-process",)),
           "thread-exact": ("http-exact", ("--no-engine-process", "--no-step-buckets"))}
"""``--servers``: the result's path and serve-model's options, explicit both ways (serve-model's
default is the engine process on CUDA, the HTTP process on the CPU). ``thread-exact`` runs eager decode
steps at their exact shapes (the default before ``--step-buckets``; docs/benchmarks.md, "New shapes")."""


def bench_http(model: Path, sizes: list[int], args, log: Path, *, server: str) -> dict:
    profile = str(log.with_suffix(".prof")) if args.profile else None
    # The server's profile starts past the warm-up run (a run is about sum(sizes)/concurrency steps
    # when the batch is full; twice that leaves out the warm-up's captures and compiles for sure).
    skip = 2 * sum(sizes) // args.concurrency
    path, options = SERVERS[server]
    proc, url = _start_server(model, args, log, (*options,
                                                 *(("--profile-decode", profile, "--profile-decode-after-steps",
                                                    str(skip)) if profile else ())))
    pool = multiprocessing.get_context("spawn").Pool(args.clients, initializer=_child_start, initargs=(url,))
    try:
        queues = _queues(sizes, args.concurrency)
        shares = [(model.name, queues[i::args.clients]) for i in range(args.clients)]

        def run() -> tuple[float, int, float, dict]:
            before = httpx.get(url + "/v1/engine", timeout=60).json()
            started = time.perf_counter()
            parts = pool.starmap(_child_run, shares)
            wall = time.perf_counter() - started
            after = httpx.get(url + "/v1/engine", timeout=60).json()
            delta = {k: after[k] - before[k] for k in ("decode_steps", "decode_seconds", "prefill_seconds",
                                                       "queue_seconds", "batches")}
            return wall, sum(t for t, _ in parts), sum(c for _, c in parts), delta

        run()  # warm-up: graphs of every batch size the loop passes through
        runs = [run() for _ in range(args.repeats)]
        lifetime = httpx.get(url + "/v1/engine", timeout=60).json()  # the profile covers the server's whole life
    finally:
        pool.terminate()
        proc.terminate()  # uvicorn's shutdown stops the batcher, which writes the profile
        proc.wait(60)
    rates = [tokens / wall for wall, tokens, _, _ in runs]
    mid = sorted(range(len(runs)), key=lambda i: rates[i])[len(runs) // 2]
    wall, tokens, cpu, delta = runs[mid]
    return {"model": model.name, "path": path, "tokens_per_s": rates[mid], "tokens_per_s_runs": rates,
            "wall_s": wall, "tokens": tokens, "clients": args.clients,
            "client_cpu_ms_per_request": 1000 * cpu / len(sizes),
            **({"profile": _top(profile, PROFILE_LINES), "profile_steps": lifetime["decode_steps"] - skip} if profile else {}),
            # How full the server kept its batch: tokens per decode step (a step decodes every running row).
            "mean_batch": tokens / max(delta["decode_steps"], 1),
            "server_step_ms": 1000 * delta["decode_seconds"] / max(delta["decode_steps"], 1),
            "decode_share": (delta["decode_seconds"] + delta["prefill_seconds"]) / wall,
            "prefills": delta["batches"], "queue_ms_mean": 1000 * delta["queue_seconds"] / len(sizes)}


def add_inprocess_arguments(parser) -> None:
    """The options of the benchmarks that drive this workload in-process, with no server
    (serve_batcher.py, decode_shapes.py): the model, where it runs, and the streams' requests."""
    parser.add_argument("--model", type=Path, default=REPO / "models" / "tiny-moe")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--concurrency", type=int, default=32, help="Streams kept in flight (the batch).")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64, help="Mean completion tokens per request.")


def closed_loop(engine, prompt: list[int], sizes: list[int], concurrency: int, step=None) -> tuple[int, int, int]:
    """The HTTP streams' workload on one ``DecodeSession``, no HTTP: request i belongs to stream
    i mod ``concurrency`` (as ``_queues`` deals them), a stream's next request is ready the step its
    last one ends (its first at once), and ready requests join by the server's rule
    (``serve.batcher.join_now``: a busy batch takes joiners in groups). ``step(session)`` runs one
    decode step (default ``session.step()``; a caller times or profiles it there). Returns
    (tokens, steps, prefills).

    Each stream keeps its own queue, as over HTTP: a stream whose requests are done leaves, so the
    batch thins out at the end as the server's does. (Until 2026-11-28 the next request in global
    order took every freed row, which kept the engine's batch fuller at the end, 28.6 rows a step
    against HTTP's 25.5 — a different workload.)"""
    from rollmarket.engines import SamplingParams
    from rollmarket.serve.batcher import join_now

    step = step or (lambda session: session.step())
    ready: deque[tuple[int, int]] = deque((i, 0) for i in range(min(concurrency, len(sizes))))  # (request, step)
    request_of: dict[int, int] = {}  # row index -> request
    session = engine.session()
    tokens = steps = prefills = 0
    while ready or session:
        room = concurrency - len(session)
        if ready and (not session or join_now(len(ready), room, len(session), concurrency, steps - ready[0][1])):
            joining = [ready.popleft()[0] for _ in range(min(room, len(ready)))]
            rows = session.add([prompt] * len(joining), [SamplingParams(temperature=1.0, max_tokens=sizes[i], seed=i,
                                                                        ignore_eos=True) for i in joining])
            request_of.update((row.index, i) for row, i in zip(rows, joining))
            prefills += 1
        events = step(session)
        steps += 1
        tokens += len(events)
        for ev in events:
            if ev.finish_reason is not None and (after := request_of.pop(ev.index) + concurrency) < len(sizes):
                ready.append((after, steps))
    return tokens, steps, prefills


def bench_engine(model: Path, sizes: list[int], args) -> dict:
    import torch

    from rollmarket.engines import RolloutEngine

    engine = RolloutEngine.from_path(model, args.precision, args.device)
    prompt = engine.encode_chat(MESSAGES)

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def run() -> tuple[float, int, int, int, float]:
        stepping = 0.0  # wall time inside session.step(), as the server's decode_seconds counts it

        def timed(session):
            nonlocal stepping
            before = time.perf_counter()
            events = session.step()
            stepping += time.perf_counter() - before
            return events

        sync()
        started = time.perf_counter()
        tokens, steps, prefills = closed_loop(engine, prompt, sizes, args.concurrency, timed)
        sync()
        return time.perf_counter() - started, tokens, steps, prefills, stepping

    run()
    if args.profile:  # the measured runs under cProfile, as serve-model --profile-decode runs its decode thread
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    runs = [run() for _ in range(args.repeats)]
    profiled = {}
    if args.profile:
        profiler.disable()
        out = Path(tempfile.mkdtemp()) / "engine.prof"
        profiler.dump_stats(out)
        profiled = {"profile": _top(str(out), PROFILE_LINES), "profile_steps": sum(r[2] for r in runs)}
    rates = [tokens / wall for wall, tokens, _, _, _ in runs]
    mid = sorted(range(len(runs)), key=lambda i: rates[i])[len(runs) // 2]
    wall, tokens, steps, prefills, stepping = runs[mid]
    assert tokens == sum(sizes), (tokens, sum(sizes))
    captures = engine.graph_captures
    engine = None
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"model": model.name, "path": "engine", "tokens_per_s": rates[mid], "tokens_per_s_runs": rates,
            "wall_s": wall, "tokens": tokens, "mean_batch": tokens / steps, "prefills": prefills,
            "step_ms": 1000 * wall / steps, "step_only_ms": 1000 * stepping / steps, "graph_captures": captures,
            "workload": "streams", **profiled}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_arguments(parser)
    parser.add_argument("--concurrency", type=int, default=32, help="Streams kept in flight (the batch).")
    parser.add_argument("--requests", type=int, default=None, help="Requests per run; default 8 per stream.")
    parser.add_argument("--max-tokens", type=int, default=64, help="Mean completion tokens per request.")
    parser.add_argument("--clients", type=int, default=4, help="Client processes the streams are split over.")
    parser.add_argument("--profile", action="store_true",
                        help="Run the server's decode thread (serve-model --profile-decode) and the engine's measured "
                             "runs under cProfile; their top functions go into the results.")
    parser.add_argument("--servers", default="thread,process",
                        help="Which serve-model to measure, comma-separated: thread (decodes in the HTTP process), "
                             "process (--engine-process), thread-exact (--no-step-buckets).")
    parser.add_argument("--repeats", type=int, default=3, help="Measured runs per path (the median is kept).")
    parser.add_argument("--out", type=Path, default=None,
                        help="Results as JSON; default benchmarks/results/serve_sustained[-cuda].json.")
    args = parser.parse_args()
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    args.out = args.out or REPO / "benchmarks" / "results" / (
        "serve_sustained-cuda.json" if kind == "cuda" else "serve_sustained.json")
    args.requests = args.requests or 8 * args.concurrency
    args.servers = [x for x in args.servers.split(",") if x]
    if unknown := set(args.servers) - set(SERVERS):
        parser.error(f"--servers: {sorted(unknown)} not among {sorted(SERVERS)}")
    args.batches = [args.concurrency]  # _start_server sizes the server's batch from it
    models, shapes = models_and_shapes(args)
    import torch

    sizes = lengths(args.requests, args.max_tokens)
    results: list[dict] = []

    def write() -> None:  # after each model, so a run cut short keeps what it measured
        meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.platform(),
                "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                "device": args.device, "device_name": _device_name(args.device), "precision": args.precision,
                "threads": args.threads or None, "batch_window_ms": args.batch_window_ms,
                "concurrency": args.concurrency, "requests": args.requests, "max_tokens": args.max_tokens,
                "clients": args.clients, "servers": args.servers, "engine_workload": "streams",
                "models": [str(m) for m in models[:len(models) - len(shapes)]],
                "shapes": shapes, "command": " ".join(sys.argv)}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
        console.print(f"wrote {args.out}")

    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            models.append(materialise(shape, args, Path(tmp)))
        for model in models:
            console.print(f"[bold]{model.name}[/] at {args.precision} on {args.device}: {args.requests} requests, "
                          f"{args.concurrency} in flight, {sum(sizes)} tokens")
            served = []
            for server in args.servers:
                http = bench_http(model, sizes, args, Path(tmp) / f"{model.name}-{server}.log", server=server)
                console.print(f"  {http['path']:12} {http['tokens_per_s']:9.1f} tokens/s "
                              f"(mean batch {http['mean_batch']:.1f})")
                served.append(http)
            engine = bench_engine(model, sizes, args)
            console.print(f"  {'engine':12} {engine['tokens_per_s']:9.1f} tokens/s (mean batch {engine['mean_batch']:.1f})")
            for http in served:
                http["over_engine"] = http["tokens_per_s"] / engine["tokens_per_s"]
            results += [*served, engine]
            write()

    table = Table(title=f"serve-model under sustained load: {args.concurrency} streams, {args.requests} requests "
                        f"of {args.max_tokens // 2}–{3 * args.max_tokens // 2} tokens, {args.precision} on {args.device}")
    for column in ("model", "path", "tokens/s", "/ engine", "mean batch", "ms per step", "prefills",
                   "client CPU ms/request"):
        table.add_column(column, justify="right")
    for row in results:
        http = row["path"].startswith("http")
        table.add_row(row["model"], row["path"], f"{row['tokens_per_s']:.1f}",
                      f"{row['over_engine']:.2f}" if http else "-", f"{row['mean_batch']:.1f}",
                      f"{row['server_step_ms' if http else 'step_only_ms']:.2f}", str(row["prefills"]),
                      f"{row['client_cpu_ms_per_request']:.2f}" if http else "-")
    console.print(table)


if __name__ == "__main__":
    main()
