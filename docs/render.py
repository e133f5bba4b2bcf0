"""Regenerate every measured number in docs/benchmarks.md, docs/experiments.md and tiny-start's
headroom in docs/models.md from the raw results committed beside them, so a number in the docs always has its evidence in the repository.

A doc marks each generated part with a pair of HTML comments:

    <!-- generated: NAME -->
    ...text this script writes...
    <!-- /generated -->

`python docs/render.py` rewrites every marked block from the JSON under `benchmarks/results/` and
`experiments/results/`; `python docs/render.py --check` changes nothing and exits 1 when a block
differs from what the results give (tests/test_docs_numbers.py runs it). Text outside the blocks
is the method — commands, settings, reasoning — and quotes no measured number.

Plain json and string formatting only: this runs in the test suite and in CI without torch.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("docs/benchmarks.md", "docs/experiments.md", "docs/models.md", "docs/deploy.md")
BLOCK_RE = re.compile(r"<!-- generated: (?P<name>[a-z0-9-]+) -->\n(?P<body>.*?)<!-- /generated -->", re.S)

BLOCKS: dict[str, Callable[[], str]] = {}
LOADED: set[str] = set()  # every raw result a renderer read, so a test can find results no doc uses


class RenderError(Exception):
    """A doc names a block no renderer knows, or a raw result lacks what a block needs."""


def block(name: str):
    """Register the function that writes the block NAME (its text, without the markers)."""
    def register(fn: Callable[[], str]) -> Callable[[], str]:
        if name in BLOCKS:
            raise RenderError(f"two renderers for block {name!r}")
        BLOCKS[name] = fn
        return fn
    return register


@cache
def load(path: str):
    """A raw result, by its path from the repository root (read once per process)."""
    LOADED.add(path)
    return json.loads((ROOT / path).read_text())


# ---- formatting ---------------------------------------------------------------------------------

def n(x: float, digits: int = 0) -> str:
    """Thousands separators and a fixed number of decimals: 1,609 or 175.6."""
    return f"{x:,.{digits}f}"


def sci(x: float, digits: int = 1) -> str:
    """9.5e-7 (no padded exponent); an exact zero stays 0."""
    if x == 0:
        return "0"
    mantissa, exponent = f"{x:.{digits}e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def times(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}×"


def signed(x: float, digits: int = 3) -> str:
    return f"{x:+.{digits}f}".replace("-", "−")


def pct(x: float, digits: int = 0) -> str:
    return f"{100 * x:.{digits}f}%"


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f}"


def span(lo: str, hi: str) -> str:
    """'a–b', or just 'a' when both ends print alike."""
    return lo if lo == hi else f"{lo}–{hi}"


def bold(text: str, on: bool = True) -> str:
    return f"**{text}**" if on else text


def table(header: list[str], align: list[str], rows: list[list[str]]) -> str:
    """A markdown table; align holds 'l' or 'r' per column."""
    rule = ["---" if a == "l" else "---:" for a in align]
    lines = ["| " + " | ".join(cells) + " |" for cells in [header, *rows]]
    return "\n".join([lines[0], "|" + "|".join(rule) + "|", *lines[1:]])


def provenance(path: str, meta: dict, *, date: str | None = None, inline: bool = False) -> str:
    """The one line that keeps a result's file, machine and date with its numbers (`inline`: as a
    clause inside a sentence)."""
    machine = meta.get("machine")
    if isinstance(machine, dict):
        parts = [machine.get("platform", "")]
        if "cpus" in machine:
            parts.append(f"{machine['cpus']} CPUs")
        if "python" in machine:
            parts.append(f"Python {machine['python']}")
        if "numpy" in machine:
            parts.append(f"numpy {machine['numpy']}")
        if "load_average" in machine:
            parts.append(f"load average {machine['load_average'][0]:.1f} at the start")
        for key in ("gpu", "device_name", "torch", "transformers", "note"):
            if key in machine:
                value = str(machine[key])
                parts.append(f"torch {value}" if key == "torch" and not value.startswith("torch") else value)
    else:
        parts = [str(machine), f"{meta['cpus']} CPUs" if "cpus" in meta else "",
                 f"Python {meta['python']}" if "python" in meta else ""]
        for key in ("gpu", "device_name", "torch", "transformers", "triton"):
            if key in meta and meta[key] not in ("x86_64", "cpu"):
                parts.append(f"{key.replace('_name', '')} {meta[key]}" if key in ("torch", "transformers", "triton")
                             else str(meta[key]))
    when = date or meta.get("date") or meta.get("created_at")
    machine_text = ", ".join(p for p in parts if p)
    if inline:
        return f"raw result `{path}`; Machine: {machine_text}; Date: {when}"
    return f"Raw result: `{path}`. Machine: {machine_text}. Date: {when}."


# ---- exchange throughput ------------------------------------------------------------------------

EXCHANGE = "benchmarks/results/exchange_throughput.json"


def _exchange_rows() -> dict[tuple[int, str], dict]:
    return {(r["workers"], r["mode"]): r for r in load(EXCHANGE)["results"]}


@block("exchange-provenance")
def _():
    return provenance(EXCHANGE, load(EXCHANGE)["meta"])


@block("exchange-table")
def _():
    rows = _exchange_rows()
    out = []
    for (workers, mode), r in rows.items():
        paced = r["paced_tokens_per_s"] is not None
        json_rate = rows[(workers, "json")]["tokens_per_s"]
        bare_rate = rows[(workers, "bare-json")]["tokens_per_s"]
        lease = "–" if r.get("lease_p50_ms") is None else f"{r['lease_p50_ms']:.1f} / {bold(n(r['lease_p99_ms'], 1), paced)}"
        out.append([
            str(workers), mode, n(r["groups_per_s"], 1),
            bold(f"{r['tokens_per_s'] / 1e6:.2f}M", workers == 16 and mode.startswith("msgpack")),
            "–" if paced else bold(times(r["tokens_per_s"] / json_rate), mode == "msgpack"),
            "–" if paced else times(r["tokens_per_s"] / bare_rate),
            f"{r['submit_p50_ms']:.1f} / {bold(n(r['submit_p99_ms'], 1), paced)}",
            lease, f"{r['server_cpu_ms_per_group']:.2f}",
        ])
    return table(["workers", "mode", "groups/s", "response tokens/s", "vs json", "vs bare-json",
                  "submit p50 / p99 ms", "lease p50 / p99 ms", "server CPU ms/group"],
                 list("rl") + list("r" * 7), out)


@block("exchange-goal")
def _():
    rows = _exchange_rows()
    paced, sat = rows[(16, "msgpack @2M/s")], rows[(16, "msgpack")]
    return (
        "**Against the goal** (2,000,000 response tokens/s with 16 workers, p99 submit and lease latency\n"
        "under 50 ms, with full validation, hashing and durable writes): "
        f"{'met' if paced['submit_p99_ms'] < 50 and paced['lease_p99_ms'] < 50 else 'not met'} at the target load — "
        f"paced at {paced['tokens_per_s'] / 1e6:.1f}M tokens/s\n"
        f"the p99s are {paced['submit_p99_ms']:.0f} ms (submit) and {paced['lease_p99_ms']:.0f} ms (lease); "
        f"run back to back the exchange takes\n{sat['tokens_per_s'] / 1e6:.1f}M tokens/s. At that saturation the "
        f"p99s are {sat['submit_p99_ms']:.0f} ms and {sat['lease_p99_ms']:.0f} ms: 16 closed-loop\n"
        f"clients always queue behind each other (Little's law: 16 in flight at "
        f"~{sat['server_cpu_ms_per_group']:.0f} ms of server CPU per\n"
        "group), so latency there measures the queue, not the service."
    )


LIMITS = "benchmarks/results/exchange_throughput_limits.json"


@block("exchange-limits-provenance")
def _():
    data = load(LIMITS)
    dates = sorted(r["meta"]["date"] for r in data.values())
    meta = data["new-round1"]["meta"]
    return provenance(LIMITS, meta, date=f"{dates[0]} to {dates[-1]} (four rounds, alternated)")


@block("exchange-limits-table")
def _():
    data = load(LIMITS)

    def rate(round_name: str, workers: int, mode: str) -> float:
        return next(r["tokens_per_s"] for r in data[round_name]["results"]
                    if r["workers"] == workers and r["mode"] == mode)

    out = []
    for workers, mode in [(1, "msgpack"), (1, "json"), (16, "msgpack"), (16, "json")]:
        old = [rate(f"old-round{i}", workers, mode) for i in (1, 2)]
        new = [rate(f"new-round{i}", workers, mode) for i in (1, 2)]
        out.append([str(workers), mode, " / ".join(f"{x / 1e6:.2f}" for x in old),
                    " / ".join(f"{x / 1e6:.2f}" for x in new), times(statistics.mean(new) / statistics.mean(old))])
    paced = [r["tokens_per_s"] for v in data.values() for r in v["results"] if r["paced_tokens_per_s"]]
    return (table(["workers", "mode", "before (M tokens/s, 2 runs)", "with the limits (2 runs)", "ratio of means"],
                  list("rlrrr"), out)
            + f"\n\nPaced at 2M tokens/s with 16 workers, both versions kept up in every round "
              f"({span(f'{min(paced) / 1e6:.2f}', f'{max(paced) / 1e6:.2f}')}M).")


# ---- capture proxy ------------------------------------------------------------------------------

PROXY = "benchmarks/results/proxy_latency.json"


@block("proxy-provenance")
def _():
    return provenance(PROXY, load(PROXY))


@block("proxy-table")
def _():
    v = load(PROXY)["variants"]
    direct, proxy = v["direct"], v["proxy"]

    def row(label, a, b, rate="–", strong=False):
        added = bold(signed(b["p50_ms"] - a["p50_ms"], 2), strong) + " / " + signed(b["p99_ms"] - a["p99_ms"], 2)
        return [label, f"{a['p50_ms']:.2f} / {a['p99_ms']:.2f}", f"{b['p50_ms']:.2f} / {b['p99_ms']:.2f}", added, rate]

    out = [row("1 connection, whole answer", direct["latency_whole"], proxy["latency_whole"], strong=True),
           row("1 connection, 64-event stream", direct["latency_stream"], proxy["latency_stream"])]
    for a, b in zip(direct["rates"], proxy["rates"]):
        last = a is direct["rates"][-1]
        out.append(row(f"{a['offered_rps']:.0f} req/s offered", a, b,
                       bold(times(b["achieved_rps"] / a["achieved_rps"], 3), last), strong=last))
    out.append([f"closed loop, {direct['max']['connections']} connections", f"{n(direct['max']['achieved_rps'])} req/s",
                f"{n(proxy['max']['achieved_rps'])} req/s", "–", "–"])
    return table(["phase", "direct p50 / p99 ms", "via proxy p50 / p99 ms", "added p50 / p99 ms", "rate vs direct"],
                 list("lrrrr"), out)


@block("proxy-prose")
def _():
    v = load(PROXY)["variants"]
    direct, proxy = v["direct"], v["proxy"]
    added = [b["p50_ms"] - a["p50_ms"] for a, b in zip(direct["rates"], proxy["rates"])]
    added.append(proxy["latency_whole"]["p50_ms"] - direct["latency_whole"]["p50_ms"])
    kept = min(b["achieved_rps"] / a["achieved_rps"] for a, b in zip(direct["rates"], proxy["rates"]))
    cpu = [proxy["latency_whole"]["proxy_cpu_ms_per_request"]] + [r["proxy_cpu_ms_per_request"] for r in proxy["rates"]]
    holds = max(added) < 2 and kept > 0.99
    return (
        f"The goal — under 2 ms added at p50 and no loss of throughput below 500 requests/s — "
        f"{'holds' if holds else 'is not met'}\n(added p50 at most {max(added):.2f} ms, rate kept "
        f"{kept:.3f}×). The proxy spends {span(f'{min(cpu):.1f}', f'{max(cpu):.1f}')} ms of CPU per whole call "
        f"and {proxy['latency_stream']['proxy_cpu_ms_per_request']:.1f} ms per 64-event stream;\n"
        f"closed-loop, one proxy process served {n(proxy['max']['achieved_rps'])} req/s on this box; past that, "
        "run more proxies. The\nclosed-loop ratio against the stub (which does no work) is not a meaningful comparison."
    )


# ---- model server -------------------------------------------------------------------------------

SERVE = "benchmarks/results/serve_throughput.json"
SERVE_CUDA = "benchmarks/results/serve_throughput-cuda.json"
SERVE_CUDA_BEFORE = "benchmarks/results/serve_throughput-cuda-before.json"
SERVE_MODELS = {"tiny-moe": "tiny-moe", "tiny-dense": "tiny-dense", "qwen3-0.6b": "Qwen3-0.6B shape"}


def _serve(path: str) -> dict[tuple[str, str, int], dict]:
    return {(r["model"], r["path"], r["batch"]): r for r in load(path)["results"]}


@block("serve-provenance")
def _():
    return provenance(SERVE, load(SERVE)["meta"])


@block("serve-table")
def _():
    rows = _serve(SERVE)
    out = []
    for model in ("tiny-moe", "tiny-dense"):
        for path in ("http", "engine"):
            one, many = rows[(model, path, 1)], rows[(model, path, 32)]
            out.append([model, "HTTP" if path == "http" else "engine", n(one["tokens_per_s"]), n(many["tokens_per_s"]),
                        bold(times(many["tokens_per_s"] / one["tokens_per_s"], 1), path == "http")])
    return table(["model", "path", "batch 1 tok/s", "batch 32 tok/s", "batch 32 / batch 1"], list("llrrr"), out)


@block("serve-cuda")
def _():
    rows, cpu = _serve(SERVE_CUDA_BEFORE), _serve(SERVE)

    def pair(model, path):
        one, many = rows[(model, path, 1)]["tokens_per_s"], rows[(model, path, 32)]["tokens_per_s"]
        return one, many

    (me1, me32), (de1, de32) = pair("tiny-moe", "engine"), pair("tiny-dense", "engine")
    (mh1, mh32), (dh1, dh32) = pair("tiny-moe", "http"), pair("tiny-dense", "http")
    kept = [cpu[(m, "http", b)]["tokens_per_s"] / cpu[(m, "engine", b)]["tokens_per_s"]
            for m in ("tiny-moe", "tiny-dense") for b in (1, 32)]
    meta = load(SERVE_CUDA_BEFORE)["meta"]
    return (
        f"Before continuous batching and the batched sampler, on one GPU (`benchmarks/serve_throughput.py --device cuda`; "
        f"{provenance(SERVE_CUDA_BEFORE, meta, inline=True)}) the\ntiny "
        f"models are launch-bound: the engine alone reaches {n(me1)} → {n(me32)} tok/s (tiny-moe, {me32 / me1:.0f}×) "
        f"and {n(de1)} → {n(de32)}\n(tiny-dense, {de32 / de1:.0f}×) from batch 1 to 32, but through HTTP only "
        f"{n(mh1)} → {n(mh32)} and {n(dh1)} → {n(dh32)}: bursts split into\ntwo engine batches and the event loop "
        "and the decode loop contend for the GIL when each step is a few\nmilliseconds. On the CPU, where "
        "steps are compute-bound, HTTP gives "
        f"{span(f'{min(kept):.2f}', f'{max(kept):.2f}')}× the engine's rate (median of 3 each)."
    )


@block("serve-cuda-batching")
def _():
    if not (ROOT / SERVE_CUDA).is_file():
        return ("Not measured yet: the continuous-batching server and the batched sampler wait for "
                "`python benchmarks/serve_throughput.py --device cuda` on the device.")
    result = load(SERVE_CUDA)
    rows = _serve(SERVE_CUDA)
    models = [m for m in SERVE_MODELS if (m, "http", 32) in rows]
    out = []
    for model in models:
        http, engine, per_row = (rows[(model, path, 32)]["tokens_per_s"] for path in ("http", "engine", "engine-per-row"))
        out.append([SERVE_MODELS[model], n(rows[(model, "http", 1)]["tokens_per_s"]),
                    n(rows[(model, "engine", 1)]["tokens_per_s"]), n(http), n(engine),
                    bold(times(http / engine), True), n(per_row), times(engine / per_row)])
    speed = table(["model", "HTTP b1 tok/s", "engine b1 tok/s", "HTTP b32 tok/s", "engine b32 tok/s",
                   "HTTP / engine (b32)", "per-row sampler b32 tok/s", "batched / per-row (b32)"],
                  list("lrrrrrrr"), out)
    # Runs before the draw moved into the slot step have one split per sampler, drawn the next step.
    split = {(r["model"], r["sampler"], r["batch"], r.get("draw", "next step")): r for r in result["split"]}
    out = []
    for model in models:
        for batch in result["meta"]["batches"]:
            before, after = split[(model, "engine-per-row", batch, "next step")], split[(model, "engine", batch, "next step")]
            inside = split.get((model, "engine", batch, "in the step"))
            out.append([SERVE_MODELS[model], str(batch), n(before["forward_ms"], 2), n(before["sample_ms"], 2),
                        n(after["sample_ms"], 2), f"{pct(before['sample_share'])} → {pct(after['sample_share'])}",
                        times(before["step_ms"] / after["step_ms"]), n(after["step_ms"], 2),
                        n(inside["step_ms"], 2) if inside else "-"])
    steps = table(["model", "batch", "forward ms", "sampling ms, per-row", "sampling ms, batched",
                   "sampling share of a step", "step speed-up", "step ms, drawn after it",
                   "step ms, drawn inside it"], list("lrrrrrrrr"), out)
    ratios = {SERVE_MODELS[m]: rows[(m, "http", 32)]["tokens_per_s"] / rows[(m, "engine", 32)]["tokens_per_s"]
              for m in models}
    goal = ("HTTP at batch 32 against the engine alone (issue 18's goal: ≥ 0.8×): "
            + "; ".join(f"{label} {times(r)} {'met' if r >= 0.8 else '**missed**'}" for label, r in ratios.items())
            + ".\n")
    return (f"{provenance(SERVE_CUDA, result['meta'])}\n\n{speed}\n\n{goal}\nOne decode step, forward and sampling "
            f"timed between device synchronisations ({result['split'][0]['steps']} steps):\n\n{steps}")


SERVE_CUDA_RUNS = (
    ("benchmarks/results/serve_throughput-cuda-h100.json", "padded"),
    ("benchmarks/results/serve_throughput-cuda-h200x2.json", "padded"),
    ("benchmarks/results/serve_throughput-cuda-h200-padded.json", "padded"),
    ("benchmarks/results/serve_throughput-cuda-h200-slots.json", "slots + graphs"),
    ("benchmarks/results/serve_throughput-cuda-h200-slots2.json", "slots + graphs"),
    ("benchmarks/results/serve_throughput-long-cuda.json", "slots + graphs"),
    ("benchmarks/results/serve_throughput-clients-cuda-1.json", "slots + graphs"),
    ("benchmarks/results/serve_throughput-cuda-h200-slots3.json", "slots + graphs"),
    ("benchmarks/results/serve_throughput-clients-cuda-2.json", "slots + graphs"),
    ("benchmarks/results/serve_throughput-cuda-h200-gc.json", "slots + graphs, gc frozen"),
    ("benchmarks/results/serve_throughput-cuda-h200-draw.json", "the same, draw inside the step"),
    ("benchmarks/results/serve_throughput-clients-cuda-3.json", "the same, draw inside the step"),
    (SERVE_CUDA, "MoE graphed too, engine process"),
    ("benchmarks/results/serve_throughput-thread-cuda.json", "MoE graphed too, in-process decode"),
    ("benchmarks/results/serve_throughput-clients-cuda-4.json", "MoE graphed too, engine process"),
    ("benchmarks/results/serve_throughput-clients-cuda.json", "MoE graphed too, engine process, lean pipe"),
    ("benchmarks/results/serve_throughput-tiny-cuda.json", "MoE graphed too, engine process, lean pipe"),
)
"""Every committed GPU run of the same benchmark since its warm-ups settled, oldest first, with the
decode's KV cache it ran (``padded``: the DynamicCache before engines/slots.py; tiny-moe, an MoE
model, decodes eagerly until ``MoE graphed too``; ``gc frozen``: serve-model freezes its start-up objects out of the
garbage collector's full passes; ``draw inside the step``: a slot step samples each row's next
token inside its graph, and a busy batch takes joiners in groups; ``MoE graphed too``: tiny-moe's
slot steps are CUDA graphs as well, router capture inside, and the server's default placement on
CUDA (an engine process) or ``--no-engine-process``; ``lean pipe``: events cross the engine
process's pipe as tuples, routed experts only when asked). The batcher rows of the ``draw inside
the step`` and ``MoE graphed too`` runs drew outside the step: the benchmark left the engine as its
per-row baseline had set it (fixed after them)."""


@block("serve-runs")
def _():
    present = [(path, kv) for path, kv in SERVE_CUDA_RUNS if (ROOT / path).exists()]
    out = []
    met: dict[tuple[str, str], list[int]] = {}
    for path, kv in present:
        meta, rows = load(path)["meta"], _serve(path)
        for model, label in SERVE_MODELS.items():
            if (model, "http", 32) not in rows:
                continue
            http, engine, batcher = (rows[(model, p, 32)]["tokens_per_s"] for p in ("http", "engine", "batcher"))
            tally = met.setdefault((label, kv), [0, 0])
            tally[0] += http / engine >= 0.8
            tally[1] += 1
            spread = rows[(model, "http", 32)].get("tokens_per_s_runs") or [http]
            out.append([f"{meta['date'][:16].replace('T', ' ')}, {meta['device_name']}, {meta['cpus']} CPUs",
                        kv, str(rows[(model, "http", 32)].get("clients", 1)), str(meta["max_tokens"]), label,
                        n(engine), n(batcher), n(http), ", ".join(n(x) for x in spread),
                        bold(times(http / engine, 3), True), times(http / batcher)])
    verdict = "; ".join(f"{label} ({kv}) in {ok} of {runs}" for (label, kv), (ok, runs) in met.items())
    newest = load(present[-1][0])["meta"]
    return ("Raw results: " + ", ".join(f"`{p}`" for p, _ in present)
            + f". Machine: {newest['machine']}, Python {newest['python']}, torch {newest['torch']}, "
            f"the card and CPUs of each run in its row. Date: {newest['date']} (the newest).\n\n"
            + table(["run", "decode KV", "client processes", "tokens per request", "model", "engine b32 tok/s",
                     "batcher b32 tok/s", "HTTP b32 tok/s", "HTTP bursts tok/s", "**HTTP / engine**",
                     "HTTP / batcher"], list("llrrlrrrrrr"), out)
            + f"\n\nHTTP at batch 32 at least 0.8× the engine alone, by run: {verdict}.")


DECODE_PROFILE = "benchmarks/results/decode_profile-cuda.json"
DECODE_PROFILE_SDPA = "benchmarks/results/decode_profile-sdpa-cuda.json"
DECODE_PROFILE_BEFORE = "benchmarks/results/decode_profile-cuda-draw-after.json"
KV_LABELS = {"padded": "padded DynamicCache", "slots": "slots, eager", "graphs": "slots, CUDA graphs"}


def _decode_rows(data: dict, column: str) -> tuple[list[list[str]], list[str]]:
    rows, failed = [], []
    for r in data["rows"]:
        label = KV_LABELS.get(r.get(column), r.get(column)) if column == "kv" else r.get(column, "default")
        if "error" in r:
            failed.append(f"{SERVE_MODELS.get(r['model'], r['model'])} at batch {r['batch']} with {label}: "
                          f"{r['error'][:120]}")
            continue
        runs = r["wall_ms_runs"]
        rows.append([SERVE_MODELS.get(r["model"], r["model"]), label, str(r["batch"]), n(r["kernels_per_step"]),
                     n(r["kernel_ms"], 2), f"{n(r['wall_ms'], 1)} ({n(min(runs), 1)}–{n(max(runs), 1)})",
                     n(r["wall_ms_again"], 1), bold(times(r["wall_ms_again"] / r["kernel_ms"], 1))])
    return rows, failed


@block("decode-profile")
def _():
    if not (ROOT / DECODE_PROFILE).exists():
        return (f"Not measured yet: `{DECODE_PROFILE}` is absent "
                "(`bash benchmarks/gpu_run.sh decode_profile` on the device).")
    data = load(DECODE_PROFILE)
    heads = ["model", "{}", "batch", "kernels a step", "kernels ms a step",
             "step wall ms, first pass: median (range)", "second pass", "**second ÷ kernels**"]
    rows, failed = _decode_rows(data, "kv")
    out = (provenance(DECODE_PROFILE, data) + "\n\n"
           + table([h.format("decode KV cache") for h in heads], list("llrrrrrr"), rows))
    if (ROOT / DECODE_PROFILE_SDPA).exists():
        sdpa = load(DECODE_PROFILE_SDPA)
        rows, failed_sdpa = _decode_rows(sdpa, "sdpa")
        failed += failed_sdpa
        out += ("\n\nThe padded cache with each masked attention kernel pinned in turn (before the slots): "
                + provenance(DECODE_PROFILE_SDPA, sdpa) + "\n\n"
                + table([h.format("attention") for h in heads], list("llrrrrrr"), rows))
    if (ROOT / DECODE_PROFILE_BEFORE).exists():
        before = load(DECODE_PROFILE_BEFORE)
        was = {(r["model"], r["batch"]): r for r in before["rows"] if r.get("kv") == "graphs" and "error" not in r}
        pairs = [[SERVE_MODELS.get(r["model"], r["model"]), str(r["batch"]),
                  n(was[(r["model"], r["batch"])]["wall_ms_again"], 2), n(r["wall_ms_again"], 2),
                  bold(times(was[(r["model"], r["batch"])]["wall_ms_again"] / r["wall_ms_again"]))]
                 for r in data["rows"] if r.get("kv") == "graphs" and (r["model"], r["batch"]) in was and "error" not in r]
        out += ("\n\nThe graphed step before the draw moved inside it (the sampler's kernels ran eagerly after "
                "each replay): " + provenance(DECODE_PROFILE_BEFORE, before) + "\n\n"
                + table(["model", "batch", "step ms, draw after the graph", "step ms, draw inside it", "**speed-up**"],
                        list("lrrrr"), pairs))
    return out + ("\n\nNot measured: " + "; ".join(failed) + "." if failed else "")


SERVE_SUSTAINED = "benchmarks/results/serve_sustained-cuda.json"
SERVE_SUSTAINED_ROOM = "benchmarks/results/serve_sustained-room-cuda.json"


def _sustained_rows(result: dict) -> tuple[list[list[str]], dict[str, float]]:
    rows, ratios = [], {}
    by = {(r["model"], r["path"]): r for r in result["results"]}
    for model, label in SERVE_MODELS.items():
        if (model, "http") not in by:
            continue
        http, engine = by[(model, "http")], by[(model, "engine")]
        ratios[label] = http["tokens_per_s"] / engine["tokens_per_s"]
        rows.append([label, n(engine["tokens_per_s"]), n(engine["mean_batch"], 1), n(engine["prefills"]),
                     n(http["tokens_per_s"]), ", ".join(n(x) for x in http["tokens_per_s_runs"]),
                     n(http["mean_batch"], 1), n(http["prefills"]), n(http["server_step_ms"], 2),
                     n(http["client_cpu_ms_per_request"], 2), bold(times(ratios[label]), True)])
    return rows, ratios


@block("serve-sustained")
def _():
    if not (ROOT / SERVE_SUSTAINED).exists():
        return f"Not measured yet: `{SERVE_SUSTAINED}` is absent (`bash benchmarks/gpu_run.sh serve_sustained`)."
    result = load(SERVE_SUSTAINED)
    meta = result["meta"]
    heads = ["model", "engine tok/s", "engine mean batch", "engine prefills", "HTTP tok/s", "HTTP runs tok/s",
             "HTTP mean batch", "HTTP prefills", "server step ms", "client CPU ms a request", "**HTTP / engine**"]
    rows, ratios = _sustained_rows(result)
    out = (provenance(SERVE_SUSTAINED, meta) + f" {meta['requests']} requests of {meta['max_tokens'] // 2}–"
           f"{3 * meta['max_tokens'] // 2} tokens, {meta['concurrency']} in flight, over {meta['clients']} client "
           "processes; the median of " + str(len(result["results"][0]["tokens_per_s_runs"])) + " runs.\n\n"
           + table(heads, list("lrrrrrrrrrr"), rows)
           + "\n\nUnder sustained load, HTTP against the engine alone (issue 18's goal: ≥ 0.8×): "
           + "; ".join(f"{label} {times(r)} {'met' if r >= 0.8 else '**missed**'}" for label, r in ratios.items()) + ".")
    if (ROOT / SERVE_SUSTAINED_ROOM).exists():
        room = load(SERVE_SUSTAINED_ROOM)
        rows, _ = _sustained_rows(room)
        out += ("\n\nThe first run, whose rule let waiting requests join whenever they filled the batch's free "
                "room (a full batch frees a slot or two a step, so nearly every step was a prefill): "
                + provenance(SERVE_SUSTAINED_ROOM, room["meta"]) + "\n\n" + table(heads, list("lrrrrrrrrrr"), rows))
    return out


SERVE_PROCESS_RUNS = {"benchmarks/results/serve_sustained-process-cuda.json": "torch's CPU threads",
                      "benchmarks/results/serve_sustained-process-t1-cuda.json": "1 CPU thread"}


@block("serve-engine-process")
def _():
    """Sustained load through serve-model decoding in its HTTP process and in an engine process."""
    rows, verdicts, runs = [], [], []
    for path, threads in SERVE_PROCESS_RUNS.items():
        result = load(path)
        runs.append(provenance(path, result["meta"]))
        by = {(r["model"], r["path"]): r for r in result["results"]}
        for model, label in SERVE_MODELS.items():
            if (model, "http-process") not in by:
                continue
            engine, inside, outside = by[(model, "engine")], by[(model, "http")], by[(model, "http-process")]
            ratio_in = inside["tokens_per_s"] / engine["tokens_per_s"]
            ratio_out = outside["tokens_per_s"] / engine["tokens_per_s"]
            spans = [(min(r["tokens_per_s_runs"]), max(r["tokens_per_s_runs"])) for r in (inside, outside)]
            rows.append([label, threads, n(engine["tokens_per_s"]), n(inside["tokens_per_s"]),
                         f"{n(spans[0][0])}–{n(spans[0][1])}", n(inside["server_step_ms"], 2), times(ratio_in),
                         n(outside["tokens_per_s"]), f"{n(spans[1][0])}–{n(spans[1][1])}",
                         n(outside["server_step_ms"], 2), times(ratio_out), bold(times(ratio_out / ratio_in), True)])
            apart = spans[0][1] < spans[1][0] or spans[1][1] < spans[0][0]
            verdicts.append(f"{label} ({threads}) {times(ratio_out / ratio_in)}, runs "
                            + ("apart" if apart else "overlapping"))
    return ("\n\n".join(runs) + "\n\n"
            + table(["model", "torch threads", "engine tok/s", "HTTP tok/s, in-process decode", "its runs",
                     "server step ms", "÷ engine", "HTTP tok/s, engine process", "its runs", "server step ms",
                     "÷ engine", "**engine process ÷ in-process**"], list("llrrrrrrrrrr"), rows)
            + "\n\nThe engine process against the in-process decode, HTTP throughput (medians of 3 runs): "
            + "; ".join(verdicts) + ".")


SERVE_BATCHER = "benchmarks/results/serve_batcher-cuda.json"
SERVE_SUSTAINED_MOE = "benchmarks/results/serve_sustained-moe-cuda.json"


@block("serve-batcher")
def _():
    """tiny-moe's decode step: the engine alone, the server's Batcher in-process, the server over HTTP."""
    sustained = load(SERVE_SUSTAINED_MOE)
    by = {r["path"]: r for r in sustained["results"]}
    batcher = load(SERVE_BATCHER)
    plain = batcher["results"][0]
    rows = [["engine alone (`DecodeSession`, closed loop)", n(by["engine"]["tokens_per_s"]),
             n(by["engine"]["step_only_ms"], 2), "`serve_sustained.py`"],
            ["serve-model over HTTP (decoding in its HTTP process)", n(by["http"]["tokens_per_s"]),
             n(by["http"]["server_step_ms"], 2), "`serve_sustained.py`"]]
    rows += [[f"the server's `Batcher` in-process, {r['condition']}", n(r["tokens_per_s"]), n(r["step_ms"], 2),
              "`serve_batcher.py`"] for r in batcher["results"]]
    busiest = max((r for r in batcher["results"] if r["busy_share"]), key=lambda r: r["busy_share"])
    return (provenance(SERVE_SUSTAINED_MOE, sustained["meta"]) + "\n\n" + provenance(SERVE_BATCHER, batcher["meta"])
            + f" The Batcher: one measured run per condition after a warm-up run; serve_sustained: the median of "
            f"{len(by['http']['tokens_per_s_runs'])} runs. Both: {batcher['meta']['requests']} requests of "
            f"{batcher['meta']['max_tokens'] // 2}–{3 * batcher['meta']['max_tokens'] // 2} tokens, "
            f"{batcher['meta']['concurrency']} streams.\n\n"
            + table(["tiny-moe, bf16", "tokens/s", "decode step ms", "from"], list("lrrl"), rows)
            + f"\n\nThe server's step over HTTP is {times(by['http']['server_step_ms'] / plain['step_ms'])} the "
            f"in-process Batcher's; a thread holding the interpreter {busiest['busy_share']:.0%} of the time makes "
            f"the Batcher's step {times(busiest['step_ms'] / plain['step_ms'])} its plain one.")


DECODE_SHAPES = "benchmarks/results/decode_shapes-cuda.json"
SERVE_SUSTAINED_BUCKETS = "benchmarks/results/serve_sustained-moe-buckets-cuda.json"


DECODE_SHAPES_CPU = {"tiny-moe": "benchmarks/results/decode_shapes.json",
                     "tiny-dense": "benchmarks/results/decode_shapes-dense.json"}


def _decode_shapes_cpu() -> str:
    """The same runs on this project's 2-core CPU box: no cost per new shape."""
    lines = []
    for model, path in DECODE_SHAPES_CPU.items():
        data = load(path)
        def span(rows, key):  # noqa: E306
            values = [r[key] for r in rows if r[key] is not None]
            return f"{n(min(values), 1)}–{n(max(values), 1)}"
        exact = [r for r in data["rows"] if r["condition"] == "exact"]
        buckets = [r for r in data["rows"] if r["condition"] == "buckets"]
        lines.append(f"{model}: exact shapes, a step on a new shape {span(exact, 'new_shape_step_ms')} ms and on a "
                     f"seen one {span(exact, 'seen_shape_step_ms')} ms; whole runs exact "
                     f"{span(exact, 'step_ms')} ms a step, bucketed {span(buckets, 'step_ms')} ms")
    first = load(next(iter(DECODE_SHAPES_CPU.values())))
    return ("\n\nOn the CPU (" + provenance(next(iter(DECODE_SHAPES_CPU.values())), first, inline=True)
            + f"; tiny-dense's in `{DECODE_SHAPES_CPU['tiny-dense']}`, the same box and day): " + "; ".join(lines) + ".")


@block("decode-shapes")
def _():
    """Eager decode steps on shapes the process has seen and has not; the server with and without buckets."""
    data = load(DECODE_SHAPES)
    ms = lambda x: "–" if x is None else n(x, 2)  # noqa: E731
    rows = [[r["condition"], r["run"], str(r["lengths_seed"]), n(r["steps"]), n(r["shapes"]), n(r["new_shape_steps"]),
             n(r["step_ms"], 2), ms(r["new_shape_step_ms"]), ms(r["seen_shape_step_ms"])] for r in data["rows"]]
    new_run = next(r for r in data["rows"] if r["condition"] == "exact" and r["run"] == "new")
    top_new, top_seen = new_run["profile_new"][0], new_run["profile_seen"]
    sdpa_seen = next(p for p in top_seen if p["function"] == top_new["function"])
    exact = [r for r in data["rows"] if r["condition"] == "exact"]
    buckets = [r for r in data["rows"] if r["condition"] == "buckets"]
    served = load(SERVE_SUSTAINED_BUCKETS)
    by = {r["path"]: r for r in served["results"]}
    out = (provenance(DECODE_SHAPES, data) + f" tiny-moe at {data['args']['precision']}, "
           f"{data['args']['requests']} requests of {int(data['args']['max_tokens']) // 2}–"
           f"{3 * int(data['args']['max_tokens']) // 2} tokens, {data['args']['concurrency']} streams; each condition "
           "in a fresh process.\n\n"
           + table(["condition", "run", "lengths seed", "steps", "shapes", "steps on a new shape", "step ms",
                    "ms a step on a new shape", "ms a step on a seen shape"], list("llrrrrrrr"), rows)
           + f"\n\nExact shapes: a step on a new shape took {n(min(r['new_shape_step_ms'] for r in exact if r['new_shape_steps']), 0)}–"
           f"{n(max(r['new_shape_step_ms'] for r in exact if r['new_shape_steps']), 0)} ms, one on a seen shape "
           f"{n(min(r['seen_shape_step_ms'] for r in exact), 1)}–{n(max(r['seen_shape_step_ms'] for r in exact), 1)} ms. "
           f"Under cProfile, in the first new run, `{top_new['function'].split(' ', 1)[1]}` held "
           f"{n(top_new['own_ms_per_step'], 1)} ms of a new-shape step's own time ({n(top_new['calls_per_step'], 1)} calls) "
           f"against {n(sdpa_seen['own_ms_per_step'], 1)} ms of a seen one's. Buckets: "
           f"{max(r['shapes'] for r in buckets)} shapes at most per run, steps of "
           f"{n(min(r['step_ms'] for r in buckets), 1)}–{n(max(r['step_ms'] for r in buckets), 1)} ms.\n\n"
           "The server, both ways, in one call: " + provenance(SERVE_SUSTAINED_BUCKETS, served["meta"]) + "\n\n"
           + table(["tiny-moe, serve-model decoding in its HTTP process", "tokens/s", "its runs", "server step ms",
                    "÷ engine"], list("lrrrr"),
                   [[label, n(by[path]["tokens_per_s"]), ", ".join(n(x) for x in by[path]["tokens_per_s_runs"]),
                     n(by[path]["server_step_ms"], 2), times(by[path]["over_engine"])]
                    for path, label in (("http-exact", "exact shapes (`--no-step-buckets`)"),
                                        ("http", "bucketed shapes (the default on CUDA)"))]
                   + [["the engine alone (its step only)", n(by["engine"]["tokens_per_s"]),
                       ", ".join(n(x) for x in by["engine"]["tokens_per_s_runs"]), n(by["engine"]["step_only_ms"], 2),
                       "–"]])
           + _decode_shapes_cpu()
           + f"\n\nBuckets make the server {times(by['http']['tokens_per_s'] / by['http-exact']['tokens_per_s'])} "
           "as fast (medians of " + str(len(by["http"]["tokens_per_s_runs"])) + " runs). In this run the engine "
           "alone still drew the next request in global order (the workload fixed below), so its ratios are "
           "not this section's point.")
    return out


SERVE_STREAMS = "benchmarks/results/serve_sustained-streams-cuda.json"
SERVE_MOE_PROCESS = "benchmarks/results/serve_sustained-moe-process-cuda.json"


@block("serve-streams")
def _():
    """Both servers against the engine alone on the same streams, bucketed eager steps."""
    out = []
    for path in (SERVE_STREAMS,):
        data = load(path)
        by = {(r["model"], r["path"]): r for r in data["results"]}
        rows, verdicts = [], []
        ratios: dict[str, list[float]] = {"decoding in the HTTP process": [], "in an engine process": []}
        for model, label in SERVE_MODELS.items():
            if (model, "engine") not in by:
                continue
            engine = by[(model, "engine")]
            for path_name, server in (("http", "in its HTTP process"), ("http-process", "engine process")):
                r = by[(model, path_name)]
                ratios["decoding in the HTTP process" if path_name == "http" else "in an engine process"].append(
                    r["over_engine"])
                rows.append([label, server, n(r["tokens_per_s"]),
                             f"{n(min(r['tokens_per_s_runs']))}–{n(max(r['tokens_per_s_runs']))}",
                             n(r["mean_batch"], 1), n(r["server_step_ms"], 2), bold(times(r["over_engine"]), True)])
                verdicts.append(f"{label} {server} {times(r['over_engine'])} "
                                + ("met" if r["over_engine"] >= 0.8 else "**missed**"))
            rows.append([label, "engine alone", n(engine["tokens_per_s"]),
                         f"{n(min(engine['tokens_per_s_runs']))}–{n(max(engine['tokens_per_s_runs']))}",
                         n(engine["mean_batch"], 1), n(engine["step_only_ms"], 2), "–"])
        meta = data["meta"]
        out.append(provenance(path, meta) + f" {meta['requests']} requests of {meta['max_tokens'] // 2}–"
                   f"{3 * meta['max_tokens'] // 2} tokens, {meta['concurrency']} streams over {meta['clients']} "
                   f"client processes; medians of {len(data['results'][0]['tokens_per_s_runs'])} runs.\n\n"
                   + table(["model", "serve-model decoding", "tokens/s", "runs", "mean batch", "step ms",
                            "**÷ engine**"], list("llrrrrr"), rows)
                   + "\n\nIssue 18's goal (≥ 0.8×): " + "; ".join(verdicts) + ". "
                   + "; ".join(f"{server}: {times(min(v))}–{times(max(v))} of the engine alone"
                               for server, v in ratios.items()) + ".")
    moe = load(SERVE_MOE_PROCESS)
    by = {r["path"]: r for r in moe["results"]}
    inside, outside = by["http"], by["http-process"]
    out.append("An earlier call on an H100, tiny-moe only, bucketed steps (its engine baseline still drew requests "
               "in global order, so only the two servers compare): " + provenance(SERVE_MOE_PROCESS, moe["meta"])
               + f" In the HTTP process {n(inside['tokens_per_s'])} tokens/s (runs "
               f"{', '.join(n(x) for x in inside['tokens_per_s_runs'])}; step {n(inside['server_step_ms'], 2)} ms), "
               f"in an engine process {n(outside['tokens_per_s'])} (runs "
               f"{', '.join(n(x) for x in outside['tokens_per_s_runs'])}; step {n(outside['server_step_ms'], 2)} ms): "
               f"**{times(outside['tokens_per_s'] / inside['tokens_per_s'])}**.")
    return "\n\n".join(out)


SERVE_DEFAULT_RUNS = ("benchmarks/results/serve_sustained-default-cuda.json",
                      "benchmarks/results/serve_sustained-default-2-cuda.json")
SERVE_MOE_GRAPHS = "benchmarks/results/serve_sustained-moe-graphs-cuda.json"


@block("serve-moe-graphs")
def _():
    """MoE decode steps as CUDA graphs: tiny-moe's engine before and after, then the default server
    (engine process, lean pipe) against the engine alone on the streams' workload, call by call."""
    before = {(r["model"], r["path"]): r for r in load(SERVE_STREAMS)["results"]}
    calls = [load(path) for path in SERVE_DEFAULT_RUNS]
    eager = before[("tiny-moe", "engine")]
    rows = [["eager, bucketed (`serve_sustained-streams-cuda.json`)", n(eager["tokens_per_s"]),
             n(eager["step_only_ms"], 2), "–"]]
    for path, data in zip(SERVE_DEFAULT_RUNS, calls):
        graphed = next(r for r in data["results"] if (r["model"], r["path"]) == ("tiny-moe", "engine"))
        rows.append([f"CUDA graphs (`{path.rsplit('/', 1)[1]}`)", n(graphed["tokens_per_s"]),
                     n(graphed["step_only_ms"], 2), bold(times(graphed["tokens_per_s"] / eager["tokens_per_s"], 1))])
    engine_table = table(["tiny-moe, engine alone", "tokens/s", "step ms", "**÷ eager**"], list("lrrr"), rows)
    rows, verdicts = [], []
    for call, (path, data) in enumerate(zip(SERVE_DEFAULT_RUNS, calls), 1):
        by = {(r["model"], r["path"]): r for r in data["results"]}
        for model, label in SERVE_MODELS.items():
            if (model, "http-process") not in by:
                continue
            engine, http = by[(model, "engine")], by[(model, "http-process")]
            ratio = http["tokens_per_s"] / engine["tokens_per_s"]
            rows.append([label, str(call), n(engine["tokens_per_s"]), n(http["tokens_per_s"]),
                         f"{n(min(http['tokens_per_s_runs']))}–{n(max(http['tokens_per_s_runs']))}",
                         n(http["mean_batch"], 1), n(http["server_step_ms"], 2), n(engine["step_only_ms"], 2),
                         bold(times(ratio), True)])
            verdicts.append((label, call, ratio))
    meta = calls[0]["meta"]
    server_table = table(["model", "call", "engine tok/s", "HTTP tok/s", "HTTP runs", "HTTP mean batch",
                          "server step ms", "engine step ms", "**HTTP ÷ engine**"], list("lrrrrrrrr"), rows)
    labels = list(dict.fromkeys(label for label, _, _ in verdicts))
    goal = "; ".join(
        f"{label} " + " / ".join(times(r) for lab, _, r in verdicts if lab == label)
        + (" met in every call" if all(r >= 0.8 for lab, _, r in verdicts if lab == label) else " **missed**")
        for label in labels)
    moe = {r["path"]: r for r in load(SERVE_MOE_GRAPHS)["results"]}
    return ("\n\n".join(provenance(path, data["meta"]) for path, data in zip(SERVE_DEFAULT_RUNS, calls))
            + f" {meta['requests']} requests of {meta['max_tokens'] // 2}–{3 * meta['max_tokens'] // 2} tokens, "
            f"{meta['concurrency']} streams over {meta['clients']} client processes; medians of "
            f"{len(calls[0]['results'][0]['tokens_per_s_runs'])} runs; two calls one after the other on one card.\n\n"
            + engine_table + "\n\n" + server_table
            + "\n\nIssue 18's goal under sustained load (≥ 0.8×), serve-model's default server on CUDA: " + goal + ".\n\n"
            + "Before the lean pipe, tiny-moe graphed, both servers in one call: "
            + provenance(SERVE_MOE_GRAPHS, load(SERVE_MOE_GRAPHS)["meta"], inline=True)
            + f": in the HTTP process {times(moe['http']['over_engine'])}, in an engine process "
            f"{times(moe['http-process']['over_engine'])} of the engine alone ({n(moe['engine']['tokens_per_s'])} tokens/s).")


REQUEST_COST_RUNS = {"benchmarks/results/serve_request_cost.json": "in-process decode",
                     "benchmarks/results/serve_request_cost-process.json": "engine process"}


@block("serve-request-cost")
def _():
    """CPU per request of serve-model's processes and of the client, besides the decode."""
    rows, runs = [], []
    for path, placement in REQUEST_COST_RUNS.items():
        data = load(path)
        runs.append(provenance(path, data["meta"]))
        for r in data["results"]:
            engine = r["engine_process_cpu_ms_per_request"]
            rows.append([placement, r["route"], str(r["max_tokens"]), n(r["burst_wall_ms"]),
                         n(r["decode_busy_ms_per_request"], 2), bold(n(r["http_side_cpu_ms_per_request"], 2)),
                         "–" if engine is None else n(engine, 2), bold(n(r["client_cpu_ms_per_request"], 2))])
    meta = load(next(iter(REQUEST_COST_RUNS)))["meta"]
    return ("\n\n".join(runs) + f" {meta['model']}, bursts of {meta['batch']} requests from one `openai` client "
            f"(AsyncOpenAI, this benchmark's process), {meta['bursts']} measured bursts per row after one warm-up.\n\n"
            + table(["serve-model decoding", "route", "max tokens", "burst ms", "decode busy ms a request",
                     "**server CPU outside the decode, ms a request**", "engine process CPU ms a request",
                     "**client CPU ms a request**"], list("lllrrrrr"), rows))


SAMPLER = "benchmarks/results/sampler_cpu.json"
SAMPLER_CUDA = "benchmarks/results/sampler_cpu-cuda.json"


@block("sampler-cpu")
def _():
    out = []
    for path in (SAMPLER, SAMPLER_CUDA):
        if not (ROOT / path).is_file():
            out.append(f"`{path}`: not measured yet.")
            continue
        result = load(path)
        rows = [[r["case"], r["sampler"], n(r["draw_ms"], 2), bold(times(r["speedup_vs_gumbel"]), r["sampler"] != "gumbel")]
                for r in result["results"]]
        first = result["results"][0]
        out.append(f"{provenance(path, result['meta'])} One draw of {first['batch']} rows × {n(first['vocab'])} "
                   f"vocabulary on {result['meta']['device']} (median of {result['meta']['repeats']}):\n\n"
                   + table(["case", "sampler", "draw ms", "speed-up vs hash noise"], list("llrr"), rows))
    return "\n\n".join(out)


SERVE_PROFILE = "benchmarks/results/serve_profile-cuda.json"


@block("serve-profile")
def _():
    if not (ROOT / SERVE_PROFILE).is_file():
        return f"Not measured yet: `{SERVE_PROFILE}` is absent (`python benchmarks/serve_profile.py --device cuda`)."
    raw = load(SERVE_PROFILE)

    def walls(side: dict) -> str:
        return ", ".join(f"{w:.2f}" for w in side["walls_s"])

    return (provenance(SERVE_PROFILE, raw["meta"]) + "\n\n"
            + table(["decode thread", "bursts of 32 × 64 tokens, s (under cProfile)"], list("lr"),
                    [["serve-model (HTTP)", walls(raw["server"])], ["Batcher in one process", walls(raw["inprocess"])]]))


@block("serve-inside")
def _():
    rows = _serve(SERVE_CUDA) if (ROOT / SERVE_CUDA).is_file() else {}
    if not any("server_step_ms" in r for r in rows.values()):  # results from before the server's timers
        return ("Not measured yet: the server's own timers (`decode_steps`, `decode_seconds`, `prefill_seconds`, "
                "`queue_seconds` in `/v1/engine`) wait for `python benchmarks/serve_throughput.py --device cuda` "
                "on the device.")
    out = []
    for model in SERVE_MODELS:
        for batch in load(SERVE_CUDA)["meta"]["batches"]:
            http, engine = rows.get((model, "http", batch)), rows.get((model, "engine", batch))
            if not http or not engine or "server_step_ms" not in http:
                continue
            batcher = rows.get((model, "batcher", batch))
            out.append([SERVE_MODELS[model], str(batch), n(http["server_step_ms"], 2),
                        n(1000 * batch / engine["tokens_per_s"], 2), pct(http["decode_share"]),
                        n(http["queue_ms_mean"], 1),
                        times(batcher["tokens_per_s"] / engine["tokens_per_s"]) if batcher else "-",
                        bold(times(http["tokens_per_s"] / engine["tokens_per_s"]), batch == 32)])
    return table(["model", "batch", "server step ms", "engine ms per step (burst wall)", "server decode + prefill share of wall",
                  "mean queue wait ms", "batcher / engine (no HTTP)", "HTTP / engine"], list("lrrrrrrr"), out)


# ---- teacher forcing ----------------------------------------------------------------------------

TF = "benchmarks/results/teacher_forcing-cuda.json"
TF_SWEEP = "benchmarks/results/teacher_forcing-sweep-cuda.json"
TF_COMPILE = "benchmarks/results/teacher_forcing-compile-cuda.json"
TF_BEFORE = "benchmarks/results/teacher_forcing-cuda-before-kernel.json"
TF_CPU = "benchmarks/results/teacher_forcing-cpu.json"
SHAPES = {"qwen3-0.6b": "Qwen3-0.6B", "qwen3-1.7b": "Qwen3-1.7B", "qwen3-4b": "Qwen3-4B"}


def _tf(path: str) -> dict[tuple[str, str], dict]:
    return {(r["shape"], r["method"]): r for r in load(path)["results"]}


def _sweep(shape: str) -> tuple[dict, dict[str, dict]]:
    result = next(r for r in load(TF_SWEEP)["results"] if r["shape"] == shape)
    return result, {v["label"]: v for v in result["variants"]}


@block("tf-provenance")
def _():
    return provenance(TF, load(TF)["meta"])


@block("tf-table")
def _():
    rows = _tf(TF)
    out = []
    for shape, label in SHAPES.items():
        e, nv, nl = rows[(shape, "engine")], rows[(shape, "naive")], rows[(shape, "naive-logprobs")]
        out.append([label, n(e["tokens_per_s"]), n(nv["tokens_per_s"]), n(nl["tokens_per_s"]),
                    bold(times(e["speedup_vs_naive"])), times(e["speedup_vs_naive_logprobs"]),
                    f"{gib(e['peak_extra_bytes'])} / {gib(nv['peak_extra_bytes'])} / {gib(nl['peak_extra_bytes'])}",
                    bold(times(e["peak_extra_ratio_vs_naive"], 3)),
                    f"{sci(e['max_abs_logprob_diff_vs_naive'])} / {sci(e['max_abs_entropy_diff_vs_naive'])}"])
    return table(["shape", "engine tok/s", "naive tok/s", "naive-logprobs tok/s", "**engine vs naive**",
                  "engine vs naive-logprobs", "peak extra GiB engine / naive / naive-logprobs", "**memory vs naive**",
                  "max \\|Δ\\| vs naive: logprob / entropy"], ["l"] + ["r"] * 8, out)


@block("tf-table-other")
def _():
    rows = _tf(TF)
    out = []
    for shape, label in SHAPES.items():
        t, c = rows[(shape, "engine-torch")], rows[(shape, "engine-compiled")]
        out.append([label, f"{n(t['tokens_per_s'])} ({times(t['speedup_vs_naive'])})",
                    f"{n(c['tokens_per_s'])} ({times(c['speedup_vs_naive'])})",
                    sci(c["max_abs_logprob_diff_vs_naive"]), f"{c['first_call_s']:.1f} s"])
    return table(["shape", "engine-torch tok/s (vs naive)", "engine-compiled tok/s (vs naive)",
                  "engine-compiled max \\|Δ\\| logprob vs naive", "compile (first call)"], list("lrrrr"), out)


@block("tf-goal")
def _():
    rows = _tf(TF)
    engines = [rows[(s, "engine")] for s in SHAPES]
    compiled = [rows[(s, "engine-compiled")] for s in SHAPES]
    met_speed = [SHAPES[e["shape"]] for e in engines if e["speedup_vs_naive"] >= 1.3]
    head_ms = {s: _sweep(s)[1]["fused kernel, chunk 4096"]["ms"] for s in SHAPES}
    engine_ms = {e["shape"]: 1000 * e["seconds"] for e in engines}
    body_share = [1 - head_ms[s] / engine_ms[s] for s in SHAPES]
    naive_4b_ms = 1000 * rows[("qwen3-4b", "naive")]["seconds"]
    body_4b_ms = engine_ms["qwen3-4b"] - head_ms["qwen3-4b"]
    cb = {r["shape"]: r for r in load(TF_COMPILE)["compile_body"]}
    body_gain = [cb[s]["eager_body_ms"] / cb[s]["body_ms"] for s in cb]
    comp_speed = ", ".join(times(c["speedup_vs_naive"]) for c in compiled)
    first = [c["first_call_s"] for c in compiled]
    second = [r["second_shape_call_s"] for r in cb.values()]
    return (
        "Against the issue's goal (≥ 1.3× the naive tokens/s for logprobs plus entropy, ≤ 0.35× its extra\n"
        f"memory, logprobs within 1e-3): memory and accuracy are met on every shape (at most "
        f"{max(e['peak_extra_ratio_vs_naive'] for e in engines):.3f}× the\nnaive path's memory; logprobs within "
        f"{sci(max(e['max_abs_logprob_diff_vs_naive'] for e in engines))}, entropies within "
        f"{sci(max(e['max_abs_entropy_diff_vs_naive'] for e in engines))}); speed is met on "
        f"{', '.join(met_speed) or 'no shape'} only.\nThe reason is the model body, which both paths run: with the "
        f"fused head the lm-head and its statistics\ntake {span(f'{min(head_ms.values()):.0f}', f'{max(head_ms.values()):.0f}')} ms "
        f"of the engine's {span(f'{min(engine_ms.values()):.0f}', f'{max(engine_ms.values()):.0f}')} ms, so the body is "
        f"{span(pct(min(body_share)), pct(max(body_share)))} of it, and even a free head would\n"
        f"give the 4B shape at most {naive_4b_ms:.0f} / {body_4b_ms:.0f} = {times(naive_4b_ms / body_4b_ms)} "
        "(naive time over the engine's time less its head). Compiling the layers speeds\n"
        f"the body up {span(times(min(body_gain), 1), times(max(body_gain), 1))} and gives {comp_speed} on the three "
        "shapes, but its logprobs are not within 1e-3 of the\nnaive path's: fused kernels round bf16 differently, and "
        "on these deep random-weight models that moves\nlogprobs by up to "
        f"{sci(max(c['max_abs_logprob_diff_vs_naive'] for c in compiled))}. Measured against the float32 model on the "
        "same weights (below) the compiled body is\nabout as accurate as the eager one — the 1e-3 criterion compares "
        "with one particular bf16 rounding —\nbut it did not meet the criterion as stated then, so `compile_layers` "
        f"was opt-in (it also\ncompiles for {span(f'{min(first):.1f}', f'{max(first):.1f}')} s, and a new "
        f"batch shape recompiles once, {span(f'{min(second):.1f}', f'{max(second):.1f}')} s measured)."
    )


@block("tf-sweep-provenance")
def _():
    return provenance(TF_SWEEP, load(TF_SWEEP)["meta"])


@block("tf-sweep-table")
def _():
    cols = [_sweep(s) for s in SHAPES]

    def cell(label, strong=False):
        return [bold(f"{v[label]['ms']:.1f} ({gib(v[label]['peak_extra_bytes'])})", strong) for _, v in cols]

    chunks = ["fused kernel, chunk 1024", "fused kernel, chunk 2048", "fused kernel, chunk 8192", "fused kernel, chunk 14336"]
    out = [
        ["body as `model(ids)` runs it (with its KV cache)"] + [f"{r['body_ms']:.1f}" for r, _ in cols],
        ["lm-head matmul alone, 4,096 a chunk"] + cell("lm-head matmul only, chunk 4096"),
        ["torch chunk math, 1,024 a chunk (the old engine)"] + cell("torch chunk math, chunk 1024"),
        ["`torch.compile`d chunk math, 4,096 a chunk"] + cell("torch.compile chunk math, chunk 4096"),
        ["**fused kernel, 4,096 a chunk**"] + cell("fused kernel, chunk 4096", strong=True),
        ["fused kernel, 1,024 / 2,048 / 8,192 / 14,336 a chunk"]
        + [" / ".join(f"{v[c]['ms']:.1f}" for c in chunks) for _, v in cols],
        ["naive head (float32 log-softmax + entropy)"] + cell("naive head (float32 log_softmax + entropy)"),
    ]
    return table(["ms (peak extra GiB)", *SHAPES.values()], list("lrrr"), out)


@block("tf-sweep-prose")
def _():
    result, v = _sweep("qwen3-0.6b")
    kernels = {k: x for k, x in v.items() if k.startswith("kernel alone")}
    best = min(kernels.values(), key=lambda x: x["ms"])
    rows = 4096
    tb_s = rows * result["vocab"] * 2 / (best["ms"] / 1000) / 1e12
    extra = [_sweep(s)[1]["fused kernel, chunk 4096"]["ms"] - _sweep(s)[1]["lm-head matmul only, chunk 4096"]["ms"]
             for s in SHAPES]
    spread = []
    for s in SHAPES:
        fused = [x["ms"] for k, x in _sweep(s)[1].items() if k.startswith("fused kernel")]
        spread.append(max(fused) / min(fused) - 1)
    by_block = {b: [x["ms"] for x in kernels.values() if x["block"] == b] for b in (2048, 4096, 8192)}
    ties = sorted(x["num_warps"] for x in kernels.values() if x["block"] == 2048 and round(x["ms"], 2) == round(best["ms"], 2))
    return (
        f"The kernel alone reads {n(rows)} × {n(result['vocab'])} bf16 logits in {best['ms']:.2f} ms "
        f"({tb_s:.1f} TB/s), so the fused head is the\nlm-head matmul plus {span(f'{min(extra):.0f}', f'{max(extra):.0f}')} ms. "
        f"Chunk size barely matters once the float32 buffers are gone (within {pct(max(spread))}\n"
        f"from 1,024 to 14,336 positions); 4,096 is the default, "
        f"{gib(v['fused kernel, chunk 4096']['peak_extra_bytes'])} GiB of bf16 logits. A block of 2,048\nvocabulary "
        f"entries with {' and '.join(str(w) for w in ties)} warps was the fastest of the {len(kernels)} kernel configurations "
        f"tried ({best['ms']:.2f} ms;\n4,096 entries took {span(f'{min(by_block[4096]):.2f}', f'{max(by_block[4096]):.2f}')} ms, "
        f"8,192 entries {span(f'{min(by_block[8192]):.2f}', f'{max(by_block[8192]):.2f}')} ms)."
    )


@block("tf-compile-prose")
def _():
    cb = {r["shape"]: r for r in load(TF_COMPILE)["compile_body"]}
    a, b = cb["qwen3-0.6b"], cb["qwen3-4b"]
    return (
        f"{provenance(TF_COMPILE, load(TF_COMPILE)['meta'])} The body without a KV cache, as the engine runs it, takes\n"
        f"{a['eager_body_ms']:.1f} ms eager and {a['body_ms']:.1f} ms with compiled layers on the 0.6B shape, "
        f"{b['eager_body_ms']:.1f} and {b['body_ms']:.1f} ms on the\n4B shape. Each engine's logprobs over all "
        "scored tokens, against those of the float32 model whose weights\nthe bf16 ones round:"
    )


@block("tf-compile-table")
def _():
    labels = {"eager": "eager (the engine)", "compiled layers": "compiled layers",
              "compiled layers, emulate_precision_casts": "compiled, `emulate_precision_casts`"}
    out = []
    for shape in load(TF_COMPILE)["accuracy"]:
        for v in shape["variants"]:
            out.append([SHAPES[shape["shape"]], labels[v["label"]], n(v["tokens_per_s"]),
                        f"{sci(v['mean_abs_lp_vs_fp32'])} / {sci(v['max_abs_lp_vs_fp32'])}",
                        f"{sci(v['mean_abs_lp_vs_eager'])} / {sci(v['max_abs_lp_vs_eager'])}"])
    return table(["shape", "variant", "tok/s", "mean / max \\|Δ\\| vs float32", "mean / max \\|Δ\\| vs eager bf16"],
                 list("llrrr"), out)


@block("tf-before")
def _():
    rows = _tf(TF_BEFORE)
    meta = load(TF_BEFORE)["meta"]
    parts = []
    for shape, label in SHAPES.items():
        e, nv = rows[(shape, "engine")], rows[(shape, "naive")]
        parts.append(f"{n(e['tokens_per_s'])} / {n(nv['tokens_per_s'])} tok/s "
                     f"({label.removeprefix('Qwen3-')}, {times(e['speedup_vs_naive'])})")
    engine_gib = [float(gib(rows[(s, "engine")]["peak_extra_bytes"])) for s in SHAPES]
    return (
        "Earlier numbers, before the kernel (the engine at 1,024 positions a chunk with the torch chunk math\n"
        "and a KV cache, against the naive logprobs-only path; "
        f"{provenance(TF_BEFORE, meta, inline=True)}. This file is the\nfirst version of `teacher_forcing-cuda.json`, restored from "
        "git history (commit b9b5003)): " + ", ".join(parts)
        + f",\nat {span(f'{min(engine_gib):.2f}', f'{max(engine_gib):.2f}')} GiB against "
        f"{gib(rows[('qwen3-0.6b', 'naive')]['peak_extra_bytes'])}."
    )


@block("tf-cpu")
def _():
    meta = load(TF_CPU)["meta"]
    rows = _tf(TF_CPU)
    out = []
    for shape in ("tiny-dense", "tiny-moe", "bigvocab"):
        # This file's first version named the logprobs-only baseline "naive"; the script today calls it
        # "naive-logprobs" (and "naive" adds the entropy).
        e = rows.get((shape, "engine-eager")) or rows[(shape, "engine")]  # "engine" before the body setting
        nv = rows.get((shape, "naive-logprobs"), rows[(shape, "naive")])
        label = (f"{shape}, {e['batch']}×{e['seq']}" if shape != "bigvocab"
                 else f"vocab {n(e['vocab'])}, {e['batch']}×{e['seq']}")
        out.append([label, n(e["tokens_per_s"]), n(nv["tokens_per_s"]), times(e["tokens_per_s"] / nv["tokens_per_s"]),
                    f"{gib(e['peak_extra_bytes'])} / {gib(nv['peak_extra_bytes'])}",
                    times(e["peak_extra_bytes"] / nv["peak_extra_bytes"])])
    return (provenance(TF_CPU, meta) + "\n\n"
            + table(["shape", "engine tok/s", "naive-logprobs tok/s", "speed",
                     "peak extra GiB engine / naive-logprobs", "memory"], list("lrrrrr"), out))


# ---- teacher forcing: the model body ------------------------------------------------------------

TFB = "benchmarks/results/teacher_forcing-bodies-cuda.json"
TFB_BODIES = ("eager", "liger", "compiled", "compiled-liger")
TFB_SPEED_GOAL = {"qwen3-0.6b": 1.6, "qwen3-4b": 1.5}
TFB_MEMORY_GOAL = 0.06
TFB_PEAK_GOAL = 0.70
TFB_ABSENT = (f"Not measured yet: `{TFB}` is absent (run the command above on a GPU); the table, the\n"
              "numerics and the verdict appear here once it is committed.")


TFB_MORE = ("benchmarks/results/teacher_forcing-1.7b-cuda.json",)
"""Runs of other shapes, in the same form (one device call cannot hold every shape's bodies)."""
TF_MODES = "benchmarks/results/teacher_forcing-modes-cuda.json"
TF_MODE_OF = {"engine-compiled": "default", "engine-compiled-autotune": "max-autotune-no-cudagraphs",
              "engine-compiled-graphs": "reduce-overhead"}
"""torch.compile's mode of each compiled row (benchmarks/teacher_forcing.py COMPILE_MODE_OF)."""


def _tfb() -> tuple[dict, dict[tuple[str, str], dict], dict[str, dict]] | None:
    """(meta, speed rows by (shape, method), numerics by shape), or None before the first run;
    rows of ``TFB_MORE``'s files join the main file's, which wins where both have a row."""
    if not (ROOT / TFB).exists():
        return None
    data = load(TFB)
    results = [r for path in TFB_MORE if (ROOT / path).exists() for r in load(path)["results"]] + data["results"]
    rows = {(r["shape"], r["method"]): r for r in results if r["method"] not in ("numerics", "profile")}
    numerics = {r["shape"]: r for r in results if r["method"] == "numerics"}
    return data["meta"], rows, numerics


def _tfb_variant(numerics: dict[str, dict], shape: str, body: str) -> dict | None:
    result = numerics.get(shape)
    return None if result is None else next(
        (v for v in result.get("variants", []) if v.get("label") == body and "error" not in v), None)


@block("tfb-provenance")
def _():
    got = _tfb()
    if got is None:
        return TFB_ABSENT
    meta = got[0]
    more = [provenance(path, load(path)["meta"]) for path in TFB_MORE if (ROOT / path).exists()]
    return (provenance(TFB, meta) + f" Liger-Kernel {meta.get('liger_kernel') or 'not installed'}; "
            f"the default body on CUDA when this ran: `{meta['cuda_default_body']}`."
            + "".join("\n\nThe rows of the other shapes: " + m for m in more))


@block("tfb-table")
def _():
    got = _tfb()
    if got is None:
        return "(not measured yet)"
    _, rows, numerics = got
    out = []
    for shape, label in SHAPES.items():
        naive = rows.get((shape, "naive"))
        if naive is not None and "error" not in naive:
            out.append([label, "naive (baseline)", n(naive["tokens_per_s"]), "1.00×", "1.000×", "", "", ""])
        for body in TFB_BODIES:
            r = rows.get((shape, f"engine-{body}"))
            if r is None:
                continue
            if "error" in r:
                last_line = (r["error"].strip().splitlines() or ["(no message)"])[-1]
                out.append([label, body, "error: " + last_line[:80].replace("|", "/"), "", "", "", "", ""])
                continue
            v = _tfb_variant(numerics, shape, body)
            out.append([label, body, n(r["tokens_per_s"]), bold(times(r["speedup_vs_naive"])),
                        times(r["peak_extra_ratio_vs_naive"], 3),
                        f"{pct(r['fraction_of_peak'])} ({r['model_tflops']:.0f} of {r['matmul_peak_tflops']:.0f} TFLOP/s)",
                        f"{r['first_call_s']:.1f} s", "" if v is None else ("yes" if v["meets_criterion"] else "**no**")])
    return table(["shape", "body", "tok/s", "**vs naive**", "memory vs naive", "of the bf16 matmul peak",
                  "first call", "numerics criterion"], list("llrrrrrr"), out)


@block("tfb-numerics")
def _():
    got = _tfb()
    if got is None:
        return "(not measured yet)"
    _, _, numerics = got
    out = []
    for shape, label in SHAPES.items():
        result = numerics.get(shape)
        if result is None or "error" in result:
            continue
        for v in result["variants"]:
            if "error" in v:
                out.append([label, v["label"], "error: " + v["error"][:80].replace("|", "/").replace("\n", " "), "", "", "", ""])
                continue
            depths = ", ".join(f"{d['depth']}: {sci(d['mean_exact'])}" for d in v["by_depth"][:-1])
            out.append([label, v["label"], f"{sci(v['mean'])} / {sci(v['p999'])} / {sci(v['max'])}",
                        f"{sci(v['mean_exact'])} / {sci(v['p999_exact'])} / {sci(v['max_exact'])}", depths,
                        f"{sci(v['mean_vs_eager'])} / {sci(v['max_vs_eager'])}",
                        "yes" if v["meets_criterion"] else "**no**"])
    return table(["shape", "body", "vs the float32 model: mean / p99.9 / max", "vs the bf16 weights in float32: mean / p99.9 / max",
                  "the same, mean after d layers", "vs eager bf16: mean / max", "meets"], list("llrrrrr"), out)


@block("tfb-why")
def _():
    got = _tfb()
    if got is None:
        return "(not measured yet)"
    _, _, numerics = got
    shape = max((s for s in SHAPES if s in numerics and "error" not in numerics[s]),
                key=lambda s: numerics[s]["layers"], default=None)
    eager = _tfb_variant(numerics, shape, "eager") if shape else None
    compiled = _tfb_variant(numerics, shape, "compiled") if shape else None
    if eager is None or compiled is None:
        return "(the numerics rows for eager and compiled are missing from the result)"
    first, last = eager["by_depth"][0], eager["by_depth"][-1]
    return (
        f"On the {SHAPES[shape]} shape, against the exact (float32) computation of the same bf16 weights — what is left is\n"
        f"each body's own rounding — the eager body is {sci(first['mean_exact'])} away on average after {first['depth']} "
        f"layer{'s' if first['depth'] > 1 else ''} and {sci(last['mean_exact'])} after all\n{last['depth']} "
        f"(p99.9 {sci(last['p999_exact'])}, max {sci(last['max_exact'])}); the compiled body is "
        f"{sci(compiled['mean_exact'])} (p99.9 {sci(compiled['p999_exact'])}, max {sci(compiled['max_exact'])}).\n"
        f"The two differ from each other by {sci(compiled['mean_vs_eager'])} on average and "
        f"{sci(compiled['max_vs_eager'])} at most: about as much as each differs from the exact answer,\nbecause both "
        "are bf16 roundings of the same computation, rounded at different places (a fused kernel keeps\nits "
        "intermediates in float32), and on a deep random-weight model each layer's rounding noise carries into the "
        "next.\nNeither is the exact answer, so the criterion compares each body with float32, not with the other."
    )


@block("tfb-goal")
def _():
    got = _tfb()
    if got is None:
        return "Verdict: not measured yet."
    meta, rows, numerics = got
    body = meta["cuda_default_body"]
    # Shapes the run measured at all (a run may name a subset with --shapes); the others are
    # "not measured", not failed.
    measured = {shape for shape, _ in rows}
    lines, failed = [], []
    for shape, label in SHAPES.items():
        if shape not in measured:
            lines.append(f"- {label}: not measured in this run.")
            continue
        r = rows.get((shape, f"engine-{body}"))
        if r is None or "error" in r:
            lines.append(f"- {label}: the default body's row is missing or failed.")
            failed.append(label)
            continue
        v = _tfb_variant(numerics, shape, body)
        checks = []
        goal = TFB_SPEED_GOAL.get(shape)
        if goal is not None:
            checks.append((f"{times(r['speedup_vs_naive'])} the naive path (goal ≥ {goal}×)", r["speedup_vs_naive"] >= goal))
        elif "speedup_vs_naive" in r:
            checks.append((f"{times(r['speedup_vs_naive'])} the naive path (no goal for this shape)", None))
        checks.append((f"{times(r['peak_extra_ratio_vs_naive'], 3)} its memory (≤ {TFB_MEMORY_GOAL}×)",
                       r["peak_extra_ratio_vs_naive"] <= TFB_MEMORY_GOAL))
        checks.append((f"{pct(r['fraction_of_peak'])} of the matmul peak (≥ {pct(TFB_PEAK_GOAL)})",
                       r["fraction_of_peak"] >= TFB_PEAK_GOAL))
        checks.append(("numerics " + ("within" if v and v["meets_criterion"] else "not within") + " eager's",
                       bool(v and v["meets_criterion"])))
        missed = [text for text, ok in checks if ok is False]
        if missed:
            failed.append(label)
        lines.append(f"- {label}: " + "; ".join(
            text if ok is None else f"{text} {'met' if ok else '**missed**'}" for text, ok in checks) + ".")
    fastest = []
    for shape, label in SHAPES.items():
        if shape not in measured:
            continue
        ok = [(rows[(shape, f"engine-{b}")]["speedup_vs_naive"], b) for b in TFB_BODIES
              if (shape, f"engine-{b}") in rows and "error" not in rows[(shape, f"engine-{b}")]
              and (_tfb_variant(numerics, shape, b) or {}).get("meets_criterion")]
        fastest.append(f"{label} `{max(ok)[1]}`" if ok else f"{label} none")
    return (f"Verdict for the default body on CUDA, `{body}`:\n\n" + "\n".join(lines) + "\n\n"
            + ("Every check is met." if not failed else f"Not met on {', '.join(failed)}.")
            + " The fastest body that meets the numerics criterion, per shape: " + ", ".join(fastest) + ".")


@block("tfb-roofline")
def _():
    """Where the compiled body's time goes (torch.profiler), and what that leaves for the peak."""
    profiles = [r for path in (TF_MODES, *TFB_MORE) if (ROOT / path).exists()
                for r in load(path)["results"] if r["method"] == "profile" and "groups_ms" in r]
    if not profiles:
        return f"Not measured yet: no profile row in `{TF_MODES}` or {', '.join(f'`{p}`' for p in TFB_MORE)}."
    rows, notes = [], []
    for p in profiles:
        g = p["groups_ms"]
        matmul_flops = 2 * p["parameters"] * p["tokens"]
        att = p.get("attention_flops")
        rows.append([SHAPES.get(p["shape"], p["shape"]), f"{p['device_ms']:.1f}",
                     f"{g.get('matmul', 0):.1f} ({matmul_flops / g['matmul'] / 1e9:.0f} TFLOP/s)" if g.get("matmul") else "–",
                     f"{g.get('attention', 0):.1f}" + (f" ({att / g['attention'] / 1e9:.0f} TFLOP/s)" if att and g.get("attention") else ""),
                     f"{g.get('triton', 0):.1f}", f"{g.get('other', 0):.1f}",
                     pct(matmul_flops / ((g.get("matmul", 0) + g.get("attention", 0)) / 1e3) / p["matmul_peak_tflops"] / 1e12)
                     if "matmul_peak_tflops" in p else "–"])
    modes = load(TF_MODES)["results"] if (ROOT / TF_MODES).exists() else []
    for r in modes:
        if r["method"].startswith("engine-compiled"):
            mode = TF_MODE_OF.get(r["method"], r["method"])
            if "error" in r:
                lines = [x.strip() for x in r["error"].splitlines() if "Error" in x] or r["error"].strip().splitlines()
                notes.append(f"`{mode}`: failed ({lines[-1][:200]})")
            else:
                notes.append(f"`{mode}`: {pct(r['fraction_of_peak'])} by 2·params·tokens, "
                             f"{pct(r['fraction_of_peak_with_attention'])} counting attention's FLOPs too")
    return (table(["shape", "kernels ms", "matmuls ms", "attention ms", "Triton (fused) ms", "other ms",
                   "ceiling by 2·params·tokens"], list("lrrrrrr"), rows)
            + ("\n\ntorch.compile modes of the compiled body on the 0.6B shape, each in its own process ("
               + provenance(TF_MODES, load(TF_MODES)["meta"], inline=True) + "): " + "; ".join(notes) + "."
               if notes else ""))


TF_GRAPHS = ("benchmarks/results/teacher_forcing-graphs-cuda.json",
             "benchmarks/results/teacher_forcing-graphs-eager-cuda.json")
"""The body replayed as CUDA graphs (``TrainerEngine(graphs=True)``) beside the same body without."""


@block("tfb-graphs")
def _():
    """Each body with and without CUDA graphs, from one run per file (both in one process tree)."""
    present = [path for path in TF_GRAPHS if (ROOT / path).exists()]
    if not present:
        return f"Not measured yet: `{TF_GRAPHS[0]}` is absent (`bash benchmarks/gpu_run.sh teacher_forcing-graphs`)."
    rows, walls, failed = [], [], []
    for path in present:
        runs = {(r["shape"], r["method"]): r for r in load(path)["results"]}
        for (shape, method), plain in runs.items():
            graphed = runs.get((shape, f"{method}-cudagraphs"))
            if graphed is None or method.endswith("-cudagraphs"):
                continue
            if method == "profile":
                walls.append(f"{SHAPES.get(shape, shape)}: {plain['device_ms']:.1f} ms of kernels in "
                             f"{plain['wall_ms']:.1f} ms of wall time without graphs, {graphed['device_ms']:.1f} "
                             f"in {graphed['wall_ms']:.1f} with them")
                continue
            if "graphs_error" in graphed or "error" in graphed or "error" in plain:
                failed.append(f"{SHAPES.get(shape, shape)} `{method}`: "
                              + (graphed.get("graphs_error") or graphed.get("error") or plain["error"]).splitlines()[0][:160])
                continue
            same = graphed["max_abs_logprob_diff_vs_naive"] == plain["max_abs_logprob_diff_vs_naive"]
            rows.append([SHAPES.get(shape, shape), method.removeprefix("engine-"), n(plain["tokens_per_s"]),
                         n(graphed["tokens_per_s"]), bold(times(graphed["tokens_per_s"] / plain["tokens_per_s"], 3)),
                         f"{times(plain['speedup_vs_naive'])} → {times(graphed['speedup_vs_naive'])}",
                         str(graphed.get("graph_captures", "–")), "yes" if same else "**no**"])
    out = [provenance(path, load(path)["meta"]) for path in present]
    out.append(table(["shape", "body", "tok/s", "tok/s with graphs", "**graphs ÷ plain**", "vs naive",
                      "captures", "same max |Δ| vs naive"], list("llrrrrrr"), rows))
    if walls:
        out.append("Under the profiler: " + "; ".join(walls) + ".")
    if failed:
        out.append("Not captured: " + "; ".join(failed) + ".")
    return "\n\n".join(out)


# ---- MoE matrix ---------------------------------------------------------------------------------

MOE = "benchmarks/results/moe_matrix-cuda.json"


def _moe() -> dict[tuple[str, str], dict]:
    return {(c["rollout"], c["trainer"]): c for c in load(MOE)["cells"]}


@block("moe-provenance")
def _():
    meta = load(MOE)["meta"]
    return (provenance(MOE, meta)
            + f" Model: {meta['parameters'] / 1e9:.2f}B parameters ({meta['settings']['layers']} layers).")


@block("moe-table")
def _():
    out = []
    for (rollout, trainer), c in _moe().items():
        out.append([f"{rollout} → {trainer}", f"{c['token_ess']:.5f}", f"{c['sequence_ess']:.3f}",
                    sci(c["mean_abs_delta"]), f"{c['max_abs_delta']:.3f}", sci(c["kl_k3"]),
                    pct(c["router_flip_rate"], 2), f"{c['topk_overlap']:.3f}", pct(c["token_expert_disagreement_rate"], 1)])
    return table(["rollout → trainer", "token ESS", "sequence ESS", "mean \\|Δlogp\\|", "max \\|Δlogp\\|", "k3",
                  "router flip rate", "top-k overlap", "tokens with any expert changed"], ["l"] + ["r"] * 8, out)


@block("moe-prose")
def _():
    cells, meta = _moe(), load(MOE)["meta"]
    fp8, bf = cells[("fp8", "bf16")]["per_layer_flip_rate"], cells[("bf16", "bf16")]["per_layer_flip_rate"]
    lo, hi = min(range(len(fp8)), key=fp8.__getitem__), max(range(len(fp8)), key=fp8.__getitem__)
    settings = meta["settings"]
    trainer_s = [c["trainer_s"] for c in cells.values()]
    entropy = statistics.mean(c["trainer_entropy_mean"] for c in cells.values())
    return (
        f"Per layer, the fp8 rollout's flip rate against the bf16 trainer runs from {pct(fp8[lo], 1)} (layer {lo}) to "
        f"{pct(fp8[hi], 1)}\n(layer {hi}); bf16 against bf16 from {pct(min(bf), 1)} to {pct(max(bf), 1)}. Even bf16 "
        "against bf16 is not zero: the rollout\ndecodes one token a step from a KV cache, the trainer prefills "
        f"{settings['prompt'] + settings['tokens']} tokens at once, and the two\nround differently. fp8 weights "
        "dominate everything else: against them the bf16 and fp32 trainers\nlook alike. Over "
        f"{settings['tokens']}-token sequences the small per-token Δ adds up: fp8's sequence ESS is "
        f"{cells[('fp8', 'bf16')]['sequence_ess']:.2f}\nwhere its token ESS is {cells[('fp8', 'bf16')]['token_ess']:.3f}. "
        f"The rollouts took {meta['rollout_bf16_s']:.0f} s (bf16) and {meta['rollout_fp8_s']:.0f} s (fp8) for "
        f"{n(cells[('bf16', 'bf16')]['tokens'])} tokens —\neach step samples {settings['n']} rows of "
        f"{n(settings['vocab'])} logits on the CPU — and teacher forcing "
        f"{span(f'{min(trainer_s):.2f}', f'{max(trainer_s):.2f}')} s.\n\nThese are random weights: next-token "
        f"distributions are nearly uniform (mean entropy {entropy:.2f} nats\nof at most ln {n(settings['vocab'])} = "
        f"{math.log(settings['vocab']):.2f})"
    )


# ---- agent collection, python_eval, CLI start-up, dense_summary ----------------------------------

AGENT = "benchmarks/results/agent_collect.json"
PYEVAL = "benchmarks/results/python_eval_cost.json"
CLI = "benchmarks/results/cli_startup.json"
DENSE = "benchmarks/results/dense_summary.json"


LEARNING = "benchmarks/results/learning_budget.json"


@block("learning-budget")
def _():
    """Issue 14's budgets: `make demo` and one run of experiment (a), each alone on the machine."""
    meta = load(LEARNING)
    out = []
    for r in meta["rows"]:
        before, after = r["pass1_before"], r["pass1_after"]
        if isinstance(before, dict):  # the demo: means with 95% t intervals over tasks, gain paired by task
            g = r["gain"]
            learned = (f"{before['mean']:.3f} → {after['mean']:.3f}, gain {signed(g['mean'])} "
                       f"[{signed(g['lo'])}, {signed(g['hi'])}]")
        else:
            learned = f"{before:.3f} → {after:.3f}"
        out.append([r["case"], str(r["steps"]), r["eval"], learned, f"{r['seconds'] / 60:.1f}",
                    f"{r['budget_s'] / 60:.0f}", bold(times(r["ratio"]), r["ratio"] >= 1)])
    return (provenance(LEARNING, meta) + "\n\n"
            + table(["case", "steps", "held-out eval", "held-out sampled pass@1 before → after", "minutes",
                     "budget (min)", "budget / measured"], list("lrllrrr"), out))


@block("agent-provenance")
def _():
    return provenance(AGENT, load(AGENT))


@block("agent-table")
def _():
    out = [[str(r["concurrency"]), str(r["runs"]), str(r["turns"]), n(r["tokens"]), f"{r['seconds']:.1f}",
            f"{r['runs_per_s']:.2f}", n(r["tokens_per_s"]), bold(times(r["speedup"]), r["concurrency"] > 1),
            f"{r['pass_rate']:.2f}"] for r in load(AGENT)["rows"]]
    return table(["concurrency", "runs", "turns", "tokens", "seconds", "runs/s", "tokens/s", "vs baseline", "pass rate"],
                 list("r" * 9), out)


@block("agent-prose")
def _():
    rows = load(AGENT)["rows"]
    tokens = {r["tokens"] for r in rows}
    rates = {round(r["pass_rate"], 4) for r in rows}
    same = len(tokens) == 1 and len(rates) == 1
    sandbox = next(r for r in load(PYEVAL)["rows"] if r.get("isolation") == "bubblewrap (default)" and r["task_dir"] == "empty")
    return (
        (f"The three runs sample exactly the same tokens ({n(tokens.pop())}) and score the same pass rate: "
         if same else "The runs differ in the tokens they sample: ")
        + "each (task,\nsample, turn) has its own seed and the engine's per-sequence generator does not depend on "
        "what it\nis batched with, so concurrency changes the speed, not the data. Tools cost little beside the\n"
        f"model: python_eval, the dearest, takes {sandbox['ms']:.1f} ms a call (a fresh sandboxed interpreter; next "
        "section)."
    )


def _pyeval() -> tuple[dict[tuple[str, str], float], dict[str, float]]:
    calls, reads = {}, {}
    for r in load(PYEVAL)["rows"]:
        if "isolation" in r:
            calls[(r["isolation"], r["task_dir"])] = r["ms"]
        else:
            reads[r["read_file"]] = r["us"]
    return calls, reads


@block("pyeval-provenance")
def _():
    return provenance(PYEVAL, load(PYEVAL))


@block("pyeval-table")
def _():
    calls, _ = _pyeval()
    bare = calls[("baseline: bare subprocess", "empty")]
    new, old = "bubblewrap (default)", "unsafe-audit-hook-only (before)"
    out = [["bare interpreter (baseline)", "", f"{bare:.1f}", times(1), ""]]
    for label, key in (("bubblewrap sandbox (default)", new), ("audit hook + unshare (before)", old)):
        for task_dir, words in (("empty", "empty"), ("world", "the world's files")):
            ms = calls[(key, task_dir)]
            vs_old = ms / calls[(old, task_dir)]
            out.append([label, words, f"{ms:.1f}", times(ms / bare), bold(times(vs_old), vs_old < 0.9)])
    return table(["isolation", "task directory", "ms per call", "× bare interpreter", "× the mode it replaced"],
                 list("llrrr"), out)


@block("pyeval-prose")
def _():
    calls, reads = _pyeval()
    new, old = "bubblewrap (default)", "unsafe-audit-hook-only (before)"
    more = calls[(new, "empty")] - calls[(old, "empty")]
    saved = calls[(old, "world")] - calls[(new, "world")]
    return (
        f"read_file: {reads['openat2']:.0f} µs with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` against "
        f"{reads['path checks (before)']:.0f} µs with the\nearlier resolve-then-check-then-open "
        f"({times(reads['openat2'] / reads['path checks (before)'])}). The sandbox costs {more:.1f} ms more on an "
        f"empty task and\n{'saves' if saved > 0 else 'costs'} {abs(saved):.1f} ms on a task with files (nothing is "
        "copied to disk); both are small beside a model turn."
    )


DASHBOARD = "benchmarks/results/dashboard_open.json"


@block("dashboard-provenance")
def _():
    return provenance(DASHBOARD, load(DASHBOARD))


@block("dashboard-table")
def _():
    out = []
    for r in (r for r in load(DASHBOARD)["rows"] if r["part"] != "browser"):
        compared = r["naive_ms"] != r["ms"]
        out.append([r["case"], r["request"], n(r["ms"], 1), n(r["naive_ms"], 1) if compared else "(the same)",
                    bold(times(r["ratio"], 1), r["ratio"] >= 2) if compared else "", f"{r['bytes'] / 1e6:.2f} MB"])
    return table(["run", "request", "ms (server)", "naive ms", "× faster", "response"], list("llrrrr"), out)


@block("dashboard-prose")
def _():
    rows = [r for r in load(DASHBOARD)["rows"] if r["part"] == "training"]
    first = max(r["ms"] for r in rows if r["request"].startswith("first open"))
    again = max(r["ms"] for r in rows if r["request"].startswith("open again"))
    poll = next(r for r in rows if r["request"].startswith("live poll"))
    verdict = "under" if first < 1000 else "over"
    return (
        f"A 10,000-step run opens in {first:.0f} ms the first time ({verdict} a second on this loaded 2-core box),\n"
        f"when every file is parsed, and in {again:.0f} ms after that (the columns are cached: the rest is\n"
        f"serializing {poll['case'].split(' × ')[0]} of the default charts' metrics). A live page's poll for one new row costs "
        f"{poll['ms']:.1f} ms\nagainst {poll['naive_ms']:.0f} ms re-parsing the file ({times(poll['ratio'], 0)} faster)."
    )


@block("dashboard-browser-table")
def _():
    out = [[r["request"].removeprefix("chromium: ").removesuffix(" to charts drawn"), f"{r['before_bytes'] / 1e6:.2f} MB",
            f"{r['bytes'] / 1e6:.2f} MB", times(r["before_bytes"] / r["bytes"], 1), n(r["naive_ms"], 0), n(r["ms"], 0),
            bold(times(r["ratio"], 1), r["ratio"] >= 2)]
           for r in load(DASHBOARD)["rows"] if r["part"] == "browser"]
    return table(["page", "bytes before", "bytes now", "smaller", "ms to charts, before", "ms now", "× faster"],
                 list("lrrrrrr"), out)


@block("dashboard-browser-prose")
def _():
    rows = [r for r in load(DASHBOARD)["rows"] if r["part"] == "browser"]
    served = next(r for r in rows if "served" in r["request"])
    static = next(r for r in rows if "static" in r["request"])
    steps = served["case"].split(" steps")[0]
    return (f"The {steps}-step page carried every metric inline before ({served['before_bytes'] / 1e6:.1f} MB, "
            f"{served['naive_ms'] / 1000:.1f} s to its charts served,\n{static['naive_ms'] / 1000:.1f} s from a "
            f"file); it now carries the default charts' columns ({served['bytes'] / 1e6:.1f} MB, "
            f"{served['ms'] / 1000:.1f} s and\n{static['ms'] / 1000:.1f} s) and fetches any other metric when it "
            "is chosen. From a file the bytes were never the main\ncost: the drawing was (10,000 gate bars a tier "
            "took ~0.6 s a redraw; they are summed to at most 400 now).")


@block("cli-provenance")
def _():
    return provenance(CLI, load(CLI))


@block("cli-table")
def _():
    medians = {r["case"]: r["median_s"] for r in load(CLI)["rows"]}
    base = medians["baseline: import torch"]
    labels = {
        "baseline: import torch": "baseline: `import torch`",
        "rollmarket --help": "`rollmarket --help` (lists commands from a table, imports none)",
        "serve-model, taken port": "`rollmarket serve-model models/tiny-moe --port TAKEN` (the one-line error; no model loaded)",
        "exchange serve, healthy": "`rollmarket exchange serve` to its first 200 on `/healthz` (torch never loaded)",
    }
    out = [[labels[case], f"{s:.3f}", bold(times(s / base), case == "rollmarket --help")] for case, s in medians.items()]
    return table(["case", "median s", "× import torch"], list("lrr"), out)


DASH_GEN = "benchmarks/results/dashboard_generations.json"


@block("dashboard-generations-provenance")
def _():
    return provenance(DASH_GEN, load(DASH_GEN))


@block("dashboard-generations-table")
def _():
    rows = load(DASH_GEN)["rows"]
    out = [[r["case"], f"{r['ours_s'] * 1000:.0f}", f"{r['naive_s']:.2f}" if r["naive_s"] else "–",
            bold(times(r["ratio"], 0)) if r["ratio"] else "–"] for r in rows]
    first = rows[0]
    return (f"{n(first['rows'])} generations, {first['file_mb']:.0f} MB.\n\n"
            + table(["request", "dashboard ms", "naive s", "naive / dashboard"], list("lrrr"), out))


@block("dashboard-generations-prose")
def _():
    rows = {r["case"]: r for r in load(DASH_GEN)["rows"]}
    warm = [r["ours_s"] for r in rows.values() if r["naive_s"]]
    verdict = "under" if max(warm + [rows["cold open"]["ours_s"]]) < 1.0 else "not all under"
    return (f"Every warm request, filtered, searched, sorted or not, took at most {max(warm) * 1000:.0f} ms, and a cold "
            f"open of the first page {rows['cold open']['ours_s'] * 1000:.0f} ms: {verdict} the issue's one second. The "
            f"one request that is not is a filtered one arriving first in a process over a big file, "
            f"{rows['first filter']['ours_s']:.1f} s: it parses every line once into columns (after a cold open a "
            f"background thread does that parse while the first page is read); after a 1,000-row append the "
            f"first page took {rows['after a 1,000-row append']['ours_s'] * 1000:.0f} ms (the new "
            f"lines only are parsed).")


@block("dense-provenance")
def _():
    return provenance(DENSE, load(DENSE))


@block("dense-table")
def _():
    out = [[n(r["tokens"]), f"{r['tokens_per_s'] / 1e6:.1f}M", f"{r['naive_tokens_per_s'] / 1e6:.1f}M",
            bold(times(r["speedup"], 1))] for r in load(DENSE)["rows"]]
    return table(["tokens", "dense_summary tok/s", "naive tok/s", "speed vs naive"], list("rrrr"), out)


@block("dense-prose")
def _():
    rows = load(DENSE)["rows"]
    rates = [r["tokens_per_s"] / 20e6 for r in rows]
    return (
        f"Both agree to a relative {sci(max(r['max_relative_difference'] for r in rows))} on every statistic. "
        f"The issue's target is 20M tokens/s on one core: the\nlibrary does {span(times(min(rates), 1), times(max(rates), 1))} "
        "that. The naive column is the one most hurt by other load on the shared box (it\nstreams float64 "
        "temporaries through memory)."
    )


# ---- router replay ------------------------------------------------------------------------------

REPLAY = "benchmarks/results/router_replay.json"


@block("router-replay")
def _():
    """Issue 17: the fp32 trainer routing itself (baseline) against replaying each rollout's experts."""
    meta = load(REPLAY)
    out = [[r["precision"], n(r["tokens"]),
            f"{r['flips_plain']:.2%} → {r['flips_replay']:.2%}",
            f"{r['set_flips_plain']:.2%} → {r['set_flips_replay']:.2%}",
            f"{r['mean_abs_delta_plain']:.4f} → {r['mean_abs_delta_replay']:.4f}",
            f"{r['max_abs_delta_plain']:.3f} → {r['max_abs_delta_replay']:.3f}",
            f"{r['seconds_plain'] * 1e3:.1f} → {r['seconds_replay'] * 1e3:.1f}",
            times(r["time_ratio"])] for r in meta["rows"]]
    return (provenance(REPLAY, meta) + "\n\n"
            + table(["rollout", "tokens", "top-1 flips", "top-k set flips", "mean \\|Δlogp\\|",
                     "max \\|Δlogp\\|", "teacher forcing (ms)", "replay / baseline time"],
                    list("lrrrrrrr"), out))


# ---- observatory --------------------------------------------------------------------------------

OBS = "benchmarks/results/observatory-tiny-moe-h200.json"


@block("obs-provenance")
def _():
    return provenance(OBS, load(OBS))


@block("obs-matrix")
def _():
    data = load(OBS)
    cells = {(c["rollout_engine"], c["trainer_engine"]): c for c in data["cells"]}
    out = []
    for rollout in data["rollout_engines"]:
        row = [rollout]
        for trainer in data["trainer_engines"]:
            e = cells[(rollout, trainer)]["token_ess"]
            row.append(f"{e['mean']:.4f} [{e['lo']:.4f}, {e['hi']:.4f}]")
        row += [pct(cells[(rollout, t)]["router_flip_rate"]["mean"], 2) for t in ("fp32", "bf16")]
        out.append(row)
    return table(["rollout ↓ trainer →", *data["trainer_engines"], "flip vs fp32", "flip vs bf16"],
                 ["l"] + ["r"] * (len(data["trainer_engines"]) + 2), out)


def _lengths() -> dict[tuple[str, int], dict]:
    return {(r["rollout_engine"], r["max_tokens"]): r for r in load(OBS)["length_scaling"] if r["trainer_engine"] == "fp32"}


@block("obs-lengths")
def _():
    rows = _lengths()
    lengths = sorted({k[1] for k in rows})
    out = []
    for rollout in ("fp32", "fp16", "bf16", "fp8"):
        out.append([rollout] + [f"{rows[(rollout, t)]['token_ess']['mean']:.4f}" for t in lengths]
                   + [sci(rows[(rollout, t)]["mean_abs_delta"]["mean"]) for t in lengths])
    return table(["rollout", *(f"ESS @{t}" for t in lengths), *(f"mean \\|Δ\\| @{t}" for t in lengths)],
                 ["l"] + ["r"] * 2 * len(lengths), out)


@block("obs-prose")
def _():
    data = load(OBS)
    rows, cells = _lengths(), {(c["rollout_engine"], c["trainer_engine"]): c for c in data["cells"]}
    lengths = sorted({k[1] for k in rows})
    same = all(cells[(r, "fsdp-bf16")]["token_ess"]["mean"] == cells[(r, "bf16")]["token_ess"]["mean"]
               for r in data["rollout_engines"])
    split = [d for d in data["divergence"] if d["split_turn"] is not None]
    kinds = sorted({d["kind"] for d in split})
    return (
        "What it shows: FSDP2-bf16 scores "
        + ("exactly as the single-process bf16 trainer does" if same else "differently from the single-process bf16 trainer")
        + ". Agent turns are\nshort and confident, so the matrix over agent runs stays green. Long free-running "
        "probes show a\nlarger mean |Δ| (fp8 from "
        f"{rows[('fp8', lengths[0])]['mean_abs_delta']['mean']:.3f} to {rows[('fp8', lengths[-1])]['mean_abs_delta']['mean']:.3f}) "
        f"and a lower token ESS (fp8 from {rows[('fp8', lengths[0])]['token_ess']['mean']:.2f} to "
        f"{rows[('fp8', lengths[-1])]['token_ess']['mean']:.2f}),\nbut that does not show drift accumulating along "
        "the response: these probes were\ntaken before they were cut at EOS, so they count the tokens `ignore_eos` "
        "forced past it,\nand token ESS per trajectory falls with length even when every token drifts alike\n"
        "([observatory.md](observatory.md), \"Length scaling\"). The per-position figures (`position_scaling`) "
        "are the\ntest; this run has not been repeated with them. "
        f"{len(split)} of {len(data['divergence'])} agent runs "
        f"split from their fp32 twin{', all on answer ' + kinds[0] if len(kinds) == 1 else ''}."
    )


# ---- training and experiments -------------------------------------------------------------------

EXP_A = "experiments/results/exp-a"


@cache
def exp_a() -> dict:
    """Experiment (a): its manifest, its campaign (every run's metrics and per-task evals) and the
    before/after comparison `rollmarket stats --before-after` makes of it, recomputed here."""
    from rollmarket.research.stats import campaign_report, load_campaign, report_dict

    root = ROOT / EXP_A
    campaign = load_campaign(root)
    for file in sorted(root.rglob("*")):  # read by the statistics below: results a doc uses
        if file.is_file() and file.name != "manifest.json":
            LOADED.add(str(file.relative_to(ROOT)))
    report = report_dict(campaign_report(campaign, before_after=True))
    runs = sorted(campaign.runs["grpo"], key=lambda r: r.seed)
    seeds = []
    for run in runs:
        rows = [r for r in run.rows if r["step"] > 0]
        summary = json.loads((run.path / "summary.json").read_text())
        before, after = summary["eval_before"], summary["eval_after"]
        seeds.append({"seed": run.seed, "minutes": summary["minutes"], "steps": summary["steps"],
                      "greedy": [before["eval/accuracy/mean"], after["eval/accuracy/mean"]],
                      "pass@1": [before["eval/pass@1"], after["eval/pass@1"]],
                      "correct_rate": [statistics.mean(r["correct_rate"] for r in rows[:5]),
                                       statistics.mean(r["correct_rate"] for r in rows[-5:])]})
    return {"manifest": load(f"{EXP_A}/manifest.json"), "seeds": seeds,
            "metrics": report["comparisons"][0]["metrics"]}


@block("training-speed")
def _():
    a = exp_a()
    minutes = [s["minutes"] for s in a["seeds"]]
    steps = [s["steps"] / s["minutes"] for s in a["seeds"]]
    m = a["manifest"]
    return (
        f"Experiment (a)'s {len(minutes)} runs took {span(f'{min(minutes):.1f}', f'{max(minutes):.1f}')} min each as "
        f"their summaries record them\n(60 steps and two evaluations of 50 tasks × 16 samples), "
        f"{span(f'{min(steps):.1f}', f'{max(steps):.1f}')} steps per minute per run. Raw results: `{EXP_A}/`.\n"
        f"Machine: {m['machine']}. Date: {m['date']}."
    )


def campaign_provenance(where: str, m: dict) -> str:
    """The line naming a packed campaign's raw results, machine, date and code (its manifest.json)."""
    return (f"Raw results: `{where}/` ({m['source']}). Machine: {m['machine'].rstrip('.')}. Date: {m['date']}. "
            f"Code: {m['code'].rstrip('.')}.")


@block("exp-a-provenance")
def _():
    return campaign_provenance(EXP_A, exp_a()["manifest"])


@block("exp-a-seeds")
def _():
    out = []
    for s in exp_a()["seeds"]:
        g, p, c = s["greedy"], s["pass@1"], s["correct_rate"]
        out.append([str(s["seed"]), f"{p[0]:.3f} → {p[1]:.3f}", f"{g[0]:.3f} → {g[1]:.3f}",
                    f"{c[0]:.3f} → {c[1]:.3f}"])
    return table(["seed", "sampled pass@1 (T=1.5, 16 samples) before → after", "greedy accuracy before → after",
                  "train correct_rate, first 5 → last 5 steps"], list("llll"), out)


def _p(x: float) -> str:
    return f"{x:.4f}" if x >= 1e-3 else f"{x:.1e}"


@block("exp-a-gains")
def _():
    out = []
    for m in exp_a()["metrics"]:
        lo, hi = m["t_interval"]
        boot = m["two_way_bootstrap"]
        out.append([f"`{m['metric']}`", str(m["n_seeds"]), signed(m["mean_difference"]),
                    f"[{signed(lo)}, {signed(hi)}]", f"[{signed(boot['lo'])}, {signed(boot['hi'])}]",
                    f"{_p(m['sign_flip']['p'])} ({_p(m['p_holm'])})",
                    bold(m["verdict"], m["verdict"] == "CONFIRMED")])
    return table(["metric", "seeds", "gain", "95% t interval", "95% two-way (seed, task) bootstrap",
                  "exact sign-flip p (Holm)", "verdict"], list("lrrllll"), out)


@block("exp-a-prose")
def _():
    a = exp_a()
    seeds = a["seeds"]
    pass1, greedy = a["metrics"]
    rises = sum(s["pass@1"][1] > s["pass@1"][0] for s in seeds)
    rose = sum(s["correct_rate"][1] > s["correct_rate"][0] for s in seeds)
    before = {s["greedy"][0] for s in seeds}
    return (
        f"What the data shows: held-out sampled pass@1 rises in {rises} of {len(seeds)} seeds, and "
        f"`rollmarket stats` says\n**{pass1['verdict']}**: {pass1['reason']}\n\n"
        f"Greedy accuracy: **{greedy['verdict']}**: {greedy['reason']}\n\nRL here sharpens the sampling "
        "distribution (fewer slips at temperature 1.5) more than it changes the model's\nsingle most likely answer"
        + (f", which at {before.pop():.2f} before training leaves little room on 50 tasks" if len(before) == 1 else "")
        + f". The training correct\nrate is noisy step to step; its first-vs-last-5-step means rose in {rose} of "
        f"{len(seeds)} seeds. The gain is small\n({signed(pass1['mean_difference'])} in pass@1): the tiny model "
        "starts near its ceiling on this suite, which is what a model with\nRL headroom (issue 14) is for."
    )


# ---- issue 18: the learner step (chunked head with its backward, FSDP2) -------------------------

LEARNER_STEP = "benchmarks/results/learner_step-cuda.json"
LEARNER_LAYOUT_ROW = "fsdp-2@kept-prefetch"
"""The row whose FSDP2 layout the learner uses by default (trainer.fsdp_keep_gathered: layers and
root kept gathered from forward to backward, one layer prefetched; train/learner.py)."""


@block("learner-step-cuda")
def _():
    if not (ROOT / LEARNER_STEP).is_file():
        return (f"Not measured yet: `{LEARNER_STEP}` is not committed. Run the command above on a machine with "
                "two GPUs,\ncommit its JSON and `python docs/render.py` fills this in.")
    raw = load(LEARNER_STEP)
    rows = []
    for r in raw["results"]:
        def ratio(key: str, digits: int = 2, r=r) -> str:
            return "–" if r.get(key) is None else times(r[key], digits)

        if "seconds" in r:
            step = [f"{r['seconds']:.3f}", f"{r['steps_per_s']:.2f}", gib(r["peak_extra_bytes"]),
                    ratio("peak_extra_ratio_vs_naive", 3)]
        else:
            step = [f"error: {(r.get('error') or '?').splitlines()[-1][:80]}", "", "", ""]
        head = gib(r["head_peak_extra_bytes"]) if "head_peak_extra_bytes" in r else r.get("head_error", "–")[:60]
        rows.append([bold(r["method"], r["method"] in ("naive", LEARNER_LAYOUT_ROW)), str(r.get("world_size", "")),
                     str(r.get("chunk") or "–"), *step, gib(r["held_bytes"]) if "held_bytes" in r else "–",
                     head, ratio("head_peak_ratio_vs_naive", 3),
                     ratio("step_rate_vs_fsdp_1"), ratio("step_rate_vs_chunked")])
    first = next((r for r in raw["results"] if "batch" in r), None)
    shape = "" if first is None else (
        f"Shape `{first['shape']}`, {first['precision']}, {first['batch']}×{first['seq']} tokens "
        f"({n(first['loss_tokens'])} in the loss), activation checkpointing "
        f"{'on' if first.get('checkpointing') else 'off'}.\n\n")
    by_method = {r["method"]: r for r in raw["results"]}
    verdict = []
    chunked = by_method.get("chunked", {})
    fsdp = by_method.get(LEARNER_LAYOUT_ROW) or next(
        (r for m, r in by_method.items() if m.startswith("fsdp-") and m != "fsdp-1"), {})
    if chunked.get("peak_extra_ratio_vs_naive") is not None:
        got = chunked["peak_extra_ratio_vs_naive"]
        verdict.append(f"the chunked step's peak memory is {times(got, 3)} the naive step's (goal ≤ 0.1×): "
                       + ("met" if got <= 0.1 else "**missed**"))
    if fsdp.get("step_rate_vs_chunked") is not None:
        got = fsdp["step_rate_vs_chunked"]
        verdict.append(f"FSDP2 on {fsdp.get('world_size')} GPUs, in the layout the learner uses "
                       f"(`{fsdp.get('layout', 'default')}`), steps at {times(got)} one GPU's rate (goal ≥ 1.8×): "
                       + ("met" if got >= 1.8 else "**missed**"))
    return (provenance(LEARNER_STEP, raw["meta"]) + "\n\n" + shape
            + table(["method", "GPUs", "chunk", "step s", "steps/s", "peak extra GiB", "peak vs naive", "held GiB",
                     "head GiB", "head vs naive", "rate vs fsdp-1", "rate vs chunked"], ["l"] + ["r"] * 11, rows)
            + ("\n\nAgainst issue 18's goals: " + "; ".join(verdict) + "." if verdict else ""))


LEARNER_RANKS = "benchmarks/results/learner_ranks-cuda.json"


@block("learner-ranks-cuda")
def _():
    if not (ROOT / LEARNER_RANKS).is_file():
        return (f"Not measured yet: `{LEARNER_RANKS}` is not committed. Run the command above on a machine with "
                "two GPUs,\ncommit its JSON and `python docs/render.py` fills this in.")
    raw = load(LEARNER_RANKS)
    rows = []
    for r in raw["results"]:
        if "error" in r:
            rows.append([str(r["ranks"]), f"error: {(r['error'].strip().splitlines() or ['?'])[-1][:80]}"] + [""] * 7)
            continue
        rows.append([bold(str(r["ranks"]), r["ranks"] == 1), f"{r['open_s']:.1f}", f"{r['score_s']:.3f}",
                     f"{r['first_step_s']:.3f}", f"{r['step_s']:.3f}", f"{r['save_s']:.2f}",
                     "–" if "step_rate_vs_1_rank" not in r else times(r["step_rate_vs_1_rank"]),
                     "–" if "max_abs_weight_diff" not in r else sci(r["max_abs_weight_diff"]),
                     "–" if "share_within_1e-5" not in r else f"{r['share_within_1e-5']:.4f}"])
    first = next((r for r in raw["results"] if "error" not in r), None)
    shape = "" if first is None else (
        f"Shape `{first['model']}`, float32 master weights, {n(first['tokens'])} tokens a step "
        f"({first['sequences']} sequences of {first['seq']}), activation checkpointing on.\n\n")
    return (provenance(LEARNER_RANKS, raw["meta"]) + "\n\n" + shape
            + table(["ranks", "open s", "score s", "first step s", "step s", "save s", "step rate vs 1 rank",
                     "max \\|Δw\\| vs 1 rank", "weights within 1e-5"], ["l"] + ["r"] * 8, rows))


# ---- issue 14: experiments (a) on tiny-start with its shuffled-reward control, and (c) ---------------

EXP_A2 = "experiments/results/exp-a2"
EXP_C = "experiments/results/exp-c"
GATE_TIERS = ("train", "train_with_correction", "replay", "quarantine")


def pending(path: str, config: str) -> str:
    """What a block says while its campaign's raw directory is not committed: no number."""
    return (f"Not run yet at full size: `{config}`'s campaign directory is not committed under `{path}/`, "
            "so this section\nquotes no number yet. Run the campaign, commit its directory with a "
            "`manifest.json`, and `python docs/render.py`\nfills it in.")


def _committed_campaign(path: str):
    """The campaign committed at `path` (stats.py's Campaign), every file in it counted as read;
    None while it is not committed."""
    from rollmarket.research.stats import load_campaign

    root = ROOT / path
    if not (root / "campaign.json").is_file():
        return None
    campaign = load_campaign(root)
    for file in sorted(root.rglob("*")):  # read by the statistics below: results a doc uses
        if file.is_file() and file.name != "manifest.json":
            LOADED.add(str(file.relative_to(ROOT)))
    return campaign


def _run_minutes(run) -> float | None:
    summary = run.path / "summary.json"
    return json.loads(summary.read_text())["minutes"] if summary.is_file() else None


def _gate_shares(run) -> dict[str, float]:
    """The share of the run's judged groups (every step's) the gate sent to each tier."""
    rows = [r for r in run.rows if r.get("step", 0) > 0]
    groups = sum(r.get("num_groups") or 0 for r in rows)
    return {tier: (sum(r.get(f"gate/{tier}") or 0 for r in rows) / groups if groups else math.nan)
            for tier in GATE_TIERS}


def _run_mean(run, key: str) -> float:
    """The mean over the run's training steps of a per-step figure (steps without it left out)."""
    values = [r[key] for r in run.rows if r.get("step", 0) > 0 and r.get(key) is not None]
    return statistics.mean(values) if values else math.nan


def _mean_ci(values: list[float]) -> tuple[float, float, float]:
    """Mean and 95% t interval of per-seed values (stats.py's t_interval)."""
    from rollmarket.research.stats import t_interval

    lo, hi = t_interval(values)
    return statistics.mean(values), lo, hi


def _ci(mean: float, lo: float, hi: float, fmt=lambda x: f"{x:.3f}") -> str:
    """'mean [lo, hi]', minus signs typeset."""
    return f"{fmt(mean)} [{fmt(lo)}, {fmt(hi)}]".replace("-", "−")


@cache
def exp_a2() -> dict | None:
    """Experiment (a) of issue 14: each condition against itself before training (`rollmarket stats
    --before-after`) and grpo against the shuffled control (`rollmarket stats`), recomputed here."""
    from rollmarket.research.stats import campaign_report, report_dict

    campaign = _committed_campaign(EXP_A2)
    if campaign is None:
        return None
    gains = {c["candidate"]: c["metrics"] for c in
             report_dict(campaign_report(campaign, before_after=True))["comparisons"]}
    versus = report_dict(campaign_report(campaign))["comparisons"]
    minutes = [m for runs in campaign.runs.values() for m in map(_run_minutes, runs) if m is not None]
    return {"manifest": load(f"{EXP_A2}/manifest.json"), "campaign": campaign, "gains": gains, "versus": versus,
            "minutes": minutes}


@block("exp-a2-provenance")
def _():
    a = exp_a2()
    if a is None:
        return pending(EXP_A2, "configs/exp-a-campaign.toml")
    return campaign_provenance(EXP_A2, a["manifest"])


@block("exp-a2-seeds")
def _():
    a = exp_a2()
    if a is None:
        return ""  # exp-a2-provenance says why
    primary = {name: metrics[0] for name, metrics in a["gains"].items()}
    conditions = list(primary)
    seeds = primary[conditions[0]]["seeds"]
    out = []
    for i, seed in enumerate(seeds):
        cells = [str(seed)]
        for name in conditions:
            m = primary[name]
            j = m["seeds"].index(seed) if seed in m["seeds"] else None
            cells.append("–" if j is None else
                         f"{m['baseline_values'][j]:.3f} → {m['candidate_values'][j]:.3f} "
                         f"({signed(m['differences'][j])})")
        out.append(cells)
    metric = primary[conditions[0]]["metric"]
    return table(["seed", *[f"{name}: `{metric}` before → after (gain)" for name in conditions]],
                 ["l"] * (1 + len(conditions)), out)


def _verdict_rows(label: str, metrics: list[dict]) -> list[list[str]]:
    rows = []
    for m in metrics:
        lo, hi = m["t_interval"]
        boot = m["two_way_bootstrap"]
        tost = m["equivalence"]
        rows.append([label, f"`{m['metric']}`", str(m["n_seeds"]), signed(m["mean_difference"]),
                     f"[{signed(lo)}, {signed(hi)}]",
                     f"[{signed(boot['lo'])}, {signed(boot['hi'])}]" if boot else "–",
                     f"{_p(m['sign_flip']['p'])} ({_p(m['p_holm'])})",
                     f"{_p(tost['p_holm'])} (±{tost['margin']:g})" if tost else "–",
                     bold(m["verdict"], m["verdict"] in ("CONFIRMED", "EQUIVALENT"))])
    return rows


@block("exp-a2-gains")
def _():
    a = exp_a2()
    if a is None:
        return ""
    out = []
    for name, metrics in a["gains"].items():
        out += _verdict_rows(f"{name}: after vs before", metrics)
    for c in a["versus"]:
        out += _verdict_rows(f"{c['candidate']} vs {c['baseline']}", c["metrics"])
    return table(["comparison", "metric", "seeds", "Δ", "95% t interval", "95% two-way (seed, task) bootstrap",
                  "exact sign-flip p (Holm)", "TOST p (margin)", "verdict"], list("llrrlllll"), out)


@block("exp-a2-prose")
def _():
    a = exp_a2()
    if a is None:
        return ""
    lines = []
    for name, metrics in a["gains"].items():
        m = metrics[0]
        rises = sum(d > 0 for d in m["differences"])
        lines.append(f"- **{name}**: `{m['metric']}` rose in {rises} of {m['n_seeds']} seeds, mean "
                     f"{signed(m['mean_difference'])}; **{m['verdict']}**: {m['reason']}")
    for c in a["versus"]:
        m = c["metrics"][0]
        lines.append(f"- **{c['candidate']} vs {c['baseline']}**: **{m['verdict']}**: {m['reason']}")
    grpo = a["gains"].get("grpo", [None])[0]
    control = a["gains"].get("shuffled", [None])[0]
    goal = ""
    if grpo is not None:
        met = grpo["verdict"] == "CONFIRMED" and grpo["t_interval"][0] >= 0.20
        goal = (f"\n\nAgainst the goal (a gain of ≥ 0.20 held-out pass@1): the grpo gain's 95% t interval starts at "
                f"{signed(grpo['t_interval'][0])}, so the goal is {'met' if met else 'not shown'}"
                f"{'' if met else ' (its lower end is below 0.20)' if grpo['verdict'] == 'CONFIRMED' else ''}.")
    if control is not None:
        goal += (" The shuffled-reward control shows "
                 + ("a gain: the reward is not the only thing that moved pass@1." if control["verdict"] == "CONFIRMED"
                    else "no gain (" + {"EQUIVALENT": "equivalent to no change within the margin",
                                        "REFUTED": "it got worse: updates on uninformative rewards degrade the policy",
                                        }.get(control["verdict"], "not significant") + ")."))
    minutes = a["minutes"]
    timing = (f" Runs took {span(f'{min(minutes):.1f}', f'{max(minutes):.1f}')} min each on the machine above "
              "(summary.json); the ≤ 10 min budget is for one run alone on the 2-core box.") if minutes else ""
    return "What the data shows:\n\n" + "\n".join(lines) + goal + timing


@cache
def exp_c() -> dict | None:
    """Experiment (c): every threshold setting against the reference (`rollmarket stats`), each
    against itself before training (`--before-after`), what the gate did, and the runs' minutes."""
    from rollmarket.research.stats import campaign_report, holm, report_dict

    campaign = _committed_campaign(EXP_C)
    if campaign is None:
        return None
    versus = report_dict(campaign_report(campaign))
    gains = {c["candidate"]: c["metrics"][0] for c in
             report_dict(campaign_report(campaign, before_after=True))["comparisons"]}
    reference = versus["baseline"]
    by_candidate = {c["candidate"]: c["metrics"][0] for c in versus["comparisons"]}
    names = list(by_candidate)
    adjusted = holm([by_candidate[n]["sign_flip"]["p"] for n in names]) if names else []
    conditions = []
    runs_of = {name: {r.seed: r for r in campaign.runs[name]} for name in campaign.conditions}
    for name in campaign.conditions:
        runs = [runs_of[name][s] for s in sorted(runs_of[name])]
        gate = ((runs[0].config or {}).get("config") or {}).get("gate", {}) if runs else {}
        shares = [_gate_shares(r) for r in runs]
        minutes = [m for m in map(_run_minutes, runs) if m is not None]
        ref_minutes = {s: _run_minutes(r) for s, r in runs_of[reference].items()}
        ref_quarantine = {s: _gate_shares(r)["quarantine"] for s, r in runs_of[reference].items()}
        paired = [s for s in sorted(runs_of[name]) if s in runs_of[reference]]
        conditions.append({
            "name": name, "reference": name == reference, "gate": gate, "gain": gains[name],
            "final": gains[name]["candidate_values"],
            "versus": by_candidate.get(name),
            "p_holm_across": adjusted[names.index(name)] if name in by_candidate else None,
            "shares": {t: [s[t] for s in shares] for t in GATE_TIERS},
            "token_ess": [_run_mean(r, "mismatch/token_ess_mean") for r in runs],
            "lag": [_run_mean(r, "policy_lag/mean") for r in runs],
            "minutes": minutes,
            "quarantine_vs_reference": [_gate_shares(runs_of[name][s])["quarantine"] - ref_quarantine[s]
                                        for s in paired],
            "minutes_vs_reference": [_run_minutes(runs_of[name][s]) - ref_minutes[s] for s in paired
                                     if ref_minutes[s] is not None and _run_minutes(runs_of[name][s]) is not None],
        })
    return {"manifest": load(f"{EXP_C}/manifest.json"), "reference": reference, "conditions": conditions,
            "compared": len(names), "alpha": versus["settings"]["alpha"]}


@block("exp-c-provenance")
def _():
    c = exp_c()
    if c is None:
        return pending(EXP_C, "configs/exp-c-campaign.toml")
    return campaign_provenance(EXP_C, c["manifest"])


@block("exp-c-pass")
def _():
    c = exp_c()
    if c is None:
        return ""  # exp-c-provenance says why
    out = []
    for cond in c["conditions"]:
        v, g = cond["versus"], cond["gain"]
        glo, ghi = g["t_interval"]
        row = [bold(cond["name"], cond["reference"]), f"{cond['gate'].get('min_ess', '–')}",
               f"{cond['gate'].get('max_policy_lag', '–')}", _ci(*_mean_ci(cond["final"])),
               f"{signed(g['mean_difference'])} [{signed(glo)}, {signed(ghi)}] {g['verdict']}"]
        if v is None:
            row += ["reference", "–", "–", "–"]
        else:
            lo, hi = v["t_interval"]
            tost = v["equivalence"]
            row += [f"{signed(v['mean_difference'])} [{signed(lo)}, {signed(hi)}]",
                    f"{_p(v['sign_flip']['p'])} ({_p(cond['p_holm_across'])})",
                    f"{_p(tost['p'])}" if tost else "–", bold(v["verdict"], v["verdict"] != "INCONCLUSIVE")]
        out.append(row)
    metric = c["conditions"][0]["gain"]["metric"]
    return table(["condition", "gate.min_ess", "gate.max_policy_lag", f"`{metric}` mean [95% t]",
                  "gain from before training [95% t], verdict", f"Δ vs {c['reference']} [95% t]",
                  f"exact p (Holm across {c['compared']})", "TOST p", "verdict vs reference"],
                 list("lrrllllll"), out)


@block("exp-c-gate")
def _():
    c = exp_c()
    if c is None:
        return ""  # exp-c-provenance says why
    out = []
    for cond in c["conditions"]:
        cells = [bold(cond["name"], cond["reference"])]
        cells += [_ci(*_mean_ci(cond["shares"][t]), fmt=lambda x: f"{x:.2f}") for t in GATE_TIERS]
        cells += [_ci(*_mean_ci(cond["token_ess"]), fmt=lambda x: f"{x:.3f}"),
                  _ci(*_mean_ci(cond["lag"]), fmt=lambda x: f"{x:.2f}")]
        dq, dm = cond["quarantine_vs_reference"], cond["minutes_vs_reference"]
        cells.append("reference" if cond["reference"] else _ci(*_mean_ci(dq), fmt=lambda x: signed(x, 2)))
        cells.append(_ci(*_mean_ci(cond["minutes"]), fmt=lambda x: f"{x:.1f}") if len(cond["minutes"]) > 1 else "–")
        cells.append("reference" if cond["reference"] else
                     _ci(*_mean_ci(dm), fmt=lambda x: signed(x, 1)) if len(dm) > 1 else "–")
        out.append(cells)
    return table(["condition", "share trained", "with correction", "replayed", "quarantined",
                  "token ESS (step mean)", "policy lag (step mean)", f"Δ quarantined vs {c['reference']}",
                  "minutes", f"Δ minutes vs {c['reference']}"], ["l"] * 10, out)


@block("exp-c-prose")
def _():
    c = exp_c()
    if c is None:
        return ""
    alpha = c["alpha"]
    lines, verdicts = [], {"converge": [], "worse": [], "undecided": []}
    for cond in c["conditions"]:
        g, v = cond["gain"], cond["versus"]
        trains = g["verdict"] == "CONFIRMED"
        if v is None:
            against = "the reference"
        elif v["verdict"] == "REFUTED":
            against = f"worse than {c['reference']} ({v['reason']})"
            if cond["p_holm_across"] >= alpha:
                against += f"; not significant after Holm across the {c['compared']} settings"
        elif v["verdict"] == "EQUIVALENT":
            against = f"equivalent to {c['reference']} within ±{v['equivalence']['margin']:g}"
        elif v["verdict"] == "CONFIRMED":
            against = f"better than {c['reference']}"
        else:
            against = f"not distinguishable from {c['reference']} ({v['reason']})"
        lines.append(f"- **{cond['name']}**: {'trains' if trains else 'no gain shown'} "
                     f"({g['verdict']}, gain {signed(g['mean_difference'])}); {against}.")
        if v is not None:  # the declared rule: own gain CONFIRMED and EQUIVALENT to the reference or better
            ok = trains and v["verdict"] in ("EQUIVALENT", "CONFIRMED")
            worse = "REFUTED" in (v["verdict"], g["verdict"])
            verdicts["converge" if ok else "worse" if worse else "undecided"].append(cond["name"])
    return (f"What the data shows ({c['compared']} settings compared with {c['reference']}; the verdicts are "
            "`rollmarket stats`', each\ncomparison Holm-corrected over its one metric only; the Holm column above "
            "corrects across the settings):\n\n" + "\n".join(lines)
            + f"\n\nAgainst the rule declared above (own gain CONFIRMED, and EQUIVALENT to {c['reference']} or "
              f"better): still converge: {', '.join(verdicts['converge']) or 'none'}; worse: "
              f"{', '.join(verdicts['worse']) or 'none'}; not decided by these seeds: "
              f"{', '.join(verdicts['undecided']) or 'none'}.")


# ---- experiment (b): engine drift and the training step -----------------------------------------

EXP_B = "experiments/results/exp-b/gradients.json"
EXP_B_MOE = "experiments/results/exp-b/gradients-tiny-moe.json"
"""The same script on tiny-moe (temperature 1.5, groups of 4), before tiny-start existed."""


def _interval(values: list, digits: int = 3) -> str:
    """mean [95% t interval] of per-replicate values (research/stats.py's interval), n noted."""
    from rollmarket.research.stats import t_interval

    x = [v for v in values if v is not None]
    if len(x) < 2:
        return f"{x[0]:.{digits}f} (n = 1)" if x else "–"
    lo, hi = t_interval(x)
    return f"{statistics.mean(x):.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def _tost(values: list, margin: float, alpha: float) -> dict:
    from rollmarket.research.stats import tost

    eq = tost([v for v in values if v is not None], margin, alpha)
    return {"p": eq.p, "interval": eq.interval, "equivalent": eq.p < alpha}


@cache
def exp_b(path: str = EXP_B) -> dict:
    """Experiment (b)'s gradient result, with the declared tests recomputed from its per-replicate values."""
    b = load(path)
    d = b["declared"]
    tests = {}
    for p in ("bf16", "fp8"):
        rows = b["weights"][p]["per_replicate"]
        rel = [r["relative_l2"] for r in rows if r["relative_l2"] is not None]
        cos = [r["cosine"] for r in rows if r["cosine"] is not None]
        tests[p] = {"rel": rel, "cos": cos,
                    "tost_rel": _tost(rel, d["margin_relative_l2"], d["alpha"]),
                    "tost_cos": _tost([1 - c for c in cos], 1 - d["margin_cosine"], d["alpha"])}
    return {**b, "tests": tests}


@block("exp-b-provenance")
def _():
    b = exp_b()
    s = b["settings"]
    return (f"{provenance(EXP_B, b)} Code: git {b['code']['git_commit']}. Model `{s['model']}`, suite `{s['suite']}`, "
            f"{s['replicates']} replicates × {s['groups']} tasks × {s['group_size']} runs at temperature "
            f"{s['temperature']}, token TIS cap {s['cap']}; {b['wall_s'] / 60:.1f} min in all.")


@block("exp-b-forks")
def _():
    b = exp_b()
    rows = []
    for key, f in b["forks"].items():
        positions = [x for r in f.get("per_replicate", [f]) for x in r["fork_positions"] if x is not None]
        runs, forked = (f["runs"], f["forked"])
        rows.append([key, str(runs), str(forked), pct(forked / runs, 1) if runs else "–",
                     f"{statistics.median(positions):.0f}" if positions else "–",
                     f"{min(positions)}–{max(positions)}" if positions else "–"])
    return table(["same tasks, same sampling seeds", "agent runs", "forked", "share",
                  "median fork position (model tokens)", "range"], list("lrrrrr"), rows)


@block("exp-b-mismatch")
def _():
    b = exp_b()
    def cells(ms: list[dict], digits: int) -> list[str]:
        return [_interval([m["mean_abs_delta"] for m in ms], digits),
                _interval([m["max_abs_delta"] for m in ms], max(3, digits - 1)),
                _interval([m["fraction_above_0.1"] for m in ms], 4), _interval([m["token_ess"] for m in ms], 6)]

    rows = [["fp32 sampler (its own reported logprobs)", *cells(b["sampler_vs_trainer_fp32"], 7), "–"]]
    for p in ("bf16", "fp8"):
        w = b["weights"][p]
        rows.append([f"{p}, teacher-forced on the fp32 batch", *cells(w["mismatch"], 5),
                     _interval(w["router_flip_rate"], 4)])
    return table(["behaviour logprobs vs the fp32 trainer", "mean \\|Δ\\| (nats)", "max \\|Δ\\| (nats)",
                  "share of tokens with \\|Δ\\| > 0.1", "token ESS", "router top-1 flip rate"], list("lrrrrr"), rows)


@block("exp-b-gradients")
def _():
    b = exp_b()
    rows = []

    def add(label: str, pairs: list[dict]) -> None:
        rows.append([label, str(sum(x["cosine"] is not None for x in pairs)),
                     _interval([x["cosine"] for x in pairs]), _interval([x["relative_l2"] for x in pairs])])

    for p in ("bf16", "fp8"):
        add(f"**weights channel**: fp32 batch, IS on, behaviour from {p} vs from the fp32 sampler",
            b["weights"][p]["per_replicate"])
    for p in ("bf16", "fp8"):
        shuffled = [statistics.mean(x) for x in b["weights"][p]["permuted_relative_l2"]]
        rows.append([f"weights channel: {p}'s own Δ values dealt to random tokens of the batch (mean of "
                     f"{len(b['weights'][p]['permuted_relative_l2'][0])} shuffles per replicate)", str(len(shuffled)),
                     "–", _interval(shuffled)])
    for key, pairs in b["sampling"].items():
        add(("**noise floor**: " if "floor" in key else "sampling channel: ") + key, pairs)
    for p, pairs in b["is_on_vs_off_own_batch"].items():
        add(f"IS on vs off, {p} batch with {p}'s own logprobs", pairs)
    return table(["gradients compared (trainer's step, one batch each)", "n", "cosine, mean [95% t]",
                  "‖a − b‖/‖b‖, mean [95% t]"], list("lrrr"), rows)


@block("exp-b-tost")
def _():
    b = exp_b()
    d = b["declared"]
    rows = []
    for p, t in b["tests"].items():
        for label, key, margin in (("‖g_engine − g_fp32‖/‖g_fp32‖", "tost_rel", f"< {d['margin_relative_l2']}"),
                                   ("1 − cosine", "tost_cos", f"< {1 - d['margin_cosine']:.3f}")):
            e = t[key]
            lo, hi = e["interval"]
            rows.append([p, label, margin, f"[{lo:.4f}, {hi:.4f}]", f"{e['p']:.2g}",
                         bold("EQUIVALENT", True) if e["equivalent"] else "not shown equivalent"])
    return table(["engine", "measure (weights channel)", "declared margin", "90% t interval",
                  "TOST p", "verdict at α = 0.05"], list("llllrl"), rows)


def _control_rows(sigmas: list[dict]) -> list[list[str]]:
    rows = []
    for c in sigmas:
        draws = c["draws"]
        rows.append([f"{c['sigma']:g}", f"{c['expected_sq_relative_l2']:.2e}",
                     _interval([x["relative_l2"] ** 2 for x in draws], 7) if c["expected_sq_relative_l2"] < 1e-3
                     else _interval([x["relative_l2"] ** 2 for x in draws], 4),
                     f"{math.sqrt(c['expected_sq_relative_l2']):.4f}",
                     f"{statistics.mean(x['relative_l2'] ** 2 for x in draws) / c['expected_sq_relative_l2']:.2f}",
                     f"{c['expected_mean_abs_delta']:.4f}",
                     f"{statistics.mean(x['mean_abs_delta'] for x in draws):.4f}"])
    return rows


@block("exp-b-control")
def _():
    b = exp_b()
    pc, pt = b["positive_control"], b["positive_control_tokens"]
    header = ["σ (nats)", "expected E[rel²]", "measured mean rel² [95% t]", "√expected", "measured / expected",
              "expected mean \\|Δ\\|", "measured mean \\|Δ\\|"]
    return (f"Per sequence, on replicate {pc['replicate']}'s fp32 batch ({pc['sequences']} sequences; their "
            f"parts add up to the gradient within {pc['sum_of_parts_relative_l2']:.1e} relative), "
            f"{len(pc['sigmas'][0]['draws'])} draws per σ:\n\n"
            + table(header, list("rrrrrrr"), _control_rows(pc["sigmas"]))
            + f"\n\nPer token, on the same batch: Σ_t‖h_t‖² from {len(pt['token_parts_sq'])} Rademacher probes "
            f"(weights 1 ± {pt['probe']}) is {_interval(pt['token_parts_sq'], 4)}, against Σ_i‖g_i‖² = "
            f"{pt['sequence_parts_sq']:.4f} over sequences and ‖g‖² = {pt['total_sq']:.4f}:\n\n"
            + table(header, list("rrrrrrr"), _control_rows(pt["sigmas"])))


def _ratios(sigmas: list[dict]) -> list[float]:
    """Every draw's measured rel² over its σ's expected E[rel²]: each has mean 1 if the formula holds."""
    return [x["relative_l2"] ** 2 / c["expected_sq_relative_l2"] for c in sigmas for x in c["draws"]]


@block("exp-b-verdict")
def _():
    from rollmarket.research.drift import expected_squared_change
    from rollmarket.research.stats import t_interval

    b = exp_b()
    d = b["declared"]
    pc, pt = b["positive_control"], b["positive_control_tokens"]
    floor = [x["relative_l2"] for x in b["sampling"]["fp32 vs fp32, other seeds (floor)"]]
    f = statistics.mean(floor)
    first = pc["replicate"]
    lines = []
    seq, tok = _ratios(pc["sigmas"]), _ratios(pt["sigmas"])
    lines.append("**The instrument sees a mismatch of known size.** Measured rel² over the expected value, pooled "
                 f"over every draw of every σ from {min(c['sigma'] for c in pt['sigmas']):g} to "
                 f"{max(c['sigma'] for c in pc['sigmas']):g} nat (each ratio has mean 1 if the formula holds): "
                 f"{_interval(seq, 2)} per sequence ({len(seq)} draws), {_interval(tok, 2)} per token "
                 f"({len(tok)} draws).")
    per_sigma = [statistics.mean(x["relative_l2"] ** 2 for x in c["draws"]) / c["expected_sq_relative_l2"]
                 for c in pt["sigmas"]]
    lo, hi = t_interval(tok)
    if not lo <= 1 <= hi:
        lines[-1] += (f" Per token, every σ's expectation rests on one shared estimate of Σ_t‖h_t‖² from "
                      f"{len(pt['token_parts_sq'])} probes ({_interval(pt['token_parts_sq'], 4)}); the ratio "
                      f"sits at {min(per_sigma):.2f}–{max(per_sigma):.2f} for every σ, as an offset in that one "
                      "estimate would make it, while the measured change follows σ² over two decades. The "
                      "per-token check is the weaker one; the per-sequence expectation needs no estimate.")
    forks = b["forks"]
    rerun = forks["fp32 vs fp32 rerun"]
    lines.append("**Forks.** " + "; ".join(f"{k}: {v['forked']} of {v['runs']} runs forked" for k, v in forks.items())
                 + (". The rerun of one engine never forks, so the forks are the engines' numerics, not batching."
                    if rerun["forked"] == 0 else ". The rerun forks too: batching alone moves the draws."))
    parts = []
    for p, t in b["tests"].items():
        rel = statistics.mean(t["rel"])
        eq = t["tost_rel"]["equivalent"] and t["tost_cos"]["equivalent"]
        # What independent per-token noise of the engine's own mean |Δ| would do to the same batch.
        m = b["weights"][p]["mismatch"][first]
        sigma = m["mean_abs_delta"] * math.sqrt(math.pi / 2)
        iid = math.sqrt(expected_squared_change(sigma, b["settings"]["cap"], [statistics.mean(pt["token_parts_sq"])],
                                                pt["total_sq"]))
        real = b["weights"][p]["per_replicate"][first]["relative_l2"]
        shuffled = statistics.mean(statistics.mean(x) for x in b["weights"][p]["permuted_relative_l2"])
        placement = (f"the same Δ values dealt to random tokens move it by {shuffled:.3f} on average, so where the "
                     f"drift falls multiplies its effect {rel / shuffled:.1f}×" if rel > 2 * shuffled else
                     f"the same Δ values dealt to random tokens move it by {shuffled:.3f} on average: its size "
                     "and tail, not where it falls, make the effect")
        parts.append(f"{p} moves the IS-corrected gradient by {rel:.3f} of its norm (mean of "
                     f"{len(t['rel'])} replicates; {rel / f:.2f} of the noise floor's {f:.2f}), "
                     + ("**EQUIVALENT** within the declared margin" if eq else
                        f"**not shown equivalent** within the declared margin {d['margin_relative_l2']}")
                     + f"; {placement}; Gaussian per-token noise of its mean |Δ| would move replicate "
                     f"{first}'s gradient by {iid:.4f} where the real drift moves it by {real:.3f}")
    lines.append("**Weights channel.** " + "; ".join(parts) + ".")
    same = all(b["without_is_gradient_unchanged"])
    lines.append("**Without IS** " + (
        f"the gradient was bit-identical whichever engine's logprobs the batch carried "
        f"({len(b['without_is_gradient_unchanged'])} of {len(b['without_is_gradient_unchanged'])} checks): "
        "there drift reaches the step only through forks." if same else
        "the gradient moved with the behaviour logprobs in some checks: a bug to find before any claim.")
        + f" The weights never moved (max |Δθ| {b['weights_moved_max_abs']:g}).")
    sampling = []
    for p in ("bf16", "fp8"):
        same_seed = statistics.mean(x["cosine"] for x in b["sampling"][f"fp32 vs {p}, same seeds"]
                                    if x["cosine"] is not None)
        other = statistics.mean(x["relative_l2"] for x in b["sampling"][f"fp32 vs {p}, other seeds"]
                                if x["relative_l2"] is not None)
        sampling.append(f"{p} batches keep a cosine of {same_seed:.2f} with the fp32 batch of the same seeds, and "
                        f"across seeds differ from fp32's by {other:.2f} (fp32 from itself: {f:.2f})")
    lines.append("**Sampling channel.** " + "; ".join(sampling) + ".")
    return "\n\n".join(lines)


@block("exp-b-models")
def _():
    rows = []
    for path in (EXP_B, EXP_B_MOE):
        b = exp_b(path)
        s = b["settings"]
        floor = statistics.mean(x["relative_l2"] for x in b["sampling"]["fp32 vs fp32, other seeds (floor)"])
        cells = [f"`{s['model']}` (T = {s['temperature']}, {s['groups']} × {s['group_size']})",
                 f"{statistics.mean(b['datums']['fp32']):.1f}"]
        for p in ("bf16", "fp8"):
            t = b["tests"][p]
            shuffled = statistics.mean(statistics.mean(x) for x in b["weights"][p]["permuted_relative_l2"])
            cells += [f"{b['forks'][f'fp32 vs {p}']['forked']}/{b['forks'][f'fp32 vs {p}']['runs']}",
                      f"{statistics.mean(t['rel']):.3f} ({shuffled:.3f})",
                      "yes" if t["tost_rel"]["equivalent"] and t["tost_cos"]["equivalent"] else "no"]
        rows.append(cells + [f"{floor:.2f}"])
    return (table(["model (temperature, tasks × runs)", "trained sequences per batch", "bf16 forks",
                   "bf16 weights channel (shuffled)", "bf16 within margin", "fp8 forks",
                   "fp8 weights channel (shuffled)", "fp8 within margin", "noise floor"], list("lrrrlrrlr"), rows)
            + f"\n\nRaw results: `{EXP_B}` and `{EXP_B_MOE}`. Machine: {exp_b(EXP_B_MOE)['machine']['platform']}, "
            f"{exp_b(EXP_B_MOE)['machine']['cpus']} CPUs (both). Date: {exp_b(EXP_B_MOE)['date']} (tiny-moe), "
            f"{exp_b(EXP_B)['date']} (tiny-start).")


EXP_B_CAMPAIGN = "experiments/results/exp-b/campaign"
EXP_B_SMOKE = "experiments/results/exp-b/smoke"


@block("exp-b-training")
def _():
    """The full campaign when committed, else the local smoke, labelled as such; `rollmarket stats`'
    comparison (bf16 and fp8 against fp32, TOST at the declared margin) recomputed from its files."""
    from rollmarket.research.stats import campaign_report, load_campaign, report_dict

    # The full campaign as experiments/pack_campaign.py packs it (exp-b/campaign/); until then the
    # labelled smoke.
    full = EXP_B_CAMPAIGN if (ROOT / EXP_B_CAMPAIGN / "campaign.json").exists() else None
    smoke = full is None
    if not smoke and (ROOT / EXP_B_SMOKE).exists():
        raise RenderError(f"both {full} and {EXP_B_SMOKE} are committed: the full campaign replaces "
                          f"the smoke; delete {EXP_B_SMOKE}")
    where = EXP_B_SMOKE if smoke else full
    root = ROOT / where
    campaign = load_campaign(root)
    for file in sorted(root.rglob("*")):
        if file.is_file() and file.name != "manifest.json":
            LOADED.add(str(file.relative_to(ROOT)))
    m = load(f"{where}/manifest.json")
    report = report_dict(campaign_report(campaign))
    rows = []
    for name in campaign.conditions:
        for run in sorted(campaign.runs[name], key=lambda r: r.seed):
            summary = json.loads((run.path / "summary.json").read_text())
            before, after = summary["eval_before"], summary["eval_after"]
            rows.append([name, str(run.seed), str(summary["steps"]),
                         f"{before['eval/pass@1']:.3f} → {after['eval/pass@1']:.3f}",
                         f"{before['eval/accuracy/mean']:.3f} → {after['eval/accuracy/mean']:.3f}"])
    verdicts = []
    for c in report["comparisons"]:
        for x in c["metrics"]:
            lo, hi = x["t_interval"]
            eq = x.get("equivalence") or {}
            verdicts.append([c["candidate"], f"`{x['metric']}`", str(x["n_seeds"]), signed(x["mean_difference"]),
                             f"[{signed(lo)}, {signed(hi)}]", _p(x["sign_flip"]["p"]),
                             _p(eq["p"]) if eq else "–", bold(x["verdict"], not smoke)])
    head = (f"**SMOKE RUN, NOT EVIDENCE** — {m['note']}\n\n" if smoke else "")
    return (head + campaign_provenance(where, m) + "\n\n"
            + table(["condition", "seed", "steps", "held-out sampled pass@1 before → after",
                     "greedy accuracy before → after"], list("lrrll"), rows)
            + "\n\nAgainst the fp32 baseline, seed by seed (`rollmarket stats`):\n\n"
            + table(["candidate", "metric", "seeds", "Δ vs fp32", "95% t interval", "exact sign-flip p",
                     "TOST p (±margin)", "verdict"], list("llrrlrrl"), verdicts)
            + "\n\n" + "\n".join(f"- {c['candidate']}, `{x['metric']}`: {x['reason']}"
                                  for c in report["comparisons"] for x in c["metrics"]))


# ---- the shipped starting checkpoint (docs/models.md) ------------------------------------------------

START = "models/tiny-start/build_report.json"


@block("start-headroom")
def _():
    report = load(START)
    h = report["headroom"]
    ks = [k for k in h["model"] if k.startswith("pass@")]
    rows = [[label, *[f"{h[who][k]:.3f}" for k in ks], pct(h[who]["tool_rate"]),
             f"{h[who]['accuracy_given_tool']:.2f}"] for who, label in (("parent", "tiny-moe (before)"),
                                                                      ("model", "**tiny-start**"))]
    m = h["model"]
    return (table(["model", *ks, "runs that call a tool", "accuracy when they do"], list("l" + "r" * (len(ks) + 2)), rows)
            + f"\n\n{m['tasks']} held-out {h['family']} tasks × {m['samples']} samples, temperature {m['temperature']}, "
            f"seed {m['seed']}; tool share of the demonstrations {h['tool_share']}, {n(h['demonstrations'])} "
            f"demonstrations, {report['train']['steps_done']} steps in {report['train']['wall_s']:.0f} s "
            f"({report['machine']['cpu_threads']} torch thread, {report['machine']['platform']}). "
            f"`model.safetensors`: {report['safetensors_bytes'] / 1e6:.1f} MB.\n")


# ---- PostgreSQL and replicas (issue 16) -----------------------------------------------------------

STORES = "benchmarks/results/store_compare.json"


def _store_rows(kind: str) -> list[dict]:
    return [r for r in load(STORES)["rows"] if r["kind"] == kind]


def _store_base(kind: str) -> dict:
    return next(r for r in _store_rows(kind) if r["store"] == "sqlite")


def _store_label(r: dict) -> str:
    return "SQLite" if r["store"] == "sqlite" else f"PostgreSQL, {r['replicas']} replica{'s' * (r['replicas'] > 1)}"


@block("store-compare-provenance")
def _():
    return provenance(STORES, load(STORES))


@block("store-compare-ingest")
def _():
    base = _store_base("ingest")["tokens_per_s"]
    rows = [[_store_label(r), str(r["workers"]), f"{r['tokens_per_s'] / 1e6:.2f}M",
             bold(times(r["tokens_per_s"] / base), r["store"] != "sqlite"),
             f"{r['lease_p50_ms']:.1f} / {r['lease_p99_ms']:.1f}", f"{r['submit_p50_ms']:.1f} / {r['submit_p99_ms']:.1f}",
             f"{r['server_cpu_ms_per_group']:.2f}"] for r in _store_rows("ingest")]
    return table(["store", "workers", "response tokens/s", "vs SQLite", "lease p50 / p99 ms",
                  "submit p50 / p99 ms", "server CPU ms/group (all replicas)"], list("lr") + list("r" * 5), rows)


@block("store-compare-fairness")
def _():
    base = _store_base("fairness")["leases_per_s"]
    rows = [[_store_label(r), n(r["workers"]), f"{r['leases_per_s']:.1f}", times(r["leases_per_s"] / base),
             bold(f"{r['jain']:.3f}"), f"{r['min_leases']} / {r['max_leases']}", n(r["lease_p99_ms"], 1),
             "–" if r["submit_p99_ms"] is None else n(r["submit_p99_ms"], 1)] for r in _store_rows("fairness")]
    return table(["store", "light workers", "leases/s", "vs SQLite", "Jain's index", "min / max leases per worker",
                  "lease p99 ms", "submit p99 ms"], list("lr") + list("r" * 6), rows)


@block("store-compare-summary")
def _():
    ingest, fair = _store_rows("ingest"), _store_rows("fairness")
    base_i, base_f = _store_base("ingest"), _store_base("fairness")
    parts = [f"{_store_label(r)}: {times(r['tokens_per_s'] / base_i['tokens_per_s'])} SQLite's ingest "
             f"({r['tokens_per_s'] / 1e6:.2f}M response tokens/s, p99 lease {r['lease_p99_ms']:.0f} ms, "
             f"p99 submit {r['submit_p99_ms']:.0f} ms)" for r in ingest if r["store"] != "sqlite"]
    jain = ", ".join(f"{_store_label(r)} {r['jain']:.3f}" for r in fair)
    return (f"SQLite ingests {base_i['tokens_per_s'] / 1e6:.2f}M response tokens/s with {base_i['workers']} workers "
            f"(p99 lease {base_i['lease_p99_ms']:.0f} ms, p99 submit {base_i['submit_p99_ms']:.0f} ms); "
            + "; ".join(parts) + f". Lease fairness over {n(base_f['workers'])} light workers (Jain's index, "
            f"1.0 = every worker got as many leases): {jain}. " + provenance(STORES, load(STORES)))


# ---- experiment (d): router replay (R3), per rollout precision -----------------------------------

EXP_R3 = "experiments/results/exp-r3/campaign"
EXP_R3_GRAD = "experiments/results/exp-r3/gradients.json"
EXP_R3_GRAD_MOE = "experiments/results/exp-r3/gradients-tiny-moe.json"
"""The same script on tiny-moe at its recipe's temperature 1.5 (groups of 4), as (b) ran it there."""
R3_PRECISIONS = ("fp16", "bf16", "fp8")
R3_FIGURES = (("mismatch/token_ess_mean", "token ESS"), ("rollout_corr/rollout_is_eff_sample_size", "rollout_is ESS"),
              ("mismatch/mean_abs_delta", "mean \\|Δlogp\\|"), ("mismatch/router_flip_rate", "router flip rate"))
"""The per-step off-policy figures (d) reports for every condition (docs/metrics.md)."""


@cache
def exp_r3_gradients(path: str = EXP_R3_GRAD) -> dict | None:
    """(d)'s gradient part (experiments/exp_r3_gradients.py) with its declared tests recomputed from
    the per-replicate values: per precision, TOST of ‖g − g_fp32‖/‖g_fp32‖ without and with replay,
    and rel(replay) − rel(none) paired by replicate (t interval, exact sign-flip p). None while the
    result is not committed."""
    from rollmarket.research.stats import sign_flip_test, t_interval

    if not (ROOT / path).is_file():
        return None
    g = load(path)
    d = g["declared"]
    tests = {}
    for p in R3_PRECISIONS:
        rel = {c: [x["relative_l2"] for x in g["precisions"][p]["vs_fp32"][c]] for c in ("off", "on")}
        diff = [a - b for a, b in zip(rel["on"], rel["off"])]
        tests[p] = {"rel": rel, **{c: _tost(rel[c], d["margin_relative_l2"], d["alpha"]) for c in rel},
                    "diff": {"mean": statistics.mean(diff), "interval": t_interval(diff),
                             "p": sign_flip_test(diff).p}}
    return {**g, "tests": tests}


@block("exp-r3-gradients-provenance")
def _():
    g = exp_r3_gradients()
    if g is None:
        return (f"Not run yet: `python experiments/exp_r3_gradients.py` has not written `{EXP_R3_GRAD}`, so this "
                "part quotes no number yet.")
    s = g["settings"]
    return (f"{provenance(EXP_R3_GRAD, g)} Code: git {g['code']['git_commit']}. Model `{s['model']}`, suite "
            f"`{s['suite']}`, {s['replicates']} replicates × {s['groups']} tasks × {s['group_size']} runs at "
            f"temperature {s['temperature']} (fp32 rollouts; trained sequences per batch: "
            f"{statistics.mean(g['datums']):.1f}), token TIS cap {s['cap']}; {g['wall_s'] / 60:.1f} min in all, "
            f"{s['threads']} torch thread.")


@block("exp-r3-gradients-offpolicy")
def _():
    g = exp_r3_gradients()
    if g is None:
        return ""  # exp-r3-gradients-provenance says why
    rows = []
    for p in R3_PRECISIONS:
        row = g["precisions"][p]
        for c, label in (("off", "no"), ("on", "**yes**")):
            ms, rs = row["mismatch"][c], row["routing"][c]
            rows.append([p, label, _interval([m["mean_abs_delta"] for m in ms], 5),
                         _interval([m["token_ess"] for m in ms], 6), _interval([m["rollout_is_ess"] for m in ms], 6),
                         _interval([r["top1"] for r in rs], 4), _interval([r["topk_set"] for r in rs], 4)])
    return table(["engine (teacher-forced on the fp32 batch)", "router replay", "mean \\|Δlogp\\| (nats)",
                  "token ESS (the gate's)", "rollout_is ESS (verl's, C = 2)", "top-1 flip rate",
                  "top-k set changed"], list("llrrrrr"), rows)


@block("exp-r3-gradients-step")
def _():
    g = exp_r3_gradients()
    if g is None:
        return ""
    rows = []

    def add(label: str, pairs: list[dict]) -> None:
        rows.append([label, str(sum(x["cosine"] is not None for x in pairs)),
                     _interval([x["cosine"] for x in pairs], 4), _interval([x["relative_l2"] for x in pairs])])

    for p in R3_PRECISIONS:
        row = g["precisions"][p]
        add(f"{p} behaviour, **no replay**, vs the fp32-rollout step", row["vs_fp32"]["off"])
        add(f"{p} behaviour, **replay** of {p}'s experts, vs the fp32-rollout step", row["vs_fp32"]["on"])
        add(f"{p}: replay vs no replay", row["on_vs_off"])
        add(f"{p}: replay's routing alone (IS off, so no behaviour logprobs enter)", row["routing_alone"])
    add("control: fp32's own experts replayed, vs no replay", g["control_own_replay"]["per_replicate"])
    for key, pairs in g["floor"].items():
        add(f"**noise floor**: {key}, two replicates (other seeds)", pairs)
    return table(["gradients compared (trainer's step, IS on unless said)", "n", "cosine, mean [95% t]",
                  "‖a − b‖/‖b‖, mean [95% t]"], list("lrrr"), rows)


@block("exp-r3-gradients-tests")
def _():
    g = exp_r3_gradients()
    if g is None:
        return ""
    d = g["declared"]
    rows = []
    for p in R3_PRECISIONS:
        t = g["tests"][p]
        for c, label in (("off", "no"), ("on", "yes")):
            lo, hi = t[c]["interval"]
            cells = [p, label, f"[{lo:.4f}, {hi:.4f}]", f"{t[c]['p']:.2g}",
                     bold("EQUIVALENT", True) if t[c]["equivalent"] else "not shown equivalent"]
            if c == "off":
                cells += ["", ""]
            else:
                dlo, dhi = t["diff"]["interval"]
                cells += [f"{signed(t['diff']['mean'], 4)} [{signed(dlo, 4)}, {signed(dhi, 4)}]",
                          _p(t["diff"]["p"])]
            rows.append(cells)
    return table(["engine", "router replay",
                  f"‖g − g_fp32‖/‖g_fp32‖: 90% t interval (margin < {d['margin_relative_l2']})",
                  "TOST p", "verdict at α = 0.05", "replay − no replay, mean [95% t]", "exact sign-flip p"],
                 list("lllrlll"), rows)


@block("exp-r3-gradients-verdict")
def _():
    g = exp_r3_gradients()
    if g is None:
        return ""
    alpha = g["declared"]["alpha"]
    floor = statistics.mean(x["relative_l2"] for x in g["floor"]["fp32, no replay"])
    lines = []
    for p in R3_PRECISIONS:
        t, row = g["tests"][p], g["precisions"][p]
        off, on = statistics.mean(t["rel"]["off"]), statistics.mean(t["rel"]["on"])
        diff = t["diff"]
        moved = ("closer to" if diff["mean"] < 0 else "farther from") if diff["p"] < alpha else None
        flips = statistics.mean(r["top1"] for r in row["routing"]["off"])
        ess = [statistics.mean(m["token_ess"] for m in row["mismatch"][c]) for c in ("off", "on")]
        lines.append(
            f"- **{p}**: without replay {pct(flips, 2)} of the (policy token, layer) top-1 experts flip and the step "
            f"lies {off:.3f} (relative) from the fp32-rollout step; with replay {on:.3f}, "
            + (f"{moved} it by the paired test (exact p = {_p(diff['p'])})" if moved else
               f"not distinguishable from no replay (exact p = {_p(diff['p'])})")
            + f"; the noise floor is {floor:.2f}. Token ESS {ess[0]:.6f} without replay, {ess[1]:.6f} with. "
            + f"Within the declared margin: {'yes' if t['off']['equivalent'] else 'not shown'} without replay, "
            + f"{'yes' if t['on']['equivalent'] else 'not shown'} with.")
    control = max(x["relative_l2"] for x in g["control_own_replay"]["per_replicate"])
    return ("\n".join(lines) + f"\n\nThe control (fp32 replaying the experts it chooses itself) moves the step by at "
            f"most {control:.1e} relative: replay adds nothing of its own where routing agrees.")


@block("exp-r3-gradients-models")
def _():
    rows, missing = [], []
    for path in (EXP_R3_GRAD, EXP_R3_GRAD_MOE):
        g = exp_r3_gradients(path)
        if g is None:
            missing.append(f"`{path}` is not committed (not run yet)")
            continue
        s = g["settings"]
        floor = statistics.mean(x["relative_l2"] for x in g["floor"]["fp32, no replay"])
        for p in R3_PRECISIONS:
            t, row = g["tests"][p], g["precisions"][p]
            lo, hi = t["diff"]["interval"]
            rows.append([f"`{s['model']}` (T = {s['temperature']}, {s['groups']} × {s['group_size']})", p,
                         f"{statistics.mean(r['top1'] for r in row['routing']['off']):.4f}",
                         " → ".join(f"{statistics.mean(m['token_ess'] for m in row['mismatch'][c]):.6f}"
                                    for c in ("off", "on")),
                         f"{statistics.mean(t['rel']['off']):.3f}", f"{statistics.mean(t['rel']['on']):.3f}",
                         f"{signed(t['diff']['mean'], 4)} [{signed(lo, 4)}, {signed(hi, 4)}], p {_p(t['diff']['p'])}",
                         f"{'yes' if t['off']['equivalent'] else 'no'} / {'yes' if t['on']['equivalent'] else 'no'}",
                         f"{floor:.2f}"])
    if not rows:
        return ""  # exp-r3-gradients-provenance says why
    text = table(["model (temperature, tasks × runs)", "engine", "top-1 flips without replay",
                  "token ESS: no replay → replay", "‖g − g_fp32‖/‖g_fp32‖ no replay", "with replay",
                  "replay − no replay [95% t], exact p", "within margin: no replay / replay", "noise floor"],
                 list("llrlrrlll"), rows)
    sources = [provenance(path, exp_r3_gradients(path), inline=True) for path in (EXP_R3_GRAD, EXP_R3_GRAD_MOE)
               if exp_r3_gradients(path) is not None]
    return text + "\n\nFrom the " + " and the ".join(sources) + (". " + "; ".join(missing) + "." if missing else ".")


def _pair_ci(values: list[float], fmt) -> str:
    return _ci(*_mean_ci(values), fmt=fmt) if len(values) > 1 else "–"


@cache
def exp_r3() -> dict | None:
    """Experiment (d)'s campaign: at each precision `<p>-r3` against `<p>` (`rollmarket stats --baseline
    <p>`), each condition against itself before training, and the off-policy figures per step."""
    from rollmarket.research.stats import campaign_report, report_dict

    campaign = _committed_campaign(EXP_R3)
    if campaign is None:
        return None
    primary = campaign.stats.get("metrics", ["eval/pass@1@final"])[0]
    gains = {c["candidate"]: c["metrics"][0] for c in
             report_dict(campaign_report(campaign, before_after=True, metrics=[primary]))["comparisons"]}
    runs_of = {name: {r.seed: r for r in campaign.runs[name]} for name in campaign.conditions}
    precisions = []
    for p in R3_PRECISIONS:
        if p not in campaign.runs or f"{p}-r3" not in campaign.runs:
            continue
        report = report_dict(campaign_report(campaign, baseline=p))
        versus = next(c for c in report["comparisons"] if c["candidate"] == f"{p}-r3")
        seeds = sorted(s for s in runs_of[p] if s in runs_of[f"{p}-r3"])
        figures = {}
        for key, _ in R3_FIGURES:
            none = [_run_mean(runs_of[p][s], key) for s in seeds]
            replay = [_run_mean(runs_of[f"{p}-r3"][s], key) for s in seeds]
            figures[key] = {"none": none, "replay": replay, "delta": [b - a for a, b in zip(none, replay)]}
        shares = {side: [_gate_shares(runs_of[name][s]) for s in seeds] for side, name in (("none", p), ("replay", f"{p}-r3"))}
        precisions.append({"precision": p, "metrics": versus["metrics"], "figures": figures, "shares": shares,
                           "final": {side: gains[name]["candidate_values"] for side, name in
                                     (("none", p), ("replay", f"{p}-r3"))},
                           "gain": {"none": gains[p], "replay": gains[f"{p}-r3"]}})
    steps = sorted({r["step"] for runs in campaign.runs.values() for run in runs for r in run.rows
                    if r.get("step", 0) > 0 and r.get("mismatch/token_ess_mean") is not None})
    ess_steps = {name: {step: [r["mismatch/token_ess_mean"] for run in campaign.runs[name] for r in run.rows
                               if r.get("step") == step and r.get("mismatch/token_ess_mean") is not None]
                        for step in steps} for name in campaign.conditions}
    return {"manifest": load(f"{EXP_R3}/manifest.json"), "precisions": precisions,
            "conditions": campaign.conditions, "steps": steps, "ess_steps": ess_steps}


@block("exp-r3-provenance")
def _():
    r = exp_r3()
    if r is None:
        return pending(EXP_R3, "configs/exp-r3-campaign.toml")
    return campaign_provenance(EXP_R3, r["manifest"])


@block("exp-r3-pass")
def _():
    r = exp_r3()
    if r is None:
        return ""  # exp-r3-provenance says why
    rows = []
    for x in r["precisions"]:
        m = x["metrics"][0]
        lo, hi = m["t_interval"]
        tost = m["equivalence"]
        gains = " / ".join(f"{signed(g['mean_difference'])} {g['verdict']}" for g in x["gain"].values())
        rows.append([x["precision"], _ci(*_mean_ci(x["final"]["none"])), _ci(*_mean_ci(x["final"]["replay"])), gains,
                     f"{signed(m['mean_difference'])} [{signed(lo)}, {signed(hi)}]",
                     f"{_p(m['sign_flip']['p'])} ({_p(m['p_holm'])})",
                     f"{_p(tost['p_holm'])} (±{tost['margin']:g})" if tost else "–",
                     bold(m["verdict"], m["verdict"] != "INCONCLUSIVE")])
    metric = r["precisions"][0]["metrics"][0]["metric"] if r["precisions"] else "eval/pass@1@final"
    return table(["rollout", f"`{metric}` no replay [95% t]", "with replay [95% t]",
                  "gain from before training: no replay / replay", "Δ replay − no replay [95% t]",
                  "exact sign-flip p (Holm)", "TOST p (margin)", "verdict"], list("llllllll"), rows)


@block("exp-r3-offpolicy")
def _():
    r = exp_r3()
    if r is None:
        return ""
    rows = []
    for x in r["precisions"]:
        ess = next((m for m in x["metrics"][1:] if m["metric"].startswith("mismatch/token_ess_mean")), None)
        for side, label in (("none", "no"), ("replay", "**yes**")):
            cells = [x["precision"], label]
            for key, _ in R3_FIGURES:
                values = [v for v in x["figures"][key][side] if not math.isnan(v)]
                cells.append(_pair_ci(values, lambda v: f"{v:.6f}" if "ess" in key else f"{v:.4f}"))
            cells += [_pair_ci([s[t] for s in x["shares"][side]], lambda v: f"{v:.2f}")
                      for t in ("train", "train_with_correction", "quarantine")]
            if side == "none":
                cells.append("")
            else:
                d = [v for v in x["figures"]["mismatch/token_ess_mean"]["delta"] if not math.isnan(v)]
                cells.append(_pair_ci(d, lambda v: f"{v:+.6f}") + (f"; {ess['verdict']} (p {_p(ess['p_holm'])}, Holm)"
                                                                   if ess else ""))
            rows.append(cells)
    return table(["rollout", "router replay", *[f"{label} (step mean)" for _, label in R3_FIGURES],
                  "share trained", "with correction", "quarantined", "Δ token ESS, replay − no replay [95% t]"],
                 ["l"] * 10, rows)


@block("exp-r3-ess-steps")
def _():
    r = exp_r3()
    if r is None:
        return ""
    names = r["conditions"]
    rows = [[str(step), *[f"{statistics.mean(v):.6f}" if (v := r["ess_steps"][n][step]) else "–" for n in names]]
            for step in r["steps"]]
    return table(["step", *[f"{n}" for n in names]], ["r"] * (1 + len(names)), rows)


@block("exp-r3-prose")
def _():
    r = exp_r3()
    if r is None:
        return ""
    lines = []
    for x in r["precisions"]:
        m = x["metrics"][0]
        ess = next((e for e in x["metrics"][1:] if e["metric"].startswith("mismatch/token_ess_mean")), None)
        answer = {"EQUIVALENT": "replay does not change what training reaches",
                  "CONFIRMED": "training with replay ends higher",
                  "REFUTED": "training with replay ends lower"}.get(m["verdict"], "not decided by these seeds")
        ess_text = ""
        if ess is not None:
            ess_text = {"CONFIRMED": "raises the token ESS the gate sees", "REFUTED": "lowers the token ESS the gate sees",
                        }.get(ess["verdict"], "leaves no detectable change in the token ESS the gate sees")
            ess_text = f"; it {ess_text} (mean Δ {ess['mean_difference']:+.2e}, {ess['verdict']})"
        lines.append(f"- **{x['precision']}**: {answer} ({m['verdict']}: {m['reason']}){ess_text}.")
    return "What the data shows (each `<p>-r3` against `<p>`, seed by seed):\n\n" + "\n".join(lines)


# ---- GPU tests ----------------------------------------------------------------------------------

RANKS_KILL = "benchmarks/results/ranks_kill-cuda"
"""``.xml`` (junit), ``.log`` (the test's output) and ``.gpus`` of `gpu_run.sh ranks-kill`."""


@block("ranks-kill")
def _():
    xml_path = ROOT / f"{RANKS_KILL}.xml"
    if not xml_path.exists():
        return f"Not run yet: no `{RANKS_KILL}.xml` is committed (`bash benchmarks/gpu_run.sh ranks-kill` on two GPUs)."
    import re
    import xml.etree.ElementTree as ET

    suite = next(ET.parse(xml_path).getroot().iter("testsuite"))
    cases = list(suite.iter("testcase"))
    passed = [c for c in cases if not any(c.find(t) is not None for t in ("failure", "error", "skipped"))]
    log = (ROOT / f"{RANKS_KILL}.log").read_text() if (ROOT / f"{RANKS_KILL}.log").exists() else ""
    stopped = re.search(r"stopped ([0-9.]+)s after the kill", log)
    gpus = (ROOT / f"{RANKS_KILL}.gpus").read_text().split("\n") if (ROOT / f"{RANKS_KILL}.gpus").exists() else []
    gpus = [g for g in gpus if g.strip()]
    return (f"Raw result: `{RANKS_KILL}.xml` and `.log`. Machine: {len(gpus)} × {gpus[0] if gpus else 'GPU'}. "
            f"Date: {suite.get('timestamp', '?')[:19]}.\n\n"
            + ", ".join(f"`{c.get('name')}`" for c in cases)
            + f": {len(passed)} of {len(cases)} passed in {float(suite.get('time', 0)):.0f} s"
            + (f"; the trainer stopped {stopped.group(1)} s after the kill, well before the "
               "exit train/ranks.py forces after GRACE_S (30 s) on a collective that never returns" if stopped else "") + ".")


GPU_TESTS = "benchmarks/results/gpu_tests-cuda.json"


@block("gpu-tests")
def _():
    """When and on which card tests/test_gpu_kernels.py last ran on the device, and what it gave."""
    if not (ROOT / GPU_TESTS).exists():
        return (f"Not run yet: no `{GPU_TESTS}` is committed (`bash benchmarks/gpu_run.sh tests` on the "
                "device writes it).")
    data = load(GPU_TESTS)
    rows = data["rows"]
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["test"].split("[")[0], []).append(row)

    def count(items: list[dict], *outcomes: str) -> int:
        return sum(r["outcome"] in outcomes for r in items)

    failed = [r for r in rows if r["outcome"] in ("failed", "error")]
    gpu = data["machine"].get("gpu", "no GPU")
    verdict = (f"**{count(rows, 'passed')} passed, {len(failed)} failed, {count(rows, 'skipped')} skipped** "
               f"of {len(rows)} cases on {gpu}, {n(sum(r['seconds'] for r in rows), 1)} s in all")
    body = table(["test", "cases", "passed", "failed", "skipped", "seconds"], ["l", "r", "r", "r", "r", "r"],
                 [[f"`{name}`", str(len(items)), str(count(items, "passed")), str(count(items, "failed", "error")),
                   str(count(items, "skipped")), n(sum(r["seconds"] for r in items), 1)]
                  for name, items in groups.items()])
    lines = [provenance(GPU_TESTS, data), "", f"Last run: {verdict}.", "", body]
    if failed:
        lines += ["", "Failures (first 10):", ""]
        lines += [f"- `{r['test']}`: {r['message'] or r['outcome']}" for r in failed[:10]]
    return "\n".join(lines)


FUSED_KERNEL = "benchmarks/results/fused_kernel-cuda.json"


@block("gpu-kernel-speed")
def _():
    """The fixed kernel beside the one before the fix, on the engine's chunk."""
    if not (ROOT / FUSED_KERNEL).exists():
        return (f"Not measured yet: no `{FUSED_KERNEL}` is committed (`bash benchmarks/gpu_run.sh fused_kernel` "
                "on the device writes it).")
    data = load(FUSED_KERNEL)
    rows = data["rows"]

    def distance(r: dict) -> str:
        if r["max_abs_diff_logprob"] is None:
            return "—"
        return f"{sci(r['max_abs_diff_logprob'])} / {sci(r['max_abs_diff_entropy'])}"

    body = table(["logits", "before ms", "fixed ms", "fixed GB/s", "**fixed ÷ before**", "max \\|Δ\\| logprob / entropy",
                  "entropies finite: before / fixed"], ["l", "r", "r", "r", "r", "r", "l"],
                 [[r["case"], f"{r['before_ms_median']:.3f}", f"{r['fixed_ms_median']:.3f}",
                   n(r["bytes"] / r["fixed_ms_median"] / 1e6), bold(times(r["fixed_ms_median"] / r["before_ms_median"])),
                   distance(r), f"{'yes' if r['before_entropy_finite'] else 'no'} / "
                   f"{'yes' if r['fixed_entropy_finite'] else 'no'}"] for r in rows])
    shape = f"{n(rows[0]['rows'])} × {n(rows[0]['vocab'])}"
    return "\n".join([provenance(FUSED_KERNEL, data), "",
                      f"Median of {data['args']['repeats']} calls each on {shape} logits:", "", body])


# ---- the two commands ---------------------------------------------------------------------------

def render(text: str) -> str:
    """TEXT with every generated block rewritten from the raw results."""
    def replace(match: re.Match) -> str:
        name = match["name"]
        if name not in BLOCKS:
            raise RenderError(f"no renderer for block {name!r}")
        return f"<!-- generated: {name} -->\n{BLOCKS[name]().rstrip()}\n<!-- /generated -->"
    return BLOCK_RE.sub(replace, text)


def block_names(text: str) -> list[str]:
    return [m["name"] for m in BLOCK_RE.finditer(text)]


# ---- vLLM policy reload ---------------------------------------------------------------------------

VLLM_RELOAD = "benchmarks/results/vllm_reload.json"


@block("vllm-reload")
def _():
    result = load(VLLM_RELOAD)
    rows = result["rows"]
    out = [[r["case"], f"{r['seconds']:.2f}", bold(times(r["ratio_to_cold_start"]), i == 1),
            "–" if r["canary_mean_abs_delta"] is None else f"{r['canary_mean_abs_delta']:.3f}",
            "–" if r["acked"] is None else ("yes" if r["acked"] else "no (canary)")] for i, r in enumerate(rows)]
    cold, managed, inplace = rows
    machine = result["machine"]

    def secs(xs: list[float]) -> str:
        return ", ".join(f"{x:.0f}" for x in xs)

    checks = [r - s for r, s in zip(managed["samples_s"], managed["restart_samples_s"])]
    prose = (f"Medians of {len(cold['samples_s'])} rounds. Cold starts took {secs(cold['samples_s'])} s; the "
             f"reloads' vLLM restarts {secs(managed['restart_samples_s'])} s, and stopping vLLM, the digest and the "
             f"canary (loading the checkpoint in the worker and scoring it) {secs(checks)} s more before the ack. "
             f"The box's load average went from {machine['load_average'][0]:.1f} to "
             f"{machine['load_average_end'][0]:.1f} during the run (other jobs): read a managed reload as one vLLM "
             f"start plus the check. The in-place reload took {inplace['seconds']:.2f} s, and the canary found "
             f"vLLM {inplace['canary_mean_abs_delta']:.1f} nats per token off the checkpoint after it.")
    return (provenance(VLLM_RELOAD, result) + "\n\n"
            + table(["case", "seconds", "× cold start", "canary mean \\|Δlogp\\|", "acked"], list("lrrrl"), out)
            + "\n\n" + prose + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a doc differs from its results")
    args = parser.parse_args(argv)
    stale, used = [], set()
    for doc in DOCS:
        path = ROOT / doc
        text = path.read_text()
        used.update(block_names(text))
        fresh = render(text)
        if fresh != text:
            if args.check:
                changed = [a["name"] for a, b in zip(BLOCK_RE.finditer(text), BLOCK_RE.finditer(fresh)) if a[0] != b[0]]
                stale.append(f"{doc}: {', '.join(changed)}")
            else:
                path.write_text(fresh)
                print(f"rewrote {doc}")
    unused = sorted(set(BLOCKS) - used)
    if unused:
        stale.append(f"renderers no doc uses: {', '.join(unused)}")
    if stale:
        print("docs differ from their raw results (run `python docs/render.py`):\n  " + "\n  ".join(stale),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

