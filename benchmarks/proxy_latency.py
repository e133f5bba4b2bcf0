"""Capture-proxy overhead: added latency (p50/p99) and sustained request rate, direct vs via the proxy.

The upstream is a stub: a bare ASGI app under uvicorn (uvloop, httptools) that answers every
chat completion at once with a fixed vLLM-shaped body (64 response tokens with token ids,
logprobs and routed experts, 128 prompt token ids), or the same as a 64-event stream. An instant
upstream is the hardest case for a proxy: everything measured is the proxy's own cost, which a
real engine's generation time would hide. The proxy is a real `rollmarket proxy` process writing
every capture to SQLite (WAL) and, by default, answering only after the capture is committed.

The load generator is a minimal HTTP/1.1 keep-alive client on raw asyncio sockets (so that the
client's own cost stays small and equal for both paths), in this process. Phases, each run
against the upstream directly and through the proxy:

    latency    one request at a time (closed loop, 1 connection): p50 / p99 / p99.9
    rate R     open loop at R requests/s (100, 250, 500) for --seconds each: achieved rate and
               latency from each request's *scheduled* start (queueing counted)
    max        closed loop on 32 connections: the most requests/s

    python benchmarks/proxy_latency.py                    # everything, results JSON in benchmarks/results/
    python benchmarks/proxy_latency.py --seconds 3 --requests 500 --variants proxy,proxy-write-behind
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from rollmarket.localhost import free_port, wait_healthy

console = Console(width=max(Console().width, 140))
ROOT = Path(__file__).resolve().parents[1]
PROMPT_TOKENS, RESPONSE_TOKENS, LAYERS, TOP_K = 128, 64, 4, 2

# -- the stub upstream (run in a child process: `python proxy_latency.py --stub PORT`) ------------


def _stub_bodies() -> tuple[bytes, list[bytes]]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 150_000, RESPONSE_TOKENS).tolist()
    logprobs = (-rng.random(RESPONSE_TOKENS) * 3).round(6).tolist()
    experts = rng.integers(0, 64, (RESPONSE_TOKENS, LAYERS, TOP_K)).tolist()
    prompt_ids = rng.integers(0, 150_000, PROMPT_TOKENS).tolist()
    words = [f"w{t % 1000}" for t in ids]
    whole = {
        "id": "chatcmpl-stub", "object": "chat.completion", "created": 0, "model": "stub",
        "prompt_token_ids": prompt_ids,
        "choices": [{
            "index": 0, "finish_reason": "stop", "token_ids": ids, "routed_experts": experts,
            "message": {"role": "assistant", "content": " ".join(words), "tool_calls": []},
            "logprobs": {"content": [{"token": w, "logprob": lp, "bytes": list(w.encode()), "top_logprobs": []}
                                     for w, lp in zip(words, logprobs)]},
        }],
        "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": RESPONSE_TOKENS,
                  "total_tokens": PROMPT_TOKENS + RESPONSE_TOKENS},
    }
    events = [{"id": "chatcmpl-stub", "object": "chat.completion.chunk", "model": "stub",
               "prompt_token_ids": prompt_ids,
               "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
    for i, (t, w, lp) in enumerate(zip(ids, words, logprobs)):
        events.append({"id": "chatcmpl-stub", "object": "chat.completion.chunk", "model": "stub", "choices": [{
            "index": 0, "delta": {"content": " " + w}, "token_ids": [t], "routed_experts": [experts[i]],
            "logprobs": {"content": [{"token": w, "logprob": lp, "bytes": list(w.encode()), "top_logprobs": []}]},
            "finish_reason": "stop" if i == RESPONSE_TOKENS - 1 else None}]})
    stream = [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]
    return json.dumps(whole).encode(), stream


def run_stub(port: int) -> None:
    import uvicorn

    whole, stream = _stub_bodies()
    whole_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(whole)).encode())]
    sse_headers = [(b"content-type", b"text/event-stream")]

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/healthz":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
        elif b'"stream": true' in body or b'"stream":true' in body:
            await send({"type": "http.response.start", "status": 200, "headers": sse_headers})
            for event in stream:  # as fast as it can: each event its own write, as an engine's would be
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            await send({"type": "http.response.start", "status": 200, "headers": whole_headers})
            await send({"type": "http.response.body", "body": whole})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# -- a minimal keep-alive HTTP/1.1 client ---------------------------------------------------------


class Connection:
    def __init__(self, port: int):
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, raw: bytes) -> int:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        headers = head.lower()
        if b"transfer-encoding: chunked" in headers:
            while True:
                size = int((await self.reader.readuntil(b"\r\n"))[:-2], 16)
                await self.reader.readexactly(size + 2)
                if size == 0:
                    break
        else:
            start = headers.index(b"content-length:") + 15
            length = int(headers[start:headers.index(b"\r\n", start)])
            await self.reader.readexactly(length)
        return status

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _request_bytes(port: int, stream: bool) -> bytes:
    body = json.dumps({"model": "stub", "messages": [{"role": "system", "content": "You are terse."},
                                                      {"role": "user", "content": "Say something."}],
                       "max_tokens": RESPONSE_TOKENS, "stream": stream}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % (port, len(body))) + body


def _stats(latencies_s: list[float]) -> dict:
    ms = np.asarray(latencies_s) * 1000
    if ms.size == 0:
        return {"n": 0}
    return {"n": int(ms.size), "p50_ms": float(np.percentile(ms, 50)), "p90_ms": float(np.percentile(ms, 90)),
            "p99_ms": float(np.percentile(ms, 99)), "p999_ms": float(np.percentile(ms, 99.9)),
            "mean_ms": float(ms.mean())}


async def sequential(port: int, raw: bytes, count: int, warmup: int = 200) -> dict:
    conn = Connection(port)
    latencies = []
    try:
        for i in range(warmup + count):
            t0 = time.perf_counter()
            status = await conn.request(raw)
            if status != 200:
                raise RuntimeError(f"status {status}")
            if i >= warmup:
                latencies.append(time.perf_counter() - t0)
    finally:
        conn.close()
    return {**_stats(latencies), "total_requests": warmup + count}


async def open_loop(port: int, raw: bytes, rate: float, seconds: float) -> dict:
    """Send at `rate` requests/s on a pool of connections (a new one whenever all are busy)."""
    idle: list[Connection] = []
    latencies: list[float] = []
    errors = 0
    tasks = set()
    loop = asyncio.get_running_loop()

    async def one(scheduled: float) -> None:
        nonlocal errors
        conn = idle.pop() if idle else Connection(port)
        try:
            status = await conn.request(raw)
            if status != 200:
                errors += 1
            latencies.append(time.perf_counter() - scheduled)
            idle.append(conn)
        except Exception:
            errors += 1
            conn.close()

    start = time.perf_counter() + 0.05
    total = int(rate * seconds)
    for i in range(total):
        scheduled = start + i / rate
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = loop.create_task(one(scheduled))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    for conn in idle:
        conn.close()
    return {"offered_rps": rate, "achieved_rps": len(latencies) / elapsed, "errors": errors,
            "connections": len(idle), **_stats(latencies)}


async def closed_loop(port: int, raw: bytes, connections: int, seconds: float) -> dict:
    latencies: list[float] = []
    stop_at = time.perf_counter() + seconds
    warm_until = time.perf_counter() + min(1.0, seconds / 4)
    counted = [0]
    total = [0]

    async def worker() -> None:
        conn = Connection(port)
        try:
            while time.perf_counter() < stop_at:
                t0 = time.perf_counter()
                await conn.request(raw)
                total[0] += 1
                if t0 >= warm_until:
                    latencies.append(time.perf_counter() - t0)
                    counted[0] += 1
        finally:
            conn.close()

    await asyncio.gather(*(worker() for _ in range(connections)))
    return {"connections": connections, "achieved_rps": counted[0] / (stop_at - warm_until), **_stats(latencies),
            "total_requests": total[0]}


# -- driver -------------------------------------------------------------------------------------------


def _spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    handle = open(log, "ab")
    return subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _captures(db: Path) -> int:
    import sqlite3

    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT count(*) FROM captures").fetchone()[0]


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(port: int, args, pid: int | None) -> dict:
    """Every phase against one port; with `pid`, the proxy's CPU time per request of each phase."""

    async def timed(phase):
        before = _cpu_seconds(pid) if pid else 0.0
        result = await phase
        if pid:
            count = result.get("total_requests", result["n"])
            result["proxy_cpu_ms_per_request"] = (_cpu_seconds(pid) - before) * 1000 / max(count, 1)
        return result

    out: dict = {}
    for stream in (False, True) if args.stream else (False,):
        raw = _request_bytes(port, stream)
        key = "stream" if stream else "whole"
        out[f"latency_{key}"] = await timed(sequential(port, raw, args.requests))
    raw = _request_bytes(port, False)
    out["rates"] = [await timed(open_loop(port, raw, rate, args.seconds)) for rate in args.rates]
    out["max"] = await timed(closed_loop(port, raw, args.connections, args.seconds))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stub", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=2000, help="Sequential requests for the latency phase.")
    parser.add_argument("--rates", default="100,250,500", help="Offered loads, requests/s.")
    parser.add_argument("--seconds", type=float, default=5.0, help="Length of each load phase.")
    parser.add_argument("--connections", type=int, default=32, help="Connections of the max-rate phase.")
    parser.add_argument("--variants", default="direct,proxy,proxy-write-behind",
                        help="direct, proxy (acks after the capture is committed), proxy-write-behind.")
    parser.add_argument("--no-stream", dest="stream", action="store_false", help="Skip the streamed latency phase.")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/proxy_latency.json")
    args = parser.parse_args()
    if args.stub:
        run_stub(args.stub)
        return
    args.rates = [float(r) for r in args.rates.split(",")]
    variants = args.variants.split(",")

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    results: dict = {"variants": {}}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        stub_port = free_port()
        stub = _spawn([sys.executable, __file__, "--stub", str(stub_port)], tmp / "stub.log")
        try:
            wait_healthy(f"http://127.0.0.1:{stub_port}", stub, log=tmp / "stub.log")
            for variant in variants:
                proxy = None
                port = stub_port
                if variant.startswith("proxy"):
                    port = free_port()
                    db = tmp / f"{variant}.db"
                    cmd = [sys.executable, "-m", "rollmarket", "proxy", "--upstream", f"http://127.0.0.1:{stub_port}",
                           "--port", str(port), "--store", str(db), "--log-level", "warning"]
                    if variant == "proxy-write-behind":
                        cmd.append("--no-ack-after-write")
                    proxy = _spawn(cmd, tmp / f"{variant}.log")
                    wait_healthy(f"http://127.0.0.1:{port}", proxy, log=tmp / f"{variant}.log")
                console.print(f"[bold]{variant}[/] ...")
                try:
                    results["variants"][variant] = asyncio.run(measure(port, args, proxy.pid if proxy else None))
                finally:
                    if proxy is not None:
                        _stop(proxy)
                        results["variants"][variant]["captures_written"] = _captures(tmp / f"{variant}.db")
        finally:
            _stop(stub)

    results["machine"] = {"platform": platform.platform(), "python": platform.python_version(),
                          "cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()}
    results["config"] = {"requests": args.requests, "rates": args.rates, "seconds": args.seconds,
                         "connections": args.connections, "prompt_tokens": PROMPT_TOKENS,
                         "response_tokens": RESPONSE_TOKENS}
    results["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    report(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    console.print(f"results in {args.out}")


def report(results: dict) -> None:
    variants = results["variants"]
    direct = variants.get("direct")
    table = Table("phase", "variant", "req/s", "p50 ms", "p99 ms", "p99.9 ms", "added p50 ms", "added p99 ms",
                  "rate vs direct", "proxy CPU ms/req", title="capture proxy overhead")

    def row(phase: str, name: str, stats: dict, base: dict | None) -> None:
        added50 = added99 = ratio = "–"
        if base and name != "direct" and stats.get("n"):
            added50 = f"{stats['p50_ms'] - base['p50_ms']:+.2f}"
            added99 = f"{stats['p99_ms'] - base['p99_ms']:+.2f}"
            if "achieved_rps" in stats:
                ratio = f"{stats['achieved_rps'] / base['achieved_rps']:.3f}×"
        rps = f"{stats['achieved_rps']:.0f}" if "achieved_rps" in stats else f"{1000 / stats['mean_ms']:.0f} (1 conn)"
        cpu = f"{stats['proxy_cpu_ms_per_request']:.3f}" if "proxy_cpu_ms_per_request" in stats else "–"
        table.add_row(phase, name, rps, f"{stats['p50_ms']:.2f}", f"{stats['p99_ms']:.2f}", f"{stats['p999_ms']:.2f}",
                      added50, added99, ratio, cpu)

    for key in ("latency_whole", "latency_stream"):
        for name, res in variants.items():
            if key in res:
                row(key.replace("_", " "), name, res[key], direct.get(key) if direct else None)
    for i, rate in enumerate(results["config"]["rates"]):
        for name, res in variants.items():
            row(f"{rate:.0f} req/s offered", name, res["rates"][i], direct["rates"][i] if direct else None)
    for name, res in variants.items():
        row(f"max ({results['config']['connections']} conns)", name, res["max"], direct["max"] if direct else None)
    console.print(table)


if __name__ == "__main__":
    main()
