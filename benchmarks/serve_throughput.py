"""Model-server decode throughput: tokens/s at batch 1 and batch 32, over HTTP and in-process.

For each model a real `rollmarket serve-model` process is started on loopback and sent bursts of
concurrent chat requests through the official `openai` client (AsyncOpenAI): every request has
the same prompt, its own seed, ``ignore_eos`` and the same ``max_tokens``, so all sequences are
equally long and tokens/s = completion tokens / wall time of the burst. The server batches
continuously (requests join the running batch between decode steps); the "prefills" column says
how many prefills a burst took (1: it was admitted as one). Each HTTP case is warmed up with
bursts of the measured length until two agree within 15% (at most 4). The server's own timers (``/v1/engine``: decode steps,
their wall time, prefill time, requests' wait between submit and prefill) split each HTTP burst:
"ms per step" is the server's decode step against the engine's burst wall per step, "server
decode share" how much of the burst's wall the decode thread was busy; the rest is HTTP, the
client, admission and the hand-over of results.

The same bursts then run on the engine directly (``RolloutEngine.generate``, no HTTP, no
batcher), with the server stopped, to show what the HTTP layer costs: once with the batched
sampler (``engine``) and once with the per-row CPU sampler it replaced (``engine-per-row``,
the sampler of main before issue 18: logits to the CPU, then log_softmax, top-k/top-p and
``torch.multinomial`` one row at a time), and once through the server's ``Batcher`` in this
process (``batcher``: its decode thread and hand-over to an event loop, no HTTP). A decode step is then split into the model forward
and the sampling (device-synchronised timers around each, ``--split-steps`` steps) for both.

Models are shipped model directories (``--model``) and random-weight Qwen3 shapes from
benchmarks/teacher_forcing.py (``--shape``; saved with tiny-dense's tokenizer, whose ids are
the first 1,536 of the 151,936-token vocabulary: generated ids beyond them read as empty text).

On CPU both run with one torch thread by default (``--threads``): on a shared machine torch's
intra-op thread pool collapses under contention (30x slower at 2 threads on 2 busy cores), which
would measure the neighbours rather than the server.

    python benchmarks/serve_throughput.py                      # tiny-moe and tiny-dense, CPU
    python benchmarks/serve_throughput.py --device cuda        # + the Qwen3-0.6B shape; ~3 min on an H100
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from rollmarket.localhost import free_port

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from teacher_forcing import SHAPES  # noqa: E402  (the Qwen3 shapes, one definition)

DEFAULT_MODELS = [REPO / "models" / "tiny-moe", REPO / "models" / "tiny-dense"]
DEFAULT_SHAPES = {"cpu": "", "cuda": "qwen3-0.6b"}
MESSAGES = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]
console = Console(width=max(Console().width, 150))


def _start_server(model: Path, args, log: Path, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """A `rollmarket serve-model` process (``extra``: more of its options), once it answers /health."""
    port = free_port()
    cmd = [sys.executable, "-m", "rollmarket", "serve-model", str(model), "--precision", args.precision,
           "--device", args.device, "--port", str(port), "--max-batch-seqs", str(max(args.batches)),
           "--batch-window-ms", str(args.batch_window_ms), *extra]
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


async def _requests(client, name: str, seeds: list[int], max_tokens: int) -> tuple[list[tuple[int, float]], float]:
    """Concurrent requests from one client, one per seed: ((completion tokens, seconds) per
    request, CPU seconds of this process meanwhile: the openai client's own share of HTTP)."""
    async def one(seed: int) -> tuple[int, float]:
        started = time.perf_counter()
        resp = await client.chat.completions.create(
            model=name, messages=MESSAGES, max_tokens=max_tokens, temperature=1.0, seed=seed,
            extra_body={"ignore_eos": True})
        assert resp.usage.completion_tokens == max_tokens, resp.usage
        return resp.usage.completion_tokens, time.perf_counter() - started

    cpu = time.process_time()
    done = await asyncio.gather(*(one(seed) for seed in seeds))
    return list(done), time.process_time() - cpu


_CHILD: dict = {}
"""A client process's event loop and AsyncOpenAI client (``--clients`` > 1)."""


def _child_start(url: str) -> None:
    from openai import AsyncOpenAI

    _CHILD["loop"] = asyncio.new_event_loop()
    _CHILD["client"] = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)


def _child_requests(name: str, seeds: list[int], max_tokens: int) -> tuple[list[tuple[int, float]], float]:
    return _CHILD["loop"].run_until_complete(_requests(_CHILD["client"], name, seeds, max_tokens))


async def _burst(client, name: str, batch: int, max_tokens: int, pool=None,
                 clients: int = 1) -> tuple[float, int, list[float], float]:
    """``batch`` concurrent requests, from this process or split over ``clients`` client processes
    (``pool``), as rollout workers send them; (wall seconds, completion tokens, per-request
    seconds, client CPU seconds summed over the processes)."""
    started = time.perf_counter()
    if pool is None:
        done, cpu = await _requests(client, name, list(range(batch)), max_tokens)
    else:
        shares = [(name, list(range(batch))[i::clients], max_tokens) for i in range(clients)]
        parts = await asyncio.to_thread(pool.starmap, _child_requests, shares)
        done, cpu = [d for part, _ in parts for d in part], sum(c for _, c in parts)
    return time.perf_counter() - started, sum(t for t, _ in done), [s for _, s in done], cpu


async def _warm(burst, most: int = 4, within: float = 0.15) -> int:
    """Run warm-up bursts until one's rate is within ``within`` of the previous one's (at most
    ``most``); returns how many ran. ``burst()`` returns tokens/s, or an awaitable of it: every
    path (HTTP, the engine alone, the batcher) warms up by this one rule, so their ratios compare
    warm with warm."""
    previous = None
    for done in range(1, most + 1):
        rate = burst()
        if inspect.isawaitable(rate):
            rate = await rate
        if previous is not None and abs(rate - previous) <= within * max(rate, previous):
            return done
        previous = rate
    return most


def bench_server(model: Path, args, log: Path) -> list[dict]:
    from openai import AsyncOpenAI

    where = () if args.engine_process is None else ("--engine-process" if args.engine_process else "--no-engine-process",)
    proc, url = _start_server(model, args, log, where)
    rows = []
    try:
        name = model.name

        async def run() -> None:
            client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
            stats = httpx.AsyncClient(base_url=url, timeout=60)
            for batch in args.batches:
                clients = min(args.clients, batch)
                pool = pools.get(clients)
                if clients > 1 and pool is None:
                    # spawn: the children import nothing of this process's torch or threads.
                    pool = pools[clients] = multiprocessing.get_context("spawn").Pool(
                        clients, initializer=_child_start, initargs=(url,))
                # Warm-up at the measured length until two bursts agree: new shapes pay one-time
                # costs (compiles) for more than one burst (on an H100 after batch 1's bursts the
                # first batch-32 burst past one warm-up still ran at 1/7 of the next one's rate).
                async def http_rate() -> float:
                    wall, tokens, _, _ = await _burst(client, name, batch, args.max_tokens, pool, clients)
                    return tokens / wall

                warmups = await _warm(http_rate)
                rates, latencies, engine_batches, inside, client_cpu = [], [], [], [], []
                for _ in range(args.repeats):
                    before = (await stats.get("/v1/engine")).json()
                    wall, tokens, per_request, cpu = await _burst(client, name, batch, args.max_tokens, pool, clients)
                    client_cpu.append(cpu)
                    after = (await stats.get("/v1/engine")).json()
                    engine_batches.append(after["batches"] - before["batches"])
                    rates.append(tokens / wall)
                    latencies += per_request
                    # The server's own account of the burst: its decode thread's steps, prefills
                    # and the requests' wait between submit and prefill.
                    delta = {k: after[k] - before[k] for k in ("decode_steps", "decode_seconds",
                                                               "prefill_seconds", "queue_seconds")}
                    inside.append({"wall_s": wall, **delta,
                                   "step_ms": 1000 * delta["decode_seconds"] / max(delta["decode_steps"], 1),
                                   "queue_ms_mean": 1000 * delta["queue_seconds"] / batch})
                rows.append({"model": name, "path": "http", "batch": batch, "max_tokens": args.max_tokens,
                             "clients": clients,
                             "tokens_per_s": statistics.median(rates), "tokens_per_s_runs": rates,
                             "request_p50_s": statistics.median(latencies), "engine_batches": engine_batches,
                             "warmups": warmups, "client_cpu_s_runs": client_cpu,
                             "client_cpu_ms_per_request": 1000 * statistics.median(client_cpu) / batch,
                             "server": inside, "server_step_ms": statistics.median(r["step_ms"] for r in inside),
                             "decode_share": statistics.median((r["decode_seconds"] + r["prefill_seconds"]) / r["wall_s"]
                                                               for r in inside),
                             "queue_ms_mean": statistics.median(r["queue_ms_mean"] for r in inside)})
                console.print(f"  http   batch {batch:>3}: {statistics.median(rates):9.1f} tokens/s "
                              f"(prefills per burst: {engine_batches}; server step "
                              f"{rows[-1]['server_step_ms']:.2f} ms, decode+prefill {rows[-1]['decode_share']:.0%} of wall, "
                              f"mean queue wait {rows[-1]['queue_ms_mean']:.1f} ms, client CPU "
                              f"{rows[-1]['client_cpu_ms_per_request']:.2f} ms per request)")
            await client.close()
            await stats.aclose()

        pools: dict[int, Any] = {}
        try:
            asyncio.run(run())
        finally:
            for pool in pools.values():
                pool.terminate()
    finally:
        proc.terminate()
        proc.wait(30)
    return rows


def materialise(shape: str, args, folder: Path) -> Path:
    """A random-weight model of a teacher_forcing shape, saved (bf16) as a model directory."""
    import shutil

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    spec = SHAPES[shape]
    tokenizer_dir = REPO / "models" / "tiny-dense"
    ids = json.loads((tokenizer_dir / "config.json").read_text())
    config = Qwen3Config(**spec["config"], tie_word_embeddings=True, max_position_embeddings=4096,
                         bos_token_id=ids.get("bos_token_id"), eos_token_id=ids.get("eos_token_id"),
                         pad_token_id=ids.get("pad_token_id"))
    torch.manual_seed(0)
    with torch.device(args.device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    out = folder / shape
    model.save_pretrained(out)
    del model
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return out


def per_row_draw():
    """The sampler this benchmark compares against (main before issue 18), as a drop-in for
    ``RowBatch.draw``: the step's logits to the CPU, then per row log_softmax, top-k/top-p
    (``processed_logits``) and ``torch.multinomial`` with the sequence's own generator."""
    import torch

    from rollmarket.engines.sampling import Drawn, processed_logits

    generators: dict[int, torch.Generator] = {}

    def draw(rows, logits_BV, steps) -> Drawn:
        logits_BV = logits_BV.cpu()
        keys = list(rows.keys)
        packed = []
        for b, p in enumerate(rows.params):
            raw_V = torch.log_softmax(logits_BV[b], dim=-1)
            if p.temperature == 0:
                token, report_V = int(torch.argmax(logits_BV[b])), raw_V
            else:
                gen = generators.get(keys[b]) or generators.setdefault(keys[b], torch.Generator().manual_seed(keys[b]))
                processed_V = torch.log_softmax(processed_logits(logits_BV[b], p), dim=-1)
                token = int(torch.multinomial(processed_V.exp(), 1, generator=gen))
                report_V = processed_V if p.logprobs_mode == "processed" else raw_V
            row = [token, float(report_V[token])]
            if rows.flags.max_top:
                values, ids = torch.topk(report_V, min(rows.flags.max_top, report_V.shape[-1]))
                row += ids.tolist() + values.tolist()
            packed.append(row)
        return Drawn(packed, rows)

    return draw


SAMPLERS = {"engine": None, "engine-per-row": per_row_draw}


def _with_sampler(sampler: str):
    """Context: ``RowBatch.draw`` replaced by the named sampler (None: the batched one)."""
    from contextlib import contextmanager

    from rollmarket.engines.sampling import RowBatch

    @contextmanager
    def patched():
        original = RowBatch.draw
        if SAMPLERS[sampler] is not None:
            RowBatch.draw = SAMPLERS[sampler]()
        try:
            yield
        finally:
            RowBatch.draw = original
    return patched()


def bench_engine(model: Path, name: str, args) -> tuple[list[dict], list[dict]]:
    """Tokens/s of ``generate`` with each sampler, and the decode step split into forward and
    sampling (synchronised timers around each)."""
    import torch

    from rollmarket.engines import RolloutEngine, SamplingParams

    engine = RolloutEngine.from_path(model, args.precision, args.device)
    prompt = engine.encode_chat(MESSAGES)
    rows, splits = [], []

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    for sampler in SAMPLERS:
        # The per-row baseline replaces ``RowBatch.draw``: its draws stay out of the slot steps.
        engine.fused_draw = sampler == "engine"
        with _with_sampler(sampler):
            for batch in args.batches:
                params = [SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=s, ignore_eos=True)
                          for s in range(batch)]
                def rate() -> float:
                    sync()
                    started = time.perf_counter()
                    generations = engine.generate([prompt] * batch, params)
                    return sum(g.token_ids_T.size for g in generations) / (time.perf_counter() - started)

                # Warm-up at the measured length until two runs agree, as the server's (the per-row
                # baseline, measured once and slow at the Qwen3 shape, warms up briefly: it is not
                # what the ratio compares).
                if sampler == "engine":
                    warmups = asyncio.run(_warm(rate))
                else:
                    engine.generate([prompt] * batch, [SamplingParams(
                        max_tokens=min(8, args.max_tokens), seed=0, ignore_eos=True)] * batch)
                    warmups = 1
                rates = [rate() for _ in range(args.repeats if sampler == "engine" else 1)]
                rows.append({"model": name, "path": sampler, "batch": batch, "max_tokens": args.max_tokens,
                             "tokens_per_s": statistics.median(rates), "tokens_per_s_runs": rates,
                             "request_p50_s": None, "engine_batches": [1] * len(rates), "warmups": warmups})
                console.print(f"  {sampler:<14} batch {batch:>3}: {statistics.median(rates):9.1f} tokens/s")

                # The split: the same decode, each forward (the KV store's decode: the model's
                # forward, or its CUDA graph's replay) and each draw timed between syncs. The
                # engine's own sampler is split with its draws outside the step, then timed as it
                # runs (slot steps draw inside: "forward" is the whole step but the first draw).
                for fused in ([False, True] if sampler == "engine" and engine.kv == "slots" else [False]):
                    engine.fused_draw = fused
                    splits.append(_split(engine, prompt, name, sampler, batch, args, sync))
                engine.fused_draw = sampler == "engine"
    # The batcher runs what serve-model runs: the draw inside the slot step. (Left as the per-row
    # baseline set it, the batcher rows of runs before 2026-11-28 06:00 drew outside the step.)
    engine.fused_draw = True
    rows += bench_batcher(engine, prompt, name, args)
    engine = None  # the model's memory goes back before empty_cache (a nested function holds the name)
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows, splits


def _split(engine, prompt: list[int], name: str, sampler: str, batch: int, args, sync) -> dict:
    """One decode's steps split into the KV store's decode and the draws, timed between syncs."""
    from rollmarket.engines import SamplingParams
    from rollmarket.engines.rollout import PaddedKV
    from rollmarket.engines.sampling import RowBatch
    from rollmarket.engines.slots import SlotKV

    spent = {"forward": 0.0, "sample": 0.0}
    draw = RowBatch.draw
    store = SlotKV if engine.kv == "slots" else PaddedKV
    forward = store.decode

    def timed(kind, fn):
        def run(*a, **k):
            sync()
            t = time.perf_counter()
            out = fn(*a, **k)
            sync()
            spent[kind] += time.perf_counter() - t
            return out
        return run

    RowBatch.draw = timed("sample", draw)
    store.decode = timed("forward", forward)
    try:
        steps = min(args.split_steps, args.max_tokens)
        session = engine.session()
        session.add([prompt] * batch, [SamplingParams(max_tokens=steps, seed=s, ignore_eos=True)
                                       for s in range(batch)])
        for _ in range(steps):
            session.step()
    finally:
        RowBatch.draw = draw
        store.decode = forward
    step_ms = 1000 * (spent["forward"] + spent["sample"]) / steps
    return {"model": name, "sampler": sampler, "batch": batch, "steps": steps,
            "draw": "in the step" if engine.fused_draw and engine.kv == "slots" else "next step",
            "forward_ms": 1000 * spent["forward"] / max(steps - 1, 1),
            "sample_ms": 1000 * spent["sample"] / steps, "step_ms": step_ms,
            "sample_share": spent["sample"] / (spent["forward"] + spent["sample"])}


def bench_batcher(engine, prompt: list[int], name: str, args) -> list[dict]:
    """The server's decode thread and hand-over without HTTP: bursts submitted straight to a
    ``Batcher`` (non-streaming, as the HTTP bursts) from an event loop in this process. Between
    ``engine`` and ``http`` it tells the decode thread's cost from the HTTP layer's and the client's."""
    from rollmarket.engines import SamplingParams
    from rollmarket.serve.batcher import DONE, Batcher

    batcher = Batcher(engine, max_seqs=max(args.batches), window_s=args.batch_window_ms / 1000)
    batcher.start()

    async def burst(batch: int) -> float:
        started = time.perf_counter()
        pendings = [batcher.submit(prompt, SamplingParams(max_tokens=args.max_tokens, seed=s, ignore_eos=True), 1,
                                   stream=False) for s in range(batch)]
        tokens = 0
        for pending in pendings:
            while (item := await pending.events.get()) is not DONE:
                assert not isinstance(item, Exception), item
                tokens += len(item)
        assert tokens == batch * args.max_tokens, tokens
        return tokens / (time.perf_counter() - started)

    rows = []
    try:
        for batch in args.batches:
            warmups = asyncio.run(_warm(lambda: burst(batch)))  # at the measured length, as the others
            rates, inside = [], []
            for _ in range(args.repeats):
                # The decode thread's own account, as the HTTP path reads it from /v1/engine: does a
                # burst lose its time inside the steps, or around them?
                before = batcher.counters()
                started = time.perf_counter()
                rates.append(asyncio.run(burst(batch)))
                wall = time.perf_counter() - started
                after = batcher.counters()
                delta = {k: after[k] - before[k] for k in ("decode_steps", "decode_seconds", "prefill_seconds",
                                                           "queue_seconds", "batches")}
                inside.append({"wall_s": wall, **delta,
                               "step_ms": 1000 * delta["decode_seconds"] / max(delta["decode_steps"], 1),
                               "queue_ms_mean": 1000 * delta["queue_seconds"] / batch})
            rows.append({"model": name, "path": "batcher", "batch": batch, "max_tokens": args.max_tokens,
                         "tokens_per_s": statistics.median(rates), "tokens_per_s_runs": rates,
                         "request_p50_s": None, "engine_batches": [int(r["batches"]) for r in inside],
                         "warmups": warmups, "server": inside,
                         "server_step_ms": statistics.median(r["step_ms"] for r in inside),
                         "decode_share": statistics.median((r["decode_seconds"] + r["prefill_seconds"]) / r["wall_s"]
                                                           for r in inside),
                         "queue_ms_mean": statistics.median(r["queue_ms_mean"] for r in inside)})
            console.print(f"  {'batcher':<14} batch {batch:>3}: {statistics.median(rates):9.1f} tokens/s "
                          f"(step {rows[-1]['server_step_ms']:.2f} ms, decode+prefill "
                          f"{rows[-1]['decode_share']:.0%} of wall, queue wait {rows[-1]['queue_ms_mean']:.1f} ms)")
    finally:
        batcher.stop()
    return rows


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the model, its server and torch (shared with serve_sustained.py)."""
    parser.add_argument("--model", type=Path, action="append", default=None,
                        help="Model directory (repeatable); default models/tiny-moe and models/tiny-dense.")
    parser.add_argument("--device", default="cpu", help="Torch device for server and engine: cpu, cuda, cuda:1.")
    parser.add_argument("--precision", default="bf16", help="Precision profile: fp32, bf16, fp16 or fp8.")
    parser.add_argument("--shape", default=None,
                        help=f"Comma-separated random-weight shapes from {', '.join(SHAPES)} (teacher_forcing's); "
                             f"default none on cpu, {DEFAULT_SHAPES['cuda']} on cuda ('' or none for none).")
    parser.add_argument("--batch-window-ms", type=float, default=5.0, help="The server's batching window.")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads for server and engine; default 1 on cpu, torch's own on cuda.")


def models_and_shapes(args) -> tuple[list[Path], list[str]]:
    """The shipped models (``--model``) and random-weight shapes (``--shape``) a run covers; sets
    torch's CPU threads (``--threads``: 1 on the CPU unless given). Shared with serve_sustained.py."""
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    shapes = [x for x in (DEFAULT_SHAPES[kind] if args.shape is None else args.shape).split(",") if x and x != "none"]
    models = [m.resolve() for m in (args.model or DEFAULT_MODELS)]
    if args.threads is None:
        args.threads = 1 if args.device == "cpu" else 0
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    return models, shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_arguments(parser)
    parser.add_argument("--batches", default="1,32", help="Comma-separated concurrent request counts.")
    parser.add_argument("--max-tokens", type=int, default=64, help="Completion tokens per request.")
    parser.add_argument("--repeats", type=int, default=3, help="Measured bursts per case (the median is kept).")
    parser.add_argument("--split-steps", type=int, default=32, help="Decode steps timed for the forward/sampling split.")
    parser.add_argument("--clients", type=int, default=1,
                        help="Client processes a burst's HTTP requests are split over (as rollout workers send "
                             "them); 1: all from this process, whose openai client's CPU then adds to the wall.")
    parser.add_argument("--no-engine", action="store_true", help="Skip the in-process engine comparison.")
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                        help="serve-model --engine-process / --no-engine-process: the server decodes in a process of "
                             "its own, or in its HTTP process; unset: serve-model's default (the engine process on "
                             "CUDA, the HTTP process on the CPU).")
    parser.add_argument("--out", type=Path, default=None,
                        help="Where to write the results as JSON; default benchmarks/results/serve_throughput.json "
                             "on cpu, serve_throughput-cuda.json on cuda.")
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    args.out = args.out or REPO / "benchmarks" / "results" / (
        "serve_throughput-cuda.json" if kind == "cuda" else "serve_throughput.json")
    models, shapes = models_and_shapes(args)

    results: list[dict] = []
    splits: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            models.append(materialise(shape, args, Path(tmp)))
        for model in models:
            console.print(f"[bold]{model.name}[/] at {args.precision} on {args.device}")
            results += bench_server(model, args, Path(tmp) / f"{model.name}.log")
            if not args.no_engine:
                rows, split = bench_engine(model, model.name, args)
                results += rows
                splits += split

    table = Table(title=f"serve-model decode throughput: {args.max_tokens} tokens per request, "
                        f"{args.precision} on {args.device}")
    for column in ("model", "path", "batch", "tokens/s", f"vs batch {args.batches[0]}", "/ engine",
                   "request p50 s", "prefills per burst", "ms per step", "server decode share", "queue wait ms"):
        table.add_column(column, justify="right")
    for row in results:
        base = next(r for r in results if (r["model"], r["path"], r["batch"]) ==
                    (row["model"], row["path"], args.batches[0]))
        engine = next((r for r in results if (r["model"], r["path"], r["batch"]) ==
                       (row["model"], "engine", row["batch"])), None)
        row["ratio_vs_first_batch"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["over_engine"] = row["tokens_per_s"] / engine["tokens_per_s"] if engine else None
        table.add_row(
            row["model"], row["path"], str(row["batch"]), f"{row['tokens_per_s']:.1f}",
            f"{row['ratio_vs_first_batch']:.2f}x",
            f"{row['over_engine']:.2f}" if row["path"] in ("http", "batcher") and engine else "-",
            f"{row['request_p50_s']:.3f}" if row["request_p50_s"] is not None else "-",
            ",".join(map(str, row["engine_batches"])) or "-",
            # http: the server's decode thread's own step time; engine: a burst's wall per step.
            f"{row['server_step_ms']:.2f}" if "server_step_ms" in row else
            f"{1000 * row['batch'] / row['tokens_per_s']:.2f}",
            f"{row['decode_share']:.0%}" if "decode_share" in row else "-",
            f"{row['queue_ms_mean']:.1f}" if "queue_ms_mean" in row else "-")
    console.print(table)
    if splits:
        split_table = Table(title="one decode step: model forward and sampling (ms, synchronised)")
        for column in ("model", "sampler", "draw", "batch", "forward ms", "sampling ms", "sampling share",
                       "step ms", "step vs per-row"):
            split_table.add_column(column, justify="right")
        for row in splits:
            base = next(r for r in splits if (r["model"], r["batch"], r["sampler"]) ==
                        (row["model"], row["batch"], "engine-per-row"))
            row["step_speedup_vs_per_row"] = base["step_ms"] / row["step_ms"]
            split_table.add_row(row["model"], row["sampler"], row["draw"], str(row["batch"]), f"{row['forward_ms']:.2f}",
                                f"{row['sample_ms']:.2f}", f"{row['sample_share']:.0%}", f"{row['step_ms']:.2f}",
                                f"{row['step_speedup_vs_per_row']:.2f}x")
        console.print(split_table)

    import torch

    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.platform(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "device": args.device, "device_name": _device_name(args.device), "precision": args.precision,
            "threads": args.threads or None, "batch_window_ms": args.batch_window_ms, "max_tokens": args.max_tokens, "clients": args.clients,
            "engine_process": args.engine_process, "batches": args.batches, "models": [str(m) for m in models[:len(models) - len(shapes)]], "shapes": shapes,
            "command": " ".join(sys.argv)}
    console.print(meta)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results, "split": splits}, indent=2) + "\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
