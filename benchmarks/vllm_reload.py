"""Policy reload time on vLLM: what a `--serve-cmd` worker's reload costs against a cold start of vLLM.

The worker's reload (ManagedHost.load) is: check the new checkpoint's digest, stop vLLM, start it
on the new directory, wait for `/v1/models`, then the canary check (vLLM's `prompt_logprobs` on
the canary against the checkpoint's own fp32 logprobs) before the ack. The baseline is a cold start
of the same vLLM command until it answers `/v1/models` (what an operator restarting vLLM by hand
waits for, without any check). Rounds run a cold start and then a reload of that server, in turn;
the table gives medians. vLLM keeps its torch.compile output in ~/.cache/vllm, so the very first
start on a machine is slower than every later one: run once before measuring. Also timed: vLLM's in-place reload (dev mode, `POST
/collective_rpc` `reload_weights`), with the canary's verdict on what it serves afterwards.

The new checkpoint is the shipped tiny-moe re-saved with new metadata (a new digest, the same
numbers), so the canary must pass for a server that really loaded it.

    .venv/bin/python benchmarks/vllm_reload.py                # vLLM as docs/vllm.md starts it, 3 rounds
    .venv/bin/python benchmarks/vllm_reload.py --eager        # --enforce-eager (no torch.compile)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from _result import write_result
from rollmarket.contracts import PolicyManifest
from rollmarket.engines.provenance import checkpoint_digest, model_config_hash, tokenizer_hash
from rollmarket.worker.canary import check_server
from rollmarket.worker.host import ManagedHost

ROOT = Path(__file__).resolve().parents[1]
MOE = ROOT / "models" / "tiny-moe"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SERVED = "tiny-moe"
ENV = ("VLLM_CPU_KVCACHE_SPACE=1", "HF_HUB_OFFLINE=1", "VLLM_NO_USAGE_STATS=1", "DO_NOT_TRACK=1")
console = Console()


def serve_cmd(eager: bool, dev_mode: bool = False) -> str:
    """vLLM's server as docs/vllm.md starts it, with {model} and {port} for ManagedHost."""
    return shlex.join(["env", *ENV, *(["VLLM_SERVER_DEV_MODE=1"] if dev_mode else []), str(VLLM_PYTHON), "-m",
                       "vllm.entrypoints.openai.api_server", "--model", "{model}", "--served-model-name", SERVED,
                       "--dtype", "bfloat16", "--max-model-len", "2048", "--host", "127.0.0.1", "--port", "{port}",
                       *(["--enforce-eager"] if eager else [])])


def resaved(tmp: Path) -> Path:
    """The shipped weights re-saved with new metadata: a new digest, the same numbers."""
    from safetensors.torch import load_file, save_file

    target = tmp / "ckpt-v1"
    shutil.copytree(MOE, target)
    save_file(load_file(str(MOE / "model.safetensors")), str(target / "model.safetensors"),
              metadata={"format": "pt", "policy_version": "1"})
    return target


def manifest(version: int, path: Path) -> PolicyManifest:
    return PolicyManifest(policy_version=version, checkpoint_digest=checkpoint_digest(path), checkpoint_uri=str(path),
                          tokenizer_hash=tokenizer_hash(path), model_config_hash=model_config_hash(path),
                          precision_class="bf16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eager", action="store_true", help="start vLLM with --enforce-eager")
    parser.add_argument("--rounds", type=int, default=3, help="cold starts and reloads, in turn (medians)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vllm_reload.json")
    args = parser.parse_args()
    if not VLLM_PYTHON.exists():
        sys.exit(f"{VLLM_PYTHON} is missing: run `make vllm`")
    load_at_start = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="vllm-reload-"))
    new = resaved(tmp)
    colds, reloads, restarts, deltas = [], [], [], []
    for round_ in range(args.rounds):  # a cold start, then a reload of that server, in turn
        with console.status(f"round {round_ + 1}/{args.rounds}: cold start of vLLM (the baseline)"):
            host = ManagedHost(serve_cmd(args.eager), MOE, log=tmp / "managed.log")
        colds.append(host.started_s)
        try:
            with console.status(f"round {round_ + 1}/{args.rounds}: managed reload (restart + canary)"):
                started = time.perf_counter()
                host.load(manifest(1, new))
                reloads.append(time.perf_counter() - started)
            restarts.append(host.started_s)
            deltas.append(host.last_check.mean_abs_delta)
        finally:
            host.close()
    rows = [{"case": "cold start (until /v1/models answers)", "seconds": statistics.median(colds),
             "samples_s": colds, "canary_mean_abs_delta": None, "acked": None},
            {"case": "managed reload (restart + digest + canary, then ack)", "seconds": statistics.median(reloads),
             "samples_s": reloads, "restart_s": statistics.median(restarts), "restart_samples_s": restarts,
             "canary_mean_abs_delta": max(deltas), "acked": True}]
    with console.status("vLLM in dev mode for the in-place reload"):
        dev = ManagedHost(serve_cmd(args.eager, dev_mode=True), MOE, log=tmp / "dev.log")
    try:
        base = dev.url[: -len("/v1")]
        started = time.perf_counter()
        for route, body in (("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(new)}}),
                            ("/reset_prefix_cache", None)):
            answer = httpx.post(base + route, json=body, timeout=600)
            answer.raise_for_status()
        inplace = time.perf_counter() - started
        check = check_server(dev.url, SERVED, new)
        rows.append({"case": "in-place reload (collective_rpc reload_weights)", "seconds": inplace,
                     "canary_mean_abs_delta": check.mean_abs_delta, "acked": check.passed})
    finally:
        dev.close()
    shutil.rmtree(tmp, ignore_errors=True)
    for row in rows:
        row["ratio_to_cold_start"] = row["seconds"] / rows[0]["seconds"]
    view = Table("case", "seconds", "× cold start", "canary mean |Δ|", "acked")
    for row in rows:
        delta = row["canary_mean_abs_delta"]
        view.add_row(row["case"], f"{row['seconds']:.2f}", f"{row['ratio_to_cold_start']:.2f}×",
                     "–" if delta is None else f"{delta:.3f}", "–" if row["acked"] is None else str(row["acked"]))
    console.print(view)
    write_result(args.out, "vllm_reload", args, rows)
    result = json.loads(args.out.read_text())  # the docs quote the load at the start, not after minutes of vLLM
    result["machine"]["load_average_end"] = result["machine"]["load_average"]
    result["machine"]["load_average"] = list(load_at_start)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
